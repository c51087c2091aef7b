"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)); the norm and MLP
are the backbone's (model.arch: RMSNorm + SwiGLU for llama, LayerNorm + GELU for gpt2).

Under sequence parallelism x is this rank's (T/tp, B, D) positions: norms and residuals run on
them, the attention and MLP linears gather and scatter the sequence (megatron-core)."""

import torch

from cplm_dist.config import ModelConfig
from cplm_dist.megatron_compat import ModelParallelConfig
from cplm_dist.model.attention import Attention
from cplm_dist.model.mlp import make_mlp
from cplm_dist.model.norm import make_norm


class TransformerLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, mp: ModelParallelConfig, tp_group, tp_size: int, device=None):
        super().__init__()
        grad_group = tp_group if mp.sequence_parallel else None  # norms see this rank's positions only
        self.attn_norm = make_norm(cfg, device=device, dtype=mp.params_dtype, grad_group=grad_group)
        self.attention = Attention(cfg, mp, tp_group, tp_size)
        self.mlp_norm = make_norm(cfg, device=device, dtype=mp.params_dtype, grad_group=grad_group)
        self.mlp = make_mlp(cfg, mp, tp_group, tp_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                cache: dict | None = None) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x), cos, sin, cache)
        return x + self.mlp(self.mlp_norm(x))
