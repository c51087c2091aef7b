"""Seeded, tp-independent initialisation: every parameter's full tensor is drawn from its own
generator (seed, parameter name) and each rank keeps its shard, so one seed gives one model at
every tp, in any construction order. An expert's generator is named by its global id
(cplm_dist.model.moe.global_expert_name), so the experts are the same at every ep.

The rules, by parameter name (first match wins):

| parameter                               | init                                        |
|-----------------------------------------|---------------------------------------------|
| *norm.weight                            | ones                                        |
| *.bias (except the copy gate's)         | zeros                                       |
| copy_head.gate.bias                     | copy.gate_bias_init                         |
| copy_head.*                             | normal(0, copy.init_std)                    |
| *attention.proj.weight, *mlp.fc2.weight | normal(0, init_std / sqrt(2 L)) if scaled   |
| *mlp.*linear_fc2.weight (experts)       | the same                                    |
| everything else                         | normal(0, init_std)                         |

Vocabulary-sized tensors draw only their real rows; Megatron's padding rows start at zero.
"""

from __future__ import annotations

import math
import zlib

import torch

from cplm_dist.config import CopyConfig, ModelConfig
from cplm_dist.model.moe_naming import global_expert_name
from cplm_dist.model.parallel.sharding import full_shape, spec_of, take_shard


def deferred_init(_weight: torch.Tensor) -> None:
    """The init_method handed to megatron layers: they allocate, `init_parameters` fills."""


def _rule(name: str, m: ModelConfig, c: CopyConfig) -> tuple[str, float]:
    if name.endswith("norm.weight"):
        return "const", 1.0
    if name == "copy_head.gate.bias":
        return "const", c.gate_bias_init
    if name.endswith(".bias"):
        return "const", 0.0
    if name.startswith("copy_head."):
        return "normal", c.init_std
    if m.scaled_init and (name.endswith("attention.proj.weight") or name.endswith("mlp.fc2.weight")
                          or ".mlp." in name and name.endswith("linear_fc2.weight")):
        return "normal", m.init_std / math.sqrt(2.0 * m.num_layers)
    return "normal", m.init_std


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


@torch.no_grad()
def init_parameters(model: torch.nn.Module | list, model_cfg: ModelConfig, copy_cfg: CopyConfig, seed: int,
                    tp_rank: int, tp_size: int) -> None:
    """Fill every parameter of `model` (already sharded for tp_size) from `seed`; or of a list of
    (name in CPLM, parameter), a pipeline stage's (cplm_dist.training.pipeline)."""
    named = model.named_parameters() if isinstance(model, torch.nn.Module) else model
    for name, param in named:
        kind, value = _rule(name, model_cfg, copy_cfg)
        if kind == "const":
            param.fill_(value)
            continue
        name = global_expert_name(name, param)
        spec = spec_of(param)
        shape = full_shape(param.shape, spec, tp_size)
        rows = spec.full_rows if spec.full_rows is not None else shape[0]
        full = torch.zeros(shape, dtype=torch.float32, device=param.device)
        full[:rows].normal_(0.0, value, generator=_generator(seed, name, param.device))
        param.copy_(take_shard(full, spec, tp_rank, tp_size))
