"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for the transformer layers' matrices,
with AdamW beside it for everything else (optim.name=muon; docs/training.md "Muon").

For each matrix W with gradient G (the raw gradient, after DeepSpeed's clipping):

    B <- momentum x B + G                       (the momentum buffer, one per matrix)
    U <- G + momentum x B  (Nesterov)  or  B
    O <- NewtonSchulz5(U / ||U||_F)             (quintic: a, b, c = 3.4445, -4.7750, 2.0315)
    W <- W (1 - lr x wd) - lr x rms_scale x sqrt(max(rows, cols)) x O

The same optimizer at every layout: O is always the orthogonalisation of the *whole* matrix.
At tp > 1 a column- or row-parallel shard of U is gathered over tp (megatron's strided layout:
cplm_dist.model.parallel.sharding), orthogonalised whole, and each rank keeps its shard of O.
Under ZeRO-1/2 DeepSpeed hands the optimizer a flat partition of each parameter group
(cplm_dist.training.zero_partitions): the momentum buffer stays partitioned (its update is
elementwise), U is all-gathered over the partition's group, and each rank computes O for the
matrices its partition touches and writes its own slice. `optim.muon.split_qkv` orthogonalises
the QKV weight per projection (queries, keys, values: row sets of megatron's per-group layout),
which commutes with any tp split because orthogonalisation is equivariant under row permutations.

No tensor or group carries DeepSpeed's `use_muon` mark, so DeepSpeed's own ZeRO Muon (which
orthogonalises each shard alone) never engages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cplm_dist.model.layer_shapes import QKV_WEIGHT, muon_shape, muon_shapes
from cplm_dist.model.parallel.sharding import ShardSpec, gather_full, spec_of, take_shard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(matrix: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards U V^T of `matrix` = U S V^T (Keller Jordan's
    coefficients): run on the wide orientation, normalised by the Frobenius norm first."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return x.to(matrix.dtype)


@dataclass(frozen=True)
class Matrix:
    """What the optimizer needs of one Muon parameter: its CPLM name, tp layout, and the row sets
    orthogonalised apart (None: the whole matrix)."""

    name: str
    spec: ShardSpec
    row_sets: tuple[torch.Tensor, ...] | None = None


def qkv_row_sets(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """(queries, keys, values) rows of the full QKV weight laid out per kv group, megatron's way:
    each group's `num_heads / num_kv_heads` query heads, then its key head, then its value head."""
    group = num_heads // num_kv_heads
    per_group = (group + 2) * head_dim
    starts = torch.arange(num_kv_heads) * per_group

    def rows(first: int, heads: int) -> torch.Tensor:
        local = torch.arange(first * head_dim, (first + heads) * head_dim)
        return (starts[:, None] + local[None, :]).reshape(-1)

    return rows(0, group), rows(group, 1), rows(group + 1, 1)


def mark_matrices(named, cfg) -> list[torch.nn.Parameter]:
    """Tag each Muon parameter (cplm_dist.model.layer_shapes.muon_shapes) with its `Matrix` (read by
    the step and the ZeRO adapter) and return them."""
    model_cfg, muon = cfg.model, cfg.optim.muon
    qkv_sets = qkv_row_sets(model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim)
    shapes = muon_shapes(model_cfg, cfg.copy if muon.copy_head else None)
    marked = []
    for name, param in named:
        shape = muon_shape(name, shapes)
        if not param.requires_grad or shape is None:
            continue
        split = muon.split_qkv and shape.name == QKV_WEIGHT
        param._cplm_matrix = Matrix(name, spec_of(param), qkv_sets if split else None)
        marked.append(param)
    return marked


class Orthogonaliser:
    """The Muon half of the optimizer (cplm_dist.training.optim.GuardedMuon): steps the parameter
    groups marked `orthogonal`, keeping each parameter's momentum buffer in `state`."""

    def __init__(self, tp_group: dist.ProcessGroup | None = None, *, ns_steps: int = 5,
                 ns_dtype: torch.dtype = torch.float32, rms_scale: float = 0.2):
        self.tp_group = tp_group
        self.ns_steps, self.ns_dtype, self.rms_scale = ns_steps, ns_dtype, rms_scale

    @staticmethod
    def direction(state: dict, param: torch.Tensor, group: dict) -> torch.Tensor:
        """The momentum step and the (Nesterov) direction U, of the parameter's shape (or flat partition)."""
        if "momentum_buffer" not in state:  # a step count too: AdamW's state loading expects one in every state
            state["momentum_buffer"] = torch.zeros_like(param)
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        buf, grad, beta = state["momentum_buffer"], param.grad.to(param.dtype), group["momentum"]
        buf.mul_(beta).add_(grad)
        return grad.add(buf, alpha=beta) if group["nesterov"] else buf.clone()

    def update(self, matrix: Matrix, direction: torch.Tensor) -> torch.Tensor:
        """This tp rank's shard of scale x NewtonSchulz(whole U), from its shard `direction`."""
        full = gather_full(direction, matrix.spec, self.tp_group)
        if matrix.row_sets is None:
            out = self._scaled(full)
        else:
            out = torch.empty_like(full)
            for rows in matrix.row_sets:
                rows = rows.to(full.device)
                out[rows] = self._scaled(full[rows])
        if matrix.spec.is_split and self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            out = take_shard(out, matrix.spec, dist.get_rank(self.tp_group), dist.get_world_size(self.tp_group))
        return out

    def _scaled(self, full: torch.Tensor) -> torch.Tensor:
        scale = self.rms_scale * math.sqrt(max(full.shape)) if self.rms_scale > 0 else 1.0
        return newton_schulz(full, self.ns_steps, self.ns_dtype) * scale

    @torch.no_grad()
    def step_group(self, states, group: dict) -> None:
        """W <- W (1 - lr wd) - lr x update for each parameter of `group`: a module's matrix
        (ZeRO-0) or a ZeRO flat partition (its `_cplm_partition`: cplm_dist.training.zero_partitions)."""
        lr, decay = group["lr"], group["weight_decay"]
        for param in group["params"]:
            if param.grad is None:
                continue
            direction = self.direction(states[param], param, group)
            partition = getattr(param, "_cplm_partition", None)
            if partition is None:
                update = self.update(param._cplm_matrix, direction)
                param.mul_(1 - lr * decay).add_(update.to(param.dtype), alpha=-lr)
                continue
            param.mul_(1 - lr * decay)
            for piece, update in partition.updates(direction, self.update):
                param[piece].add_(update.to(param.dtype), alpha=-lr)
