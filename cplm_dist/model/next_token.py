"""The next token of the mixture from this rank's LM logits shard and the copy distribution over
context slots, the vocabulary never gathered (decoding: cplm_dist.model.static_decode).

The mixture is log p(w) = logaddexp(lm + log softmax_V(z)_w, copy + A + log mass_w)
(cplm_dist.model.loss.mixture), mass_w the copy weight of the slots that paste w. An id no slot
pastes has mass 0, so there the mixture is the LM term alone, which is largest at argmax z. The
greedy token is therefore the best of (argmax z, its LM term) and the mixture at the context's ids:
    per rank: LSE_V and max z over its shard (LSE all-reduced, as for the loss),
              the copy mass of each candidate slot's id (scattered onto its shard's ids and read
              back at the slots: at most K distinct ids carry mass; no log or exp over V),
              the mixture at those ids, and the best of the two with its id;
    over tp:  the maximum, then the lowest id reaching it (torch.argmax's choice on the gathered row).
Sampling needs the whole distribution: `full_log_probs` builds it once per step, shard by shard,
and gathers it (cplm_dist.model.loss, the evaluation path).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import cplm_dist.model.loss as vocab_parallel
from cplm_dist.model.loss import NEG_INF, CopyTerms

HALF = math.log(0.5)


def _reduce(t: torch.Tensor, op, tp_group) -> torch.Tensor:
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(t, op=op, group=tp_group)
    return t


def copy_mass(weights: torch.Tensor, src: torch.Tensor, cand: torch.Tensor, v_local: int, tp_group):
    """(owned (B, K): slot j is a candidate whose id is this rank's, local (B, K) its id in the
    shard, mass (B, K) the copy weight summed over the slots pasting that id, the shard's mass
    buffer (B, V/tp)) for weights (B, K) over slots whose ids are src (B, K)."""
    start, end = vocab_parallel.vocab_range(v_local, tp_group)
    owned = cand & (src >= start) & (src < end)
    local = torch.where(owned, src - start, torch.zeros_like(src))
    w = torch.where(owned, weights.float(), torch.zeros_like(weights, dtype=torch.float32))
    buffer = torch.zeros(src.shape[0], v_local, dtype=torch.float32, device=src.device).scatter_add_(1, local, w)
    return owned, local, buffer.gather(1, local), buffer


def lowest(hit: torch.Tensor, start: int) -> torch.Tensor:
    """(B,) the lowest global id where hit (B, V/tp) holds, the long maximum where nowhere."""
    ids = torch.arange(start, start + hit.shape[-1], device=hit.device)
    return torch.where(hit, ids, torch.full_like(ids, torch.iinfo(torch.long).max)).amin(dim=-1)


def greedy(logits: torch.Tensor, copy: CopyTerms | None, weights: torch.Tensor | None, src: torch.Tensor | None,
           cand: torch.Tensor | None, mix: str, tp_group=None, mark_copies: bool = False):
    """(the mixture's most likely id (B,), whether the copy head gave it most of its mass (B,) or
    None) from logits (B, V/tp) and, with a copy head, its terms (B,), weights (B, K) over slots
    whose ids are src (B, K), candidates cand (B, K)."""
    z = logits.float()
    start, _ = vocab_parallel.vocab_range(z.shape[-1], tp_group)
    lse = vocab_parallel.vocab_parallel_lse(z, tp_group)  # (B,)
    big = torch.iinfo(torch.long).max
    if copy is None:
        lm = z - lse.unsqueeze(-1)  # the reference's log-probs, as `full_log_probs` rounds them
        best = lm.max(dim=-1).values
        index = lowest(lm == best.unsqueeze(-1), start)
    else:
        w = vocab_parallel.mix_weights(lse, CopyTerms(copy.copy_all.float(), None,
                                                      None if copy.gate is None else copy.gate.float()), mix)
        owned, local, mass, buffer = copy_mass(weights, src, cand, z.shape[-1], tp_group)
        copy_log_mass = w.copy.unsqueeze(-1) + (copy.copy_all.float().unsqueeze(-1) + torch.log(mass))
        # the LM term of every id, rounded as the reference's (B, V) mixture rounds it: ids whose z differ
        # may meet in one value (ties, the lowest id wins as in torch.argmax of the gathered row)
        lm = w.lm.unsqueeze(-1) + (z - lse.unsqueeze(-1))  # (B, V/tp)
        at_ids = torch.logaddexp(lm.gather(1, local), copy_log_mass)
        at_ids = torch.where(owned, at_ids, torch.full_like(at_ids, NEG_INF))  # (B, K)
        best = torch.maximum(lm.max(dim=-1).values, at_ids.max(dim=-1).values)
        from_ids = torch.where(at_ids == best.unsqueeze(-1), local + start, torch.full_like(local, big)).amin(dim=-1)
        index = torch.minimum(lowest(lm == best.unsqueeze(-1), start), from_ids)
    top = _reduce(best.clone(), dist.ReduceOp.MAX, tp_group)
    token = _reduce(torch.where(best == top, index, torch.full_like(index, big)),
                    dist.ReduceOp.MIN, tp_group)
    if copy is None or not mark_copies:
        return token, None
    mine = (token >= start) & (token < start + z.shape[-1])
    chosen = torch.where(mine, buffer.gather(1, torch.where(mine, token - start, 0).unsqueeze(-1)).squeeze(-1), 0.0)
    chosen = _reduce(chosen, dist.ReduceOp.SUM, tp_group)
    return token, (w.copy + (copy.copy_all.float() + torch.log(chosen))) - top > HALF


def full_log_probs(logits: torch.Tensor, copy: CopyTerms | None, weights: torch.Tensor | None, src: torch.Tensor | None,
                   mix: str, vocab_size: int, tp_group=None, with_copy_part: bool = False):
    """(log p (B, V) of the mixture, the copy component's log mass (B, V) or None), gathered over
    tp: the distribution sampling draws from, from the arguments `greedy` takes (weights zero
    off the candidates)."""
    shard_lp = None
    if copy is not None:
        shard_lp = vocab_parallel.scatter_copy_log_probs(weights.unsqueeze(1), src, logits.shape[-1], tp_group)[:, 0]
    shard, copy_part = vocab_parallel.mixed_log_probs(logits, shard_lp, copy, mix, tp_group)
    gather = lambda t: vocab_parallel.gather_vocab(t, tp_group)[..., :vocab_size]  # noqa: E731
    return gather(shard), (gather(copy_part) if with_copy_part and copy_part is not None else None)
