"""What a backbone record holds: its features, each read by the parts of the stack that need it
(never the backbone's name), and its HF adapter. The records themselves are in the families'
files (llama.py, gpt2.py, qwen3.py), each beside its adapter; cplm_dist.config.backbones gathers them.

| feature | read by |
|---|---|
| norm: rmsnorm, layernorm | cplm_dist.model.norm (the module), counting (its tensors), profiling.memory (what it saves) |
| mlp: swiglu ([gate; up] in one fc1), gelu | cplm_dist.model.mlp, counting, profiling.memory |
| bias on every linear (QKV, attention out, MLP) | cplm_dist.model.attention and mlp, counting |
| qk_norm: RMS-normalised queries and keys per head (one [head_dim] weight each, before RoPE) | cplm_dist.model.attention (its `qk_norm` slot), counting and profiling.memory through it |
| positions: rope (in attention), learned (added to the embedding) | model.positions, model.parts, counting, profiling.memory |
| hf: the HF adapter (hf_adapter.HFAdapter: transformers' class, config and weight names, both ways) | model.init_from and the HF directories (cplm_dist.interop), tools/export_hf.py |
| the MLP width rule of a scaling ladder | cplm_dist.experiments.scaling |
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cplm_dist.config.backbones.hf_adapter import HFAdapter


@dataclass(frozen=True)
class Backbone:
    name: str
    norm: str  # "rmsnorm" | "layernorm" (weight and bias)
    mlp: str  # "swiglu" (fc1 holds [gate; up], 2 x ffn rows) | "gelu"
    bias: bool  # every linear has a bias (column-parallel ones split over tp, row-parallel ones replicated)
    positions: str  # "rope" (rotary q, k in attention) | "learned" (a max_seq_len x D table added to the embedding)
    qk_norm: bool  # queries and keys RMS-normalised per head before RoPE (a [head_dim] weight each, shared by the heads)
    hf: HFAdapter  # the map onto transformers' class (import and export), written beside the record
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
