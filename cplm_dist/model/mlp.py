"""The MLPs as Column/Row parallel pairs: SwiGLU, and GELU with biases (a backbone's `mlp`).

SwiGLU's fc1 holds [gate; up] with stride 2, so each tp rank keeps matching halves of both and
the product needs no communication; fc2's all-reduce ends the tensor-parallel region.
"""

import torch
import torch.nn.functional as F

from cplm_dist.config import ModelConfig
from cplm_dist.megatron_compat import ModelParallelConfig, tensor_parallel
from cplm_dist.model.attention import OutputLinear
from cplm_dist.model.backbones import backbone
from cplm_dist.model.initialization import deferred_init
from cplm_dist.model.parallel.sharding import mark_split


class SwiGLUMLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, mp: ModelParallelConfig, tp_group, tp_size: int):
        super().__init__()
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            cfg.hidden_size, 2 * cfg.ffn_hidden_size, config=mp, init_method=deferred_init, bias=False,
            gather_output=False, stride=2, tp_group=tp_group,
        )
        self.fc2 = OutputLinear(cfg.ffn_hidden_size, cfg.hidden_size, mp, tp_group, bias=False)
        mark_split(self.fc1.weight, dim=0, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)  # (B, T, 2 * ffn / tp): [gate | up] of this rank
        gate, up = h.chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)  # (B, T, D), all-reduced over tp


class GeluMLP(torch.nn.Module):
    """GPT-2's MLP: fc1 (D -> ffn, bias), GELU (tanh approximation), fc2 (ffn -> D, bias)."""

    def __init__(self, cfg: ModelConfig, mp: ModelParallelConfig, tp_group, tp_size: int):
        super().__init__()
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            cfg.hidden_size, cfg.ffn_hidden_size, config=mp, init_method=deferred_init, bias=True,
            gather_output=False, tp_group=tp_group,
        )
        self.fc2 = OutputLinear(cfg.ffn_hidden_size, cfg.hidden_size, mp, tp_group, bias=True)
        mark_split(self.fc1.weight, dim=0)
        mark_split(self.fc1.bias, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)  # (B, T, ffn / tp)
        return self.fc2(F.gelu(h, approximate="tanh"))


MLPS = {"swiglu": SwiGLUMLP, "gelu": GeluMLP}


def make_mlp(cfg: ModelConfig, mp: ModelParallelConfig, tp_group, tp_size: int) -> torch.nn.Module:
    """The backbone's MLP (its record's `mlp`; a bias on each linear where the record has them)."""
    return MLPS[backbone(cfg).mlp](cfg, mp, tp_group, tp_size)
