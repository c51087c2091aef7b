"""The next token of the mixture from this rank's LM logits shard and the copy distribution over
context slots, the vocabulary never gathered (decoding: cplm_dist.model.static_decode; scoring:
CPLM.score).

The mixture is log p(w) = logaddexp(lm + log softmax_V(z)_w, copy + A + log mass_w)
(cplm_dist.model.loss.mixture), mass_w the copy weight of the slots that paste w. An id no slot
pastes has mass 0, so there the mixture is the LM term alone, which is largest at argmax z. The
greedy token is therefore the best of the LM term over the shard and the mixture at the context's ids:
    per rank: LSE_V over its shard (all-reduced, as for the loss) and the LM term of every id,
              rounded as the (B, V) reference rounds it (ids whose z differ may meet in one value),
              the copy mass of each candidate slot's id (scattered onto its shard's ids and read
              back at the slots: at most K distinct ids carry mass; no log or exp over V),
              the mixture at those ids, and the best of the two with its lowest id;
    over tp:  the maximum, then the lowest id reaching it (torch.argmax's choice on the gathered row).
Sampling needs the whole distribution: `full_log_probs` builds it once per step, shard by shard
(`mixed_shard`, what scoring reads at the targets), and gathers it (cplm_dist.model.loss).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

import cplm_dist.model.loss as loss
from cplm_dist.model.loss import NEG_INF, CopyTerms, all_reduce

HALF = math.log(0.5)


class CopyOver(NamedTuple):
    """The copy head's distribution for T queries over K cache slots (CPLM.head_over)."""

    terms: CopyTerms  # (B, T) each
    weights: torch.Tensor  # (B, T, K): rows summing to 1, 0 off the candidates
    src: torch.Tensor  # (B, K): the id each slot pastes (-1: none)
    cand: torch.Tensor  # (B, T, K): the candidates (cplm_dist.model.copy_lse.candidate_mask)


def copied_mostly(copy_log_mass: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """Whether the copy component holds more than half of an id's probability, from the log of
    its mass on the id and the id's log-probability (the one rule, greedy and sampled)."""
    return copy_log_mass - log_p > HALF


def copy_mass(weights: torch.Tensor, src: torch.Tensor, cand: torch.Tensor, v_local: int, tp_group):
    """(owned (B, K): slot j is a candidate whose id is this rank's, local (B, K) its id in the
    shard, mass (B, K) the copy weight summed over the slots pasting that id, the shard's mass
    buffer (B, V/tp)) for weights (B, K) over slots whose ids are src (B, K)."""
    start, end = loss.vocab_range(v_local, tp_group)
    owned = cand & (src >= start) & (src < end)
    local = torch.where(owned, src - start, torch.zeros_like(src))
    w = torch.where(owned, weights.float(), torch.zeros_like(weights, dtype=torch.float32))
    buffer = torch.zeros(src.shape[0], v_local, dtype=torch.float32, device=src.device).scatter_add_(1, local, w)
    return owned, local, buffer.gather(1, local), buffer


def lowest(hit: torch.Tensor, start: int) -> torch.Tensor:
    """(B,) the lowest global id where hit (B, V/tp) holds, the long maximum where nowhere."""
    ids = torch.arange(start, start + hit.shape[-1], device=hit.device)
    return torch.where(hit, ids, torch.full_like(ids, torch.iinfo(torch.long).max)).amin(dim=-1)


def greedy(logits: torch.Tensor, copy: CopyOver | None, mix: str, tp_group=None, mark_copies: bool = False):
    """(the mixture's most likely id (B,), whether the copy head gave it most of its mass (B,) or
    None) for one query a row: logits (B, 1, V/tp) and the copy head's distribution over the
    slots (CPLM.head_over), the same on every tp rank."""
    z = logits[:, 0].float()
    start, _ = loss.vocab_range(z.shape[-1], tp_group)
    lse = loss.vocab_parallel_lse(z, tp_group)  # (B,)
    big = torch.iinfo(torch.long).max
    if copy is None:
        lm = z - lse.unsqueeze(-1)  # the reference's log-probs, as `full_log_probs` rounds them
        best = lm.max(dim=-1).values
        index = lowest(lm == best.unsqueeze(-1), start)
    else:
        terms = CopyTerms(*(None if t is None else t[:, 0].float() for t in copy.terms))
        w = loss.mix_weights(lse, terms, mix)
        owned, local, mass, buffer = copy_mass(copy.weights[:, 0], copy.src, copy.cand[:, 0], z.shape[-1], tp_group)
        copy_log_mass = w.copy.unsqueeze(-1) + (terms.copy_all.unsqueeze(-1) + torch.log(mass))
        # the LM term of every id, rounded as the reference's (B, V) mixture rounds it: ids whose z differ
        # may meet in one value (ties, the lowest id wins as in torch.argmax of the gathered row)
        lm = w.lm.unsqueeze(-1) + (z - lse.unsqueeze(-1))  # (B, V/tp)
        at_ids = torch.logaddexp(lm.gather(1, local), copy_log_mass)
        at_ids = torch.where(owned, at_ids, torch.full_like(at_ids, NEG_INF))  # (B, K)
        best = torch.maximum(lm.max(dim=-1).values, at_ids.max(dim=-1).values)
        from_ids = torch.where(at_ids == best.unsqueeze(-1), local + start, torch.full_like(local, big)).amin(dim=-1)
        index = torch.minimum(lowest(lm == best.unsqueeze(-1), start), from_ids)
    top = all_reduce(best.clone(), dist.ReduceOp.MAX, tp_group)
    token = all_reduce(torch.where(best == top, index, torch.full_like(index, big)), dist.ReduceOp.MIN, tp_group)
    if copy is None or not mark_copies:
        return token, None
    mine = (token >= start) & (token < start + z.shape[-1])
    chosen = torch.where(mine, buffer.gather(1, torch.where(mine, token - start, 0).unsqueeze(-1)).squeeze(-1), 0.0)
    chosen = all_reduce(chosen, dist.ReduceOp.SUM, tp_group)
    return token, copied_mostly(w.copy + (terms.copy_all + torch.log(chosen)), top)


def mixed_shard(logits: torch.Tensor, copy: CopyOver | None, mix: str, tp_group=None):
    """(this rank's shard of the mixture's log-probs (B, T, V/tp), of the copy component's log
    mass or None) from logits (B, T, V/tp) and the copy head's distribution over the slots."""
    if copy is None:
        return loss.mixed_log_probs(logits, None, None, mix, tp_group)
    copy_lp = loss.scatter_copy_log_probs(copy.weights, copy.src, logits.shape[-1], tp_group)
    return loss.mixed_log_probs(logits, copy_lp, copy.terms, mix, tp_group)


def full_log_probs(logits: torch.Tensor, copy: CopyOver | None, mix: str, vocab_size: int, tp_group=None,
                   with_copy_part: bool = False):
    """(log p (B, T, V) of the mixture, the copy component's log mass (B, T, V) or None), gathered
    over tp: the distribution sampling draws from and evaluation reads."""
    shard, copy_part = mixed_shard(logits, copy, mix, tp_group)
    gather = lambda t: loss.gather_vocab(t, tp_group)[..., :vocab_size]  # noqa: E731
    return gather(shard), (gather(copy_part) if with_copy_part and copy_part is not None else None)


@torch.no_grad()
def components(logits: torch.Tensor, copy: CopyOver | None, mix: str, targets: torch.Tensor,
               tp_group=None) -> dict[str, torch.Tensor]:
    """Where a target's probability comes from, per position (B, T), float: `lm_accuracy` (the LM
    head alone ranks the target first), `copy_pointer_accuracy` (the copy head's most probable
    candidate slot pastes the target: the pointer, whatever the mix makes of it) and `copy_share`
    (the mix's weight on the copy side, 1 - exp(w.lm)); without a copy head, 0 and 0. Targets
    below 0 (IGNORE_INDEX): all 0."""
    valid = targets >= 0
    lm_top = loss.target_log_probs(logits.float(), targets, tp_group)[1] & valid
    if copy is None:
        zero = torch.zeros_like(lm_top, dtype=torch.float32)
        return {"lm_accuracy": lm_top.float(), "copy_pointer_accuracy": zero, "copy_share": zero}
    best = copy.weights.argmax(dim=-1)  # (B, T): the first most probable slot
    pasted = copy.src.gather(1, best)  # (B, T)
    cand = copy.cand if copy.cand.dim() == 3 else copy.cand.unsqueeze(0)
    pointer = (pasted == targets) & cand.any(dim=-1) & valid
    lse = loss.vocab_parallel_lse(logits.float(), tp_group)
    t = copy.terms
    w = loss.mix_weights(lse, CopyTerms(t.copy_all.float(), None, None if t.gate is None else t.gate.float()), mix)
    share = torch.where(valid, -torch.expm1(w.lm), torch.zeros_like(lse))
    return {"lm_accuracy": lm_top.float(), "copy_pointer_accuracy": pointer.float(), "copy_share": share}
