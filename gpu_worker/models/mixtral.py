"""Mixtral (`MixtralForCausalLM`): Mistral with every MLP a sparse mixture of experts (top-2 of 8
in the released models; `layers/moe.py`), the top-k weights renormalised and kept in fp32. The
checkpoint names the block `block_sparse_moe` and each expert's gate, down and up `w1`, `w2`,
`w3`."""

from __future__ import annotations

from typing import ClassVar

from tgq.gpu_worker.models.decoder import DecoderForCausalLM

_RENAMES = {
    ".mlp.": ".block_sparse_moe.",
    ".gate_proj.": ".w1.",
    ".down_proj.": ".w2.",
    ".up_proj.": ".w3.",
}


class MixtralForCausalLM(DecoderForCausalLM):
    uses_sliding_window: ClassVar[bool] = True
    router_weights_in_model_dtype: ClassVar[bool] = False

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        if ".experts." not in name and not name.endswith(".mlp.gate.weight"):
            return name
        for ours, theirs in _RENAMES.items():
            name = name.replace(ours, theirs)
        return name
