"""The sparse MLP (model.moe, cplm_dist.model.moe) onto transformers' mixture-of-experts classes,
both ways: the part of a sparse family's adapter (Qwen3-MoE in qwen3.py, Mixtral in llama.py)
that its dense one lacks. transformers' MoE classes route as megatron's softmax router does (a
softmax over the experts, the top k, renormalised where norm_topk_prob / model.moe.normalize say),
with no shared expert, no expert bias and no capacity, so those of our options are refused (one
line) both ways.

| ours (full weights, experts by global id) | HF (the Hub's layout: one tensor per expert) |
|---|---|
| layers.i.mlp.router.weight [E, D] | model.layers.i.<block>.gate.weight |
| layers.i.mlp.experts.local_experts.e.linear_fc1.weight [2 F, D] = [gate; up] | <block>.experts.e.<gate>.weight, <up>.weight |
| layers.i.mlp.experts.local_experts.e.linear_fc2.weight [D, F] | <block>.experts.e.<down>.weight |

(<block> mlp and gate_proj / up_proj / down_proj for Qwen3-MoE; block_sparse_moe and w1 / w3 / w2
for Mixtral.) transformers 5 fuses the experts into one [E, 2F, D] tensor as it loads (its
conversion mapping) and writes them back one per expert, so files in the Hub's layout are what
both transformers 4 and 5 read and write; an import takes the fused layout under <block> too.
Which layers are sparse: HF's rule (layer i sparse unless in mlp_only_layers, when (i + 1) is a
multiple of decoder_sparse_step) against model.moe.sparse_layers (first_dense_layers, then every
layer_freq-th).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cplm_dist.config.backbones.hf_adapter import Weights
from cplm_dist.errors import ConfigError, HFImportError

if TYPE_CHECKING:  # the config package imports the records (config.validation): types only here
    from cplm_dist.config.tree import ModelConfig

EXPERTS = "mlp.experts.local_experts"


@dataclass(frozen=True)
class ExpertNames:
    """One HF MoE class's names of a layer's sparse block and an expert's projections."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


def expert_width(m: ModelConfig) -> int:
    """One expert's width: model.moe.ffn_hidden_size, else model.ffn_hidden_size."""
    return m.moe.ffn_hidden_size or m.ffn_hidden_size


def unsupported(m: ModelConfig, family: str, always_normalized: bool = False) -> str | None:
    """What of model.moe `family`'s MoE class does not compute (the fix in words), or None."""
    e = m.moe
    if e.score != "softmax":
        return f"model.moe.score={e.score}; {family} routes on a softmax over the experts: set model.moe.score=softmax"
    if e.shared_ffn_hidden_size:
        return (f"model.moe.shared_ffn_hidden_size={e.shared_ffn_hidden_size}; {family} has no shared expert: set "
                "model.moe.shared_ffn_hidden_size=0")
    if e.capacity_factor is not None:
        return (f"model.moe.capacity_factor={e.capacity_factor} drops tokens; {family} is dropless: set "
                "model.moe.capacity_factor=null")
    if always_normalized and not e.normalize:
        return f"model.moe.normalize=false; {family} renormalises the top-k weights: set model.moe.normalize=true"
    return None


def refuse_export(m: ModelConfig, family: str, always_normalized: bool = False) -> None:
    """A ConfigError line where the model computes what `family`'s class does not (export side)."""
    why = unsupported(m, family, always_normalized)
    if why is not None:
        raise ConfigError(f"not exportable as {family}: {why}")


def hf_sparse_layers(num_layers: int, step: int, mlp_only: list[int]) -> list[int]:
    """transformers' rule (Qwen2/3-MoE's decoder layer): layer i is sparse unless listed in
    mlp_only_layers, when (i + 1) % decoder_sparse_step == 0."""
    return [i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0]


def sparse_layer_keys(m: ModelConfig) -> dict:
    """config.json's decoder_sparse_step and mlp_only_layers naming model.moe.sparse_layers exactly."""
    sparse = m.moe.sparse_layers(m.num_layers)
    return {"decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(m.num_layers) if i not in sparse]}


def check_sparse_layers(hf_sparse: list[int], keys: str, m: ModelConfig, where: str) -> None:
    """The HF model's sparse layers are the run's, or one line: the first_dense_layers / layer_freq
    that give them, or that none do."""
    e, L = m.moe, m.num_layers
    if hf_sparse == e.sparse_layers(L):
        return
    fits = [(first, freq) for first in range(L) for freq in range(1, L + 1)
            if [i for i in range(first, L) if (i - first) % freq == 0] == hf_sparse]
    if not fits:
        raise HFImportError(f"{where}: sparse layers {hf_sparse} ({keys}), which no model.moe.first_dense_layers and "
                            "layer_freq give (the first layers dense, then every layer_freq-th sparse): not importable")
    first, freq = fits[0]
    raise HFImportError(f"{where}: sparse layers {hf_sparse} ({keys}) but model.moe gives {e.sparse_layers(L)}: set "
                        f"model.moe.first_dense_layers={first} model.moe.layer_freq={freq}")


def check_experts(theirs: dict[str, tuple[str, object]], m: ModelConfig, where: str) -> None:
    """theirs: {model.moe field: (the HF key, its value)}; one line naming the first that differs."""
    ours = {"num_experts": m.moe.num_experts, "top_k": m.moe.top_k, "ffn_hidden_size": expert_width(m),
            "normalize": m.moe.normalize}
    for field, (key, value) in theirs.items():
        if value != ours[field]:
            raise HFImportError(f"{where}: {key}={_shown(value)} but the run's model.moe.{field} is "
                                f"{_shown(ours[field])}: set model.moe.{field}={_shown(value)}")


def _shown(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def to_hf(full: Weights, m: ModelConfig, names: ExpertNames) -> Weights:
    """The sparse layers' router and experts of our full weights (experts by global id) in the
    Hub's layout of the HF class `names` describes."""
    out = {}
    for i in m.moe.sparse_layers(m.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}.{names.block}."
        out[theirs + "gate.weight"] = full[ours + "mlp.router.weight"]
        for e in range(m.moe.num_experts):
            gate, up = full[f"{ours}{EXPERTS}.{e}.linear_fc1.weight"].chunk(2, dim=0)
            expert = f"{theirs}experts.{e}."
            out[f"{expert}{names.gate}.weight"], out[f"{expert}{names.up}.weight"] = gate, up
            out[f"{expert}{names.down}.weight"] = full[f"{ours}{EXPERTS}.{e}.linear_fc2.weight"]
    return out


def from_hf(hf: Weights, m: ModelConfig, names: ExpertNames) -> Weights:
    """The sparse layers' weights of a HF state dict (the Hub's layout, or transformers 5's fused
    experts.gate_up_proj [E, 2F, D] / experts.down_proj [E, D, F]) as our full weights."""
    full = {}
    for i in m.moe.sparse_layers(m.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}.{names.block}."
        full[ours + "mlp.router.weight"] = hf[theirs + "gate.weight"]
        fused = theirs + "experts.gate_up_proj" in hf
        for e in range(m.moe.num_experts):
            expert = f"{theirs}experts.{e}."
            if fused:
                fc1, fc2 = hf[theirs + "experts.gate_up_proj"][e], hf[theirs + "experts.down_proj"][e]
            else:
                fc1 = torch.cat([hf[f"{expert}{names.gate}.weight"], hf[f"{expert}{names.up}.weight"]])
                fc2 = hf[f"{expert}{names.down}.weight"]
            full[f"{ours}{EXPERTS}.{e}.linear_fc1.weight"], full[f"{ours}{EXPERTS}.{e}.linear_fc2.weight"] = fc1, fc2
    return full
