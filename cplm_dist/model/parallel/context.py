"""Context parallelism (parallel.cp): the sequence itself shared out over the cp ranks.

A sequence of T positions is cut into 2 x cp chunks of c = T / (2 cp); cp rank r holds chunks r
and 2cp-1-r, so that every rank holds as much of the causal triangle (Megatron's, Llama 3's and
torchtitan's load balance). A rank's T/cp tokens are its two chunks side by side: local row i is
position r c + i for i < c, else (2cp-1-r) c + (i - c). The loader hands each rank its two chunks
of the same samples (`ContextShard.take`); everything per token (embedding, norms, MLP, LM head,
the loss) runs on them alone.

What needs the whole prefix gathers it over cp, Llama 3's way (exact, simple, composes with
document masking, small with grouped-query attention):
  - attention: each layer all-gathers its K and V (B x n_kv x T x d each); each local chunk's
    queries attend the keys before and at their positions (`ContextParallelAttention`, the core
    attention a cp model is built with: a causal mask with the chunk's offset, or the block-causal
    one of document masking); backward reduce-scatters the keys' and values' gradients to their owners;
  - the copy head: its keys (B x H_c x T x d_c) all-gathered the same way, the source ids (the
    token each candidate pastes) from the gathered input ids, and A_t, M_t of each local chunk's
    rows over the whole prefix by the same dense / chunked / flex paths (their `offset`);
  - positions are global (`ContextShard.positions`), RoPE and learned ones alike; document
    indices come from the gathered position_ids (a running count needs the whole row).
Gathering the keys, rather than combining per-rank partial log-sum-exps, keeps one code path for
every mix and paste mode (M_t's match mask needs the candidates' source ids next to their keys
anyway) and costs the keys once a step: B x T x H_c x d_c floats, less than one layer's K.

Gradients: each rank's parameters see its own tokens only, so their gradients are partial sums
that DeepSpeed reduces over dp x cp (summed over cp, averaged over dp: cplm_dist.training.engine); a
step's token count is summed over dp x cp (cplm_dist.training.step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from cplm_dist.model.copy_lse import candidate_block_mask
from cplm_dist.model.documents import (block_causal_mask, check_positions, document_index, flex_attend,
                                       flex_document_mask)
from cplm_dist.model.parallel.sequence import gather_sequence


@dataclass(frozen=True)
class ContextShard:
    """This rank's place in its cp group: `rank` of `size`, over `group` (None: one process
    playing rank `rank`, for the loader's arithmetic and tests)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> "ContextShard | None":
        if group is None or dist.get_world_size(group) == 1:
            return None
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def chunk(self, length: int) -> int:
        """c = T / (2 cp) for a whole sequence of T positions."""
        if length % (2 * self.size):
            raise ValueError(f"sequence length {length} is not divisible by 2 x cp = {2 * self.size}")
        return length // (2 * self.size)

    def chunks(self) -> tuple[int, int]:
        """The indices of this rank's two chunks."""
        return self.rank, 2 * self.size - 1 - self.rank

    def index(self, length: int, device=None) -> torch.Tensor:
        """(T/cp,) the global positions of this rank's tokens, for a sequence of `length`."""
        c = self.chunk(length)
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in self.chunks()])

    def take(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of a whole-sequence tensor (along `dim`)."""
        c = self.chunk(x.shape[dim])
        return torch.cat([x.narrow(dim, i * c, c) for i in self.chunks()], dim=dim)

    def runs(self, start: int, stop: int, local_length: int) -> list[tuple[int, int, int]]:
        """Local rows start..stop-1 of a rank holding `local_length` = T/cp rows, as runs of
        consecutive positions: [(row0, row1, position of row0)] (at most two: the chunk border)."""
        c = local_length // 2
        first, second = self.chunks()
        out = []
        for lo, hi, base in ((0, c, first * c), (c, 2 * c, second * c - c)):
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                out.append((a, b, base + a))
        return out

    def global_order(self, local_length: int, device=None) -> torch.Tensor:
        """(T,) for the all-gathered rows in rank order (rank q's two chunks, then q + 1's):
        where each global position's row sits, so that index_select puts them in sequence order."""
        c, cp = local_length // 2, self.size
        blocks = [2 * g if g < cp else 2 * (2 * cp - 1 - g) + 1 for g in range(2 * cp)]
        return torch.cat([torch.arange(b * c, (b + 1) * c, device=device) for b in blocks])

    def gather(self, x: torch.Tensor, dim: int, sum_grad: bool = True) -> torch.Tensor:
        """This rank's T/cp rows of x along `dim` -> all T in sequence order. Backward: the
        gradient reduce-scattered (sum_grad: each rank's is a partial sum, as for keys its queries
        scored) or this rank's rows kept."""
        rows = x.movedim(dim, 0)
        full = gather_sequence(rows, self.group, sum_grad)  # (cp x T/cp, ...) in rank order
        full = full.index_select(0, self.global_order(rows.shape[0], x.device))
        return full.movedim(0, dim)

    @torch.no_grad()
    def gather_ids(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T/cp) integers (ids, positions) -> (B, T) in sequence order; no gradient."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        full = torch.cat([p.t() for p in parts], dim=0)  # (T, B) rank order
        return full.index_select(0, self.global_order(x.shape[1], x.device)).t().contiguous()


def context_of(dims) -> ContextShard | None:
    """This rank's ContextShard from its ParallelDims (None at cp = 1)."""
    return ContextShard(dims.cp_rank, dims.cp_size, dims.cp_group) if dims.cp_size > 1 else None


def chunk_mask(docs: torch.Tensor | None, offset: int, rows: int, device: torch.device, flex: bool):
    """The mask of `rows` queries at positions offset.. against keys 0..offset + rows - 1:
    causal with the offset (document masking: block-causal over `docs` (B, >= offset + rows)),
    FlexAttention's BlockMask with `flex`, SDPA's boolean otherwise."""
    keys = offset + rows
    if docs is not None:
        docs = docs[:, :keys]
        return flex_document_mask(docs, offset, rows) if flex else block_causal_mask(docs, offset, rows)
    if flex:
        return candidate_block_mask(rows, keys, offset, device)[0]
    return torch.ones(rows, keys, dtype=torch.bool, device=device).tril(diagonal=offset)


class ChunkMasks:
    """The masks of one context-parallel forward, built once and handed to every layer: each run
    of this rank's queries (its two chunks: (first row, end row, position of the first)) against
    the prefix up to it."""

    def __init__(self, runs: list[tuple[int, int, int]], masks: list):
        self.runs, self.masks = runs, masks
        self._float: dict = {}

    def additive(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        """Run i's boolean mask as the additive one SDPA converts it to, made once a forward and
        dtype and shared by every layer (each layer's SDPA would otherwise keep a converted copy
        for its backward: c x (offset + c) floats a layer)."""
        key = (i, dtype)
        if key not in self._float:
            mask = self.masks[i]
            self._float[key] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return self._float[key]


class ContextParallelAttention:
    """The core attention under context parallelism (cplm_dist.model.core_attention), the same in
    every layer: keys and values all-gathered over cp, then each run of this rank's queries (its
    two chunks) attends the prefix up to it, through FlexAttention (`flex`: CUDA) or SDPA."""

    def __init__(self, shard: ContextShard, flex: bool):
        self.shard, self.flex = shard, flex

    def masks(self, docs: torch.Tensor | None, offset: int, rows: int, device: torch.device) -> ChunkMasks:
        """`rows` = this rank's T/cp positions (offset 0: no KV cache under cp); docs (B, T) the
        document index of the whole sequence under document masking, else None."""
        runs = self.shard.runs(0, rows, rows)
        return ChunkMasks(runs, [chunk_mask(docs, pos, b - a, device, self.flex) for a, b, pos in runs])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: ChunkMasks) -> torch.Tensor:
        """q (B, nh, T/cp, d) of this rank's positions, k and v (B, nkv, T/cp, d) -> (B, nh, T/cp, d)."""
        import torch.nn.functional as F

        gqa = q.shape[1] != k.shape[1]
        k, v = self.shard.gather(k, dim=2), self.shard.gather(v, dim=2)
        outs = []
        for i, (a, b, pos) in enumerate(masks.runs):
            keys = pos + b - a
            qi, ki, vi = q[:, :, a:b], k[:, :, :keys], v[:, :, :keys]
            if self.flex:
                outs.append(flex_attend(qi, ki, vi, masks.masks[i], enable_gqa=gqa))
            else:
                outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=masks.additive(i, q.dtype), enable_gqa=gqa))
        return torch.cat(outs, dim=2)


class ContextInputs(NamedTuple):
    """What a context-parallel forward knows of the whole sequence, built once (`context_inputs`)."""

    ids: torch.Tensor  # (B, T) every position's id, in sequence order (the copy head's source ids)
    positions: torch.Tensor  # (B, T/cp) this rank's tokens' positions (document masking: restarting at 0)
    docs: torch.Tensor | None  # (B, T) document index of every position under document masking, else None
    shard: ContextShard


def context_inputs(shard: ContextShard, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> ContextInputs:
    """input_ids (B, T/cp) of this rank's chunks and their position_ids under document masking
    (None: one document a row) -> ContextInputs, with the ids (and positions) gathered over cp."""
    ids = shard.gather_ids(input_ids)
    B, T = ids.shape
    docs = None
    if position_ids is None:
        positions = shard.index(T, input_ids.device).expand(B, -1)
    else:
        check_positions(position_ids, input_ids, full_row=False)
        whole = shard.gather_ids(position_ids)
        check_positions(whole, ids, full_row=True)
        docs, positions = document_index(whole), position_ids
    return ContextInputs(ids, positions, docs, shard)
