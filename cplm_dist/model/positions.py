"""Positions (a backbone's `positions`): rotary embedding (RoPE, rotate-half convention, Llama /
Megatron default), or learned absolute positions added to the embedding (GPT-2's)."""

import torch

from cplm_dist.config.backbones import backbone


def scaled_theta(dim: int, theta: float, scaling=None) -> float:
    """The base RoPE runs at: model.rope_scaling's (RopeScaling.scaled_theta: ntk stretches it),
    otherwise theta."""
    return theta if scaling is None else scaling.scaled_theta(theta, dim)


def rope_angles(positions: torch.Tensor, dim: int, theta: float, scaling=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (*positions.shape, dim) in float32 for integer `positions` (any shape).
    model.rope_scaling (None, or .type linear | ntk and .factor): linear divides the positions by
    the factor (position interpolation), ntk stretches the base (`scaled_theta`)."""
    base = scaled_theta(dim, theta, scaling)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    pos = positions.to(torch.float32)
    if scaling is not None and scaling.type == "linear":
        pos = pos / scaling.factor
    angles = pos.unsqueeze(-1) * inv_freq  # (..., dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., dim)
    return angles.cos(), angles.sin()


def rope_tables(seq_len: int, dim: int, theta: float, device=None, scaling=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, dim) in float32 for positions 0..seq_len-1."""
    return rope_angles(torch.arange(seq_len, device=device), dim, theta, scaling)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, dim) rotated by position; computed in float32, returned in x's dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def layer_rope(cfg, length: int, offset: int = 0, device=None,
               position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """cos, sin for positions offset .. offset + length - 1 of the backbone's attention, (T, dim),
    or for the positions `position_ids` (B, T) reads (document masking), (B, 1, T, dim); (None,
    None) for a backbone whose positions are learned and added to the embedding instead."""
    if backbone(cfg).positions != "rope":
        return None, None
    scaling = getattr(cfg, "rope_scaling", None)
    if position_ids is not None:
        cos, sin = rope_angles(position_ids, cfg.head_dim, cfg.rope_theta, scaling)
        return cos.unsqueeze(1), sin.unsqueeze(1)
    return rope_angles(torch.arange(offset, offset + length, device=device), cfg.head_dim, cfg.rope_theta, scaling)


class LearnedPositions(torch.nn.Module):
    """GPT-2's absolute position embedding (max_seq_len x D), replicated on every tp rank, added
    to the token embedding. Under sequence parallelism a rank adds only its own positions
    (`sp_group`, the tp group), so the table's gradient is summed over tp."""

    def __init__(self, max_seq_len: int, dim: int, *, device=None, dtype=None, sp_group=None):
        super().__init__()
        from cplm_dist.model.parallel.sequence import active

        self.weight = torch.nn.Parameter(torch.empty(max_seq_len, dim, device=device, dtype=dtype))
        self.sp_group = sp_group if active(sp_group) else None

    def forward(self, x: torch.Tensor, offset: int = 0, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, D) of positions offset.. (or those position_ids (B, T) name), or under sequence
        parallelism this rank's (T/tp, B, D)."""
        from cplm_dist.model.parallel.sequence import sum_grad_over

        if self.sp_group is None:
            if position_ids is not None:
                return x + self.weight[position_ids]
            return x + self.weight[offset : offset + x.shape[1]]
        start = self.sp_group.rank() * x.shape[0]
        weight = sum_grad_over(self.weight, self.sp_group)
        if position_ids is not None:  # this rank's (T/tp, B) positions
            return x + weight[position_ids[:, start : start + x.shape[0]].t()]
        return x + weight[offset + start : offset + start + x.shape[0], None]
