"""The backbones as records: each names its features, and every part of the stack asks the record
for a feature, never the backbone's name (litgpt's way: a new architecture is a new record).

    record.py      `Backbone`: the features and who reads them (norm, mlp, bias, qk_norm, positions, hf, width rule)
    hf_adapter.py  `HFAdapter`: a record's map onto a transformers class (torchtitan's state-dict adapter)
    sparse_hf.py   the sparse MLP's part of a mixture-of-experts class's adapter (model.moe: Qwen3-MoE, Mixtral)
    llama.py, gpt2.py, qwen3.py   each family's record beside its adapter

A new backbone is a file here holding its record and adapter, its record in BACKBONES (and its
name in config.tree's `Arch`); a feature no record has yet is one more field of `Backbone` and the
sites that read it. The records are in the config package because config.validation reads them
at load (model.rope_scaling needs rotary positions); with their adapters they import the config,
the errors and torch, never the model.
"""

from __future__ import annotations

from cplm_dist.config.backbones.gpt2 import GPT2
from cplm_dist.config.backbones.hf_adapter import HFAdapter
from cplm_dist.config.backbones.llama import LLAMA
from cplm_dist.config.backbones.qwen3 import QWEN3
from cplm_dist.config.backbones.record import Backbone
from cplm_dist.errors import ConfigError

__all__ = ["BACKBONES", "Backbone", "HFAdapter", "backbone", "backbones_with", "hf_adapter"]

BACKBONES: dict[str, Backbone] = {b.name: b for b in (LLAMA, GPT2, QWEN3)}


def backbone(model_cfg) -> Backbone:
    """The record of a ModelConfig's backbone (model.arch)."""
    return BACKBONES[model_cfg.arch]


def backbones_with(**features) -> list[str]:
    """The names of the backbones whose records have these features (e.g. positions="rope"): what
    a message suggests instead."""
    return [name for name, b in BACKBONES.items() if all(getattr(b, k) == v for k, v in features.items())]


def hf_adapter(model_cfg) -> HFAdapter:
    """The HF adapter a model imports and exports through: its record's, or for a sparse model
    (model.moe.num_experts > 0) the record's mixture-of-experts one (`hf.sparse`); one line where
    its family has none."""
    hf = backbone(model_cfg).hf
    if model_cfg.moe.num_experts == 0:
        return hf
    if hf.sparse is None:
        sparse = [f"{name} ({b.hf.sparse.family})" for name, b in BACKBONES.items() if b.hf.sparse is not None]
        raise ConfigError(f"model.arch={model_cfg.arch} with model.moe has no Hugging Face class here: a sparse model "
                          f"imports and exports as model.arch={' or '.join(sparse)}")
    return hf.sparse
