"""tgq, the text generation queue. Every module installs under this one name (`tgq.api`,
`tgq.batcher`, `tgq.kernels`, ...), so nothing of tgq's shadows another distribution's top-level
package (Hugging Face's `kernels`, for one). In the repository the subpackages are the top-level
folders; `tgq/` links to them."""
