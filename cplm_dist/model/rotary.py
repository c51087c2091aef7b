"""Positions (a backbone's `positions`): rotary embedding (RoPE, rotate-half convention, Llama /
Megatron default), or learned absolute positions added to the embedding (GPT-2's)."""

import torch

from cplm_dist.model.backbone import backbone


def rope_tables(seq_len: int, dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, dim) in float32 for positions 0..seq_len-1."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, dim)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, dim) rotated by position; computed in float32, returned in x's dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def layer_rope(cfg, length: int, offset: int = 0, device=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """cos, sin for positions offset .. offset + length - 1 of the backbone's attention; (None,
    None) for a backbone whose positions are learned and added to the embedding instead."""
    if backbone(cfg).positions != "rope":
        return None, None
    cos, sin = rope_tables(offset + length, cfg.head_dim, cfg.rope_theta, device=device)
    return cos[offset:], sin[offset:]


class LearnedPositions(torch.nn.Module):
    """GPT-2's absolute position embedding (max_seq_len x D), replicated on every tp rank, added
    to the token embedding. Under sequence parallelism a rank adds only its own positions
    (`sp_group`, the tp group), so the table's gradient is summed over tp."""

    def __init__(self, max_seq_len: int, dim: int, *, device=None, dtype=None, sp_group=None):
        super().__init__()
        from cplm_dist.model.sequence_parallel import active

        self.weight = torch.nn.Parameter(torch.empty(max_seq_len, dim, device=device, dtype=dtype))
        self.sp_group = sp_group if active(sp_group) else None

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """x (B, T, D) of positions offset.., or under sequence parallelism this rank's (T/tp, B, D)."""
        from cplm_dist.model.sequence_parallel import sum_grad_over

        if self.sp_group is None:
            return x + self.weight[offset : offset + x.shape[1]]
        start = offset + self.sp_group.rank() * x.shape[0]
        return x + sum_grad_over(self.weight, self.sp_group)[start : start + x.shape[0], None]
