"""HTTP request and response bodies: `tgi` mirrors TGI's OpenAPI spec, `openai` the OpenAI API.

Schemas only describe shapes; the rules that need settings (limits, defaults, TGI's exact
messages) live in `api.validation`.
"""
