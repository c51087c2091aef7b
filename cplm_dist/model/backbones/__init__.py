"""The backbones as records: each names its features, and every part of the stack asks the record
for a feature, never the backbone's name (litgpt's way: a new architecture is a new record).

| feature | read by |
|---|---|
| norm: rmsnorm, layernorm | cplm_dist.model.norm (the module), counting (its tensors), profiling.memory (what it saves) |
| mlp: swiglu ([gate; up] in one fc1), gelu | cplm_dist.model.mlp, counting, profiling.memory |
| bias on every linear (QKV, attention out, MLP) | cplm_dist.model.attention and mlp, counting |
| qk_norm: RMS-normalised queries and keys per head (one [head_dim] weight each, before RoPE) | cplm_dist.model.attention (its `qk_norm` slot), counting and profiling.memory through it |
| positions: rope (in attention), learned (added to the embedding) | rotary, model.parts, counting, profiling.memory |
| hf: transformers' model_type its weights map onto (llama, gpt2), whose map is cplm_dist/hf_<hf>.py | model.init_from (cplm_dist.interop.init_from), tools/export_hf.py |
| the MLP width rule of a scaling ladder | cplm_dist.experiments.scaling |

A third backbone is a record here (and its name in config.tree's `Arch`); a feature no record has
yet is one more field and the sites that read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Backbone:
    name: str
    norm: str  # "rmsnorm" | "layernorm" (weight and bias)
    mlp: str  # "swiglu" (fc1 holds [gate; up], 2 x ffn rows) | "gelu"
    bias: bool  # every linear has a bias (column-parallel ones split over tp, row-parallel ones replicated)
    positions: str  # "rope" (rotary q, k in attention) | "learned" (a max_seq_len x D table added to the embedding)
    qk_norm: bool  # queries and keys RMS-normalised per head before RoPE (a [head_dim] weight each, shared by the heads)
    hf: str  # transformers' model_type its weights map onto; cplm_dist/hf_<hf>.py is the map (import and export)
    ffn_ratio: tuple[int, int]  # the scaling ladders' MLP width: ffn = ratio x hidden ...
    ffn_multiple: int  # ... rounded up to a multiple of this

    @property
    def gated_mlp(self) -> bool:
        """fc1 holds two ffn-wide halves (a gate and its input)."""
        return self.mlp == "swiglu"

    def norm_tensors(self, hidden: int) -> list[int]:
        """Elements of each tensor of one norm: a weight, and with LayerNorm a bias."""
        return [hidden] * (2 if self.norm == "layernorm" else 1)

    def mlp_width(self, hidden: int) -> int:
        """The MLP width a scaling ladder gives a model of width `hidden`."""
        num, den = self.ffn_ratio
        return self.ffn_multiple * math.ceil(num * hidden / den / self.ffn_multiple)


BACKBONES = {
    # RMSNorm, SwiGLU (8/3 D, a multiple of 64), RoPE, no biases
    "llama": Backbone("llama", norm="rmsnorm", mlp="swiglu", bias=False, positions="rope", qk_norm=False, hf="llama",
                      ffn_ratio=(8, 3), ffn_multiple=64),
    # LayerNorm with bias, GELU MLP (4 D), learned absolute positions, biases on every linear
    "gpt2": Backbone("gpt2", norm="layernorm", mlp="gelu", bias=True, positions="learned", qk_norm=False, hf="gpt2",
                     ffn_ratio=(4, 1), ffn_multiple=1),
    # Llama's features plus RMS-normalised queries and keys per head before RoPE; its head width is
    # model.head_dim (128 in the released sizes, not hidden / heads); SwiGLU at 3 D
    "qwen3": Backbone("qwen3", norm="rmsnorm", mlp="swiglu", bias=False, positions="rope", qk_norm=True, hf="qwen3",
                      ffn_ratio=(3, 1), ffn_multiple=64),
}


def backbone(model_cfg) -> Backbone:
    """The record of a ModelConfig's backbone (model.arch)."""
    return BACKBONES[model_cfg.arch]


def backbones_with(**features) -> list[str]:
    """The names of the backbones whose records have these features (e.g. positions="rope", or
    hf=<a HF config's model_type>): what a message suggests instead."""
    return [name for name, b in BACKBONES.items() if all(getattr(b, k) == v for k, v in features.items())]
