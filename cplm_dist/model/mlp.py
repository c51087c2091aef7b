"""The MLPs as Column/Row parallel pairs: SwiGLU, and GELU with biases (a backbone's `mlp`).

SwiGLU's fc1 holds [gate; up] with stride 2, so each tp rank keeps matching halves of both and
the product needs no communication; fc2's all-reduce ends the tensor-parallel region.
"""

import torch
import torch.nn.functional as F

from cplm_dist.config import ModelConfig
from cplm_dist.config.backbones import backbone
from cplm_dist.megatron_compat import ModelParallelConfig, tensor_parallel
from cplm_dist.model.attention import OutputLinear
from cplm_dist.model.initialization import deferred_init
from cplm_dist.model.layer_shapes import by_name, mlp_shapes
from cplm_dist.model.parallel.sharding import mark_split


def mlp_linears(cfg: ModelConfig, mp: ModelParallelConfig, tp_group):
    """(fc1, fc2) as cplm_dist.model.layer_shapes.mlp_shapes has them: fc1 column-parallel (a gated
    MLP's [gate; up] of stride 2), fc2 ending the tp region; biases where the backbone has them."""
    shapes = by_name(mlp_shapes(cfg))
    w1 = shapes["fc1.weight"]
    (rows, hidden), (_, ffn) = w1.shape, shapes["fc2.weight"].shape
    fc1 = tensor_parallel.ColumnParallelLinear(
        hidden, rows, config=mp, init_method=deferred_init, bias="fc1.bias" in shapes, gather_output=False,
        stride=w1.stride, tp_group=tp_group,
    )
    for param in fc1.parameters():
        mark_split(param, dim=0, stride=w1.stride)
    return fc1, OutputLinear(ffn, hidden, mp, tp_group, bias="fc2.bias" in shapes)


class SwiGLUMLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, mp: ModelParallelConfig, tp_group, tp_size: int):
        super().__init__()
        self.fc1, self.fc2 = mlp_linears(cfg, mp, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)  # (B, T, 2 * ffn / tp): [gate | up] of this rank
        gate, up = h.chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)  # (B, T, D), all-reduced over tp


class GeluMLP(torch.nn.Module):
    """GPT-2's MLP: fc1 (D -> ffn, bias), GELU (tanh approximation), fc2 (ffn -> D, bias)."""

    def __init__(self, cfg: ModelConfig, mp: ModelParallelConfig, tp_group, tp_size: int):
        super().__init__()
        self.fc1, self.fc2 = mlp_linears(cfg, mp, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)  # (B, T, ffn / tp)
        return self.fc2(F.gelu(h, approximate="tanh"))


MLPS = {"swiglu": SwiGLUMLP, "gelu": GeluMLP}


def make_mlp(cfg: ModelConfig, mp: ModelParallelConfig, tp_group, tp_size: int) -> torch.nn.Module:
    """The backbone's MLP (its record's `mlp`; a bias on each linear where the record has them)."""
    return MLPS[backbone(cfg).mlp](cfg, mp, tp_group, tp_size)
