"""How a full weight maps onto tensor-parallel shards, and back.

A parameter is either replicated on every tp rank or split along `partition_dim` in Megatron's
strided way: the full tensor is cut into tp * stride equal chunks along that dimension and rank r
holds chunks r, r + tp, ... concatenated (stride 2 keeps SwiGLU's [gate; up] halves together).
megatron-core marks split parameters with `tensor_model_parallel`, `partition_dim` and
`partition_stride`; DeepSpeed and megatron read those marks (gradient-norm de-duplication), so
every split parameter here carries them.

Used by the seeded initialisation (draw the full tensor, keep the shard: one seed gives one model
at every tp) and by tests and checkpoint conversion (gather the shards into the full tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cplm_dist.megatron_compat import tensor_parallel
from cplm_dist.model.moe_naming import expert_of, global_expert_name, with_expert


@dataclass(frozen=True)
class ShardSpec:
    """Layout of one parameter: split along `dim` with `stride`, or replicated (dim None).

    `full_rows` is the length of the real (unpadded) tensor along dim 0 for vocabulary-sized
    parameters: rows beyond it are Megatron's vocabulary padding.
    """

    dim: int | None = None
    stride: int = 1
    full_rows: int | None = None

    @property
    def is_split(self) -> bool:
        return self.dim is not None


REPLICATED = ShardSpec()


def mark_split(param: torch.nn.Parameter, dim: int, stride: int = 1) -> None:
    """Set megatron's tensor-parallel marks (megatron sets them only when it initialises itself)."""
    if not getattr(param, "tensor_model_parallel", False):
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(param, attr):
                delattr(param, attr)
        tensor_parallel.set_tensor_model_parallel_attributes(param, True, dim, stride)


def spec_of(param: torch.Tensor) -> ShardSpec:
    if getattr(param, "tensor_model_parallel", False):
        return ShardSpec(param.partition_dim, param.partition_stride, getattr(param, "full_rows", None))
    return REPLICATED


def full_shape(local_shape: torch.Size, spec: ShardSpec, tp_size: int) -> tuple[int, ...]:
    shape = list(local_shape)
    if spec.is_split:
        shape[spec.dim] *= tp_size
    return tuple(shape)


def take_shard(full: torch.Tensor, spec: ShardSpec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The part of `full` that rank `tp_rank` of `tp_size` holds."""
    if not spec.is_split or tp_size == 1:
        return full
    chunks = torch.chunk(full, tp_size * spec.stride, dim=spec.dim)
    return torch.cat(chunks[tp_rank::tp_size], dim=spec.dim)


def join_shards(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Inverse of `take_shard` over all ranks' shards (in rank order)."""
    if not spec.is_split or len(shards) == 1:
        return shards[0]
    tp_size, stride = len(shards), spec.stride
    pieces = [torch.chunk(s, stride, dim=spec.dim) for s in shards]  # pieces[rank][k] = chunk k*tp + rank
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(tp_size)], dim=spec.dim)


def gather_full(tensor: torch.Tensor, spec: ShardSpec, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full tensor on every rank from each rank's shard (a parameter or its gradient)."""
    if not spec.is_split or tp_group is None or dist.get_world_size(tp_group) == 1:
        return tensor.detach().clone()
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, tensor.detach().contiguous(), group=tp_group)
    return join_shards(shards, spec)


# --- whole state dicts: tp-independent "full" weights <-> one rank's shards -------------------------


def full_state_dict(shards: list[dict], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tp-independent weights from every tp rank's state dict (rank order) of a model laid out
    like `model` (any tp: only the layout marks are read): split tensors joined, vocabulary
    padding cut off. Entries `model` lacks, or that are None, are left out."""
    params = dict(model.named_parameters())
    full = {}
    for name, first in shards[0].items():
        if first is None or name not in params:
            continue
        spec = spec_of(params[name])
        joined = join_shards([s[name] for s in shards], spec)
        full[name] = joined[: spec.full_rows] if spec.full_rows else joined
    return full


def load_full_state_dict(model: torch.nn.Module, full: dict[str, torch.Tensor], tp_rank: int, tp_size: int, *,
                         require_all: bool = True) -> None:
    """Load tp-independent weights into this rank's `model` at any tp: vocabulary rows padded with
    zeros to the model's padded size, then this rank's shard taken. Every parameter must be
    given (require_all=False: those not given keep their values), with the full shape the model
    expects; a ValueError names the first that is not, or a name the model lacks.

    Experts are keyed by global id (cplm_dist.model.moe_naming): this ep rank takes its own and
    passes over the other ranks' experts of the layers it holds."""
    params = {global_expert_name(n, p): p for n, p in model.named_parameters()}
    missing = sorted(set(params) - set(full))
    own = {expert_of(n) for n in params} - {None}  # this rank's experts' global ids
    unknown = sorted(n for n in set(full) - set(params) if not _another_ranks_expert(n, params, own))
    if unknown:
        raise ValueError(f"the model has no {unknown[:3]}")
    if missing and require_all:
        raise ValueError(f"no weights for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    with torch.no_grad():
        for name, param in ((n, p) for n, p in params.items() if n in full):
            spec, tensor = spec_of(param), full[name]
            want = full_shape(param.shape, spec, tp_size)
            if spec.full_rows and tensor.shape[0] == spec.full_rows < want[0]:
                tensor = torch.cat([tensor, tensor.new_zeros(want[0] - spec.full_rows, *tensor.shape[1:])])
            if tuple(tensor.shape) != want:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, the model needs {want}")
            param.copy_(take_shard(tensor, spec, tp_rank, tp_size))


def _another_ranks_expert(name: str, params: dict, own: set[int]) -> bool:
    """An expert's key whose layer and tensor this model holds for its own experts `own` (another
    ep rank's share of the same layer)."""
    return expert_of(name) is not None and bool(own) and with_expert(name, next(iter(own))) in params
