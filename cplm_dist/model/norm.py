"""RMSNorm and LayerNorm with bias (a backbone's `norm`), replicated on every tp rank, computed in
float32 whatever the activation dtype; and the qk-norm slot (a backbone's `qk_norm`: RMSNorm over
head_dim of each query and key head, Qwen3's), identities where the backbone has none.

Under sequence parallelism each tp rank normalises its own positions only: `grad_group` (the tp
group) sums the weight's gradient (cplm_dist.model.parallel.sequence.sum_grad_over). The qk-norm
weights are shared by every head and a rank holds its own heads, so theirs is summed over tp always.
Shapes: cplm_dist.model.layer_shapes.
"""

import torch

from cplm_dist.config.backbones import backbone
from cplm_dist.model.layer_shapes import norm_shapes, qk_norm_shapes
from cplm_dist.model.parallel.sequence import sum_grad_over


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, *, device=None, dtype=None, grad_group=None):
        super().__init__()
        self.eps = eps
        self.grad_group = grad_group
        self.weight = torch.nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * sum_grad_over(self.weight, self.grad_group).float()).to(x.dtype)


class LayerNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, *, device=None, dtype=None, grad_group=None):
        super().__init__()
        self.eps = eps
        self.grad_group = grad_group
        self.weight = torch.nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = (sum_grad_over(p, self.grad_group).float() for p in (self.weight, self.bias))
        return torch.nn.functional.layer_norm(x.float(), x.shape[-1:], weight, bias, self.eps).to(x.dtype)


NORMS = {"rmsnorm": RMSNorm, "layernorm": LayerNorm}


def make_norm(cfg, *, device=None, dtype=None, grad_group=None) -> torch.nn.Module:
    """The backbone's norm (its record's `norm`) over hidden_size, for a ModelConfig."""
    (dim,) = norm_shapes(cfg)[0].shape
    return NORMS[backbone(cfg).norm](dim, cfg.norm_eps, device=device, dtype=dtype, grad_group=grad_group)


def make_qk_norms(cfg, *, device=None, dtype=None, grad_group=None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The qk-norm slot: (q_norm, k_norm), RMSNorms over head_dim whose gradients `grad_group` (the
    tp group) sums; two identities (no parameters) where the backbone has no qk-norm."""
    shapes = qk_norm_shapes(cfg)
    if not shapes:
        return torch.nn.Identity(), torch.nn.Identity()
    return tuple(RMSNorm(s.shape[0], cfg.norm_eps, device=device, dtype=dtype, grad_group=grad_group) for s in shapes)
