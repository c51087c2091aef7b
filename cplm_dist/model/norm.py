"""RMSNorm and LayerNorm with bias (a backbone's `norm`), replicated on every tp rank, computed in
float32 whatever the activation dtype.

Under sequence parallelism each tp rank normalises its own positions only: `grad_group` (the tp
group) sums the weight's gradient (cplm_dist.model.parallel.sequence.sum_grad_over).
"""

import torch

from cplm_dist.model.backbones import backbone
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
    """The backbone's norm (its record's `norm`) for a ModelConfig."""
    cls = NORMS[backbone(cfg).norm]
    return cls(cfg.hidden_size, cfg.norm_eps, device=device, dtype=dtype, grad_group=grad_group)
