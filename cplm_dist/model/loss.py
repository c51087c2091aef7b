"""All vocabulary-sharded math: the LM head's logits live as [N, V/tp] shards and never get gathered.

The pieces, in the order a loss uses them (docs/copy_head.md):

0. `padded_vocab_size`, `vocab_range`: Megatron's padded vocabulary and the ids a rank's shard holds.
1. `target_logit_and_lse`  z_{t,y} and LSE_V(z_t) per row from the shards: Megatron's vocab-parallel
   cross-entropy steps (all-reduce MAX of the local max, the target logit from its owner by
   all-reduce SUM, all-reduce SUM of the local sum-exp) in an autograd Function that keeps one
   [N, V/tp] buffer, the softmax, for backward (loss.impl=dense).
   `chunked_target_logit_and_lse` (loss.impl=chunked) computes the same two numbers from the
   hidden states and the LM-head shard, block of rows by block of rows, recomputing each block's
   logits in backward: no [N, V/tp] tensor is kept.
2. `mix_weights`           each mix's two log-weights (its record in cplm_dist.model.mixes), and `mixture`:
       log p(w) = logaddexp(lm + log softmax_V(z)_w,  copy + log copy_mass_w)
   where copy_mass_w = sum_{j in C_t, src_j = w} exp(s_tj) (M_t at w = y_t). The per-row loss and
   the full distribution are both this one line; the copy side's share of the mass is 1 - exp(lm).
3. `mixed_nll`             THE loss (`mixed_nll_from_lm` after the chunked path), copy on or off (copy off: LSE_V - z_y, the same Function on
   the same group), with the LM head's own loss and the copy share as detached statistics. Chained
   with (1) the logits gradient is the closed form of docs/copy_head.md: the Function receives
   dL/dLSE = r_t and dL/dz_y = -r_t (gate, sentinel) or the joint pair, and returns
   r_t softmax - r_t onehot; the copy side (A_t, M_t, gate) gets its gradient by autograd.
4. `mixed_log_probs`       the full next-token distribution, this rank's vocabulary shard, with the
   copy mass scattered into the ids the rank owns (`scatter_copy_log_probs`); `gather_vocab`
   assembles [.., V] for evaluation and generation.

`tp_group=None` means one process holding the whole vocabulary. Every function here has a dense
float64 reference in tests/reference.py that the tests compare against at tp = 1, 2 and 4.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cplm_dist.data.loader import IGNORE_INDEX  # the label a batch holds where no loss is taken
from cplm_dist.model.mixes import MIXES, NEG_INF, MixWeights


class CopyTerms(NamedTuple):
    """What the mixture needs from the copy head, per token, each (..., ) float32. A NamedTuple,
    not a dataclass, so that ZeRO-3's module hooks find its tensors: with a dataclass the copy head
    got no pre-backward hook, its own parameter (the sentinel key) was already released when
    backward needed it, and ZeRO-3 with the sentinel mix failed."""

    copy_all: torch.Tensor  # A_t, -inf where no candidate
    copy_match: torch.Tensor | None  # M_t, -inf where no candidate pastes the label (None without labels)
    gate: torch.Tensor | None  # gate logit (gate), sentinel score (sentinel), None (joint)


class TokenLoss(NamedTuple):
    """Per-token results of `mixed_nll`; a NamedTuple so that ZeRO-3's hooks see its tensors."""

    nll: torch.Tensor  # float32 loss of the mixture, 0 where labels = -100
    lm_nll: torch.Tensor  # the LM head alone, LSE_V - z_y (detached statistic)
    copy_share: torch.Tensor  # the copy side's share of the next-token mass (detached; 0 copy off)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: the smallest multiple of divisible_by * tp not below vocab_size."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def vocab_padding_note(vocab_size: int, divisible_by: int, tp: int) -> str | None:
    """One line describing the vocabulary padding at this tp, or None when there is none."""
    padded = padded_vocab_size(vocab_size, divisible_by, tp)
    if padded == vocab_size:
        return None
    return (f"model.vocab_size={vocab_size} padded to {padded} (+{padded - vocab_size} ids, a multiple of "
            f"{divisible_by}*tp={divisible_by * tp}); padded ids are masked out of every softmax")


def tp_rank_size(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def vocab_range(v_local: int, tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """[start, end) of the global vocabulary ids this rank's shard holds (Megatron's layout)."""
    rank, _ = tp_rank_size(tp_group)
    return rank * v_local, (rank + 1) * v_local


def all_reduce(t: torch.Tensor, op: dist.ReduceOp, tp_group) -> torch.Tensor:
    """`t` reduced in place over the tp group (nothing to do without one, or at tp = 1), returned."""
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(t, op=op, group=tp_group)
    return t


# ---------------------------------------------------------------------------------------------
# 1. target logit and log-sum-exp over the sharded vocabulary
# ---------------------------------------------------------------------------------------------


class _TargetLogitAndLSE(torch.autograd.Function):
    """Forward: (z_y, LSE_V(z)) per row from vocab shards, three all-reduces over tp.
    Backward: dz_w = dLSE * softmax_w + dz_y * [w = y] on the local shard, no communication."""

    @staticmethod
    def forward(ctx, logits, labels, tp_group, inplace):
        # megatron-core on first use only: the arithmetic that imports this module (padding, the
        # parameter counts, the memory estimator) runs without it
        from cplm_dist.megatron_compat import VocabParallelCrossEntropy

        # Half-precision logits are computed in fp32 (a new buffer); fp32/fp64 ones are worked on in
        # place when the caller allows it, else on a copy.
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        elif not inplace:
            logits = logits.clone()
        # Step 1: max over the vocabulary (for a stable exp), all ranks.
        logits_max = logits.amax(dim=-1)
        all_reduce(logits_max, dist.ReduceOp.MAX, tp_group)
        # Step 2: the target logit from the rank that owns it (0 elsewhere), and the local sum-exp.
        start, end = vocab_range(logits.size(-1), tp_group)
        target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(logits, labels, logits_max, start, end)
        )
        all_reduce(predicted_logits, dist.ReduceOp.SUM, tp_group)
        # Step 3: the global sum-exp.
        all_reduce(sum_exp_logits, dist.ReduceOp.SUM, tp_group)
        softmax = exp_logits.div_(sum_exp_logits.unsqueeze(-1))  # the one [N, V/tp] buffer kept
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        ctx.inplace = inplace
        return predicted_logits + logits_max, logits_max + torch.log(sum_exp_logits)

    @staticmethod
    def backward(ctx, grad_z_y, grad_lse):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        # In place, the saved softmax becomes the gradient (as in Megatron: no second buffer, and
        # no second backward through the same graph); otherwise a new buffer.
        grad = softmax.mul_(grad_lse.unsqueeze(-1)) if ctx.inplace else softmax * grad_lse.unsqueeze(-1)
        grad_2d = grad.view(-1, grad.size(-1))
        rows = torch.arange(grad_2d.size(0), device=grad.device)
        owned = (~target_mask).view(-1).to(grad.dtype)
        grad_2d[rows, masked_target_1d] += grad_z_y.reshape(-1) * owned
        return grad, None, None, None


def target_logit_and_lse(
    logits: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup | None = None, *, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """z_{t,y} and LSE_V(z_t) [...] from logits [..., V/tp] and global label ids [...].

    float32 for half-precision logits, else the logits' dtype. Rows whose label no rank owns
    (-100) get z_y = 0. inplace=True is the training mode: an fp32 `logits` is overwritten (the
    caller must not reuse it) and backward reuses the saved buffer, so one [N, V/tp] buffer
    serves forward and backward, and the graph can be differentiated once only.
    """
    return _TargetLogitAndLSE.apply(logits, labels, tp_group, inplace)


def _block_logits(h: torch.Tensor, weight: torch.Tensor, real_local: int) -> torch.Tensor:
    """float32 logits [rows, V/tp] of one row block, padded vocabulary columns at -inf."""
    logits = F.linear(h, weight).float()
    if real_local < logits.size(-1):
        logits[:, real_local:] = NEG_INF
    return logits


class _ChunkedTargetLogitAndLSE(torch.autograd.Function):
    """(z_y, LSE_V) per row straight from the hidden states and the LM-head shard, `rows` rows at a
    time: no [N, V/tp] tensor lives across forward and backward (backward recomputes each block's
    logits). The same three all-reduces as `_TargetLogitAndLSE`, on [N] vectors after all blocks;
    backward all-reduces dL/dh over tp (the LM head's input is replicated)."""

    @staticmethod
    def forward(ctx, h, weight, labels, tp_group, real_local, rows, sum_grad_h):
        n, v_local = h.size(0), weight.size(0)
        start, end = vocab_range(v_local, tp_group)
        owned = (labels >= start) & (labels < end)
        local = torch.where(owned, labels - start, torch.zeros_like(labels))
        local_max = torch.empty(n, dtype=torch.float32, device=h.device)
        local_sum = torch.empty_like(local_max)
        z_y = torch.zeros_like(local_max)
        for i in range(0, n, rows):
            logits = _block_logits(h[i : i + rows], weight, real_local)
            m = logits.amax(dim=-1)
            safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a shard of padding only
            local_max[i : i + rows] = m
            z_y[i : i + rows] = torch.where(owned[i : i + rows], logits.gather(1, local[i : i + rows, None]).squeeze(1), 0.0)
            local_sum[i : i + rows] = logits.sub_(safe.unsqueeze(-1)).exp_().sum(dim=-1)  # in place: one block buffer
        global_max = local_max.clone()
        all_reduce(global_max, dist.ReduceOp.MAX, tp_group)
        scale = torch.where(torch.isfinite(local_max), torch.exp(local_max - global_max), torch.zeros_like(local_max))
        sum_exp = local_sum * scale
        all_reduce(sum_exp, dist.ReduceOp.SUM, tp_group)
        all_reduce(z_y, dist.ReduceOp.SUM, tp_group)
        lse = global_max + torch.log(sum_exp)
        ctx.save_for_backward(h, weight, owned, local, lse)
        ctx.tp_group, ctx.real_local, ctx.rows, ctx.sum_grad_h = tp_group, real_local, rows, sum_grad_h
        return z_y, lse

    @staticmethod
    def backward(ctx, grad_z_y, grad_lse):
        h, weight, owned, local, lse = ctx.saved_tensors
        grad_z_y = torch.zeros_like(lse) if grad_z_y is None else grad_z_y
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for i in range(0, h.size(0), ctx.rows):
            block = slice(i, i + ctx.rows)
            g = _block_logits(h[block], weight, ctx.real_local).sub_(lse[block, None]).exp_().mul_(grad_lse[block, None])
            g.scatter_add_(1, local[block, None], (grad_z_y[block] * owned[block]).unsqueeze(1).to(g.dtype))
            g = g.to(weight.dtype)  # the dtype the dense LM head's backward multiplies in
            grad_h[block] = g @ weight
            grad_w += (g.t() @ h[block]).float()
        if ctx.sum_grad_h:
            all_reduce(grad_h, dist.ReduceOp.SUM, tp_group=ctx.tp_group)
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def chunked_target_logit_and_lse(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup | None = None, *,
    real_local: int | None = None, rows: int = 2048, sum_grad_h: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`target_logit_and_lse` of the logits h @ weight^T without forming them whole (loss.impl=chunked).

    h [..., D] hidden states, identical on every tp rank; weight [V/tp, D] this rank's LM-head
    shard; labels [...] global ids (-100: z_y = 0); real_local: the shard's columns before the
    vocabulary padding (default: all). Returns float32 [...] each. dL/dh comes back all-reduced
    over tp, so the caller must not route h through another tp region; sum_grad_h=False leaves
    each rank's partial dL/dh for a sequence-parallel gather before h, whose backward
    reduce-scatters it (the sum and the split in one collective).
    """
    if rows < 1:
        raise ValueError(f"rows={rows} must be >= 1")
    z_y, lse = _ChunkedTargetLogitAndLSE.apply(h.reshape(-1, h.size(-1)), weight, labels.reshape(-1), tp_group,
                                               weight.size(0) if real_local is None else real_local, rows, sum_grad_h)
    return z_y.view(labels.shape), lse.view(labels.shape)


# ---------------------------------------------------------------------------------------------
# 2. the mixtures: each mix's two log-weights (cplm_dist.model.mixes), one formula
# ---------------------------------------------------------------------------------------------


def mix_weights(lse: torch.Tensor, copy: CopyTerms, mix: str) -> MixWeights:
    """The two log-weights of `mix` per row from LSE_V and the copy terms (any matching shapes)."""
    if mix not in MIXES:
        raise ValueError(f"mix={mix!r} is not one of {list(MIXES)}")
    copy_all = copy.copy_all.to(lse.dtype)
    gate = None if copy.gate is None else copy.gate.to(lse.dtype)
    return MIXES[mix].log_weights(lse, copy_all, gate, torch.isfinite(copy_all))


def mixture(w: MixWeights, lm_log_softmax: torch.Tensor, copy_log_mass: torch.Tensor) -> torch.Tensor:
    """log p = logaddexp(lm + log softmax_V(z), copy + log copy_mass): the one formula of every mix."""
    return torch.logaddexp(w.lm + lm_log_softmax, w.copy + copy_log_mass)


# ---------------------------------------------------------------------------------------------
# 3. the loss
# ---------------------------------------------------------------------------------------------


def mixed_nll(
    lm_logits: torch.Tensor,
    labels: torch.Tensor,
    copy: CopyTerms | None = None,
    mix: str = "gate",
    tp_group: dist.ProcessGroup | None = None,
    *,
    inplace: bool = False,
) -> TokenLoss:
    """Per-token negative log-likelihood of the copy/LM mixture (copy=None: the LM head alone).

    float32 (float64 for float64 logits, as gradcheck uses). Training passes inplace=True (see
    `target_logit_and_lse`). Rows with labels = -100 give 0 and pass no gradient.

    lm_logits [..., V/tp] this rank's vocabulary shard (fp32 or bf16)
    labels    [...] global vocabulary ids; -100 = ignore
    copy      CopyTerms [...] each: A_t (-inf: no candidate), M_t (-inf: no candidate pastes the
              label), gate logit (gate) or sentinel score (sentinel), None (joint)
    """
    z_y, lse = target_logit_and_lse(lm_logits, labels, tp_group, inplace=inplace)
    return mixed_nll_from_lm(z_y, lse, labels, copy, mix)


def mixed_nll_from_lm(z_y: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, copy: CopyTerms | None = None,
                      mix: str = "gate") -> TokenLoss:
    """`mixed_nll` from the LM side's two per-row numbers, however they were computed (from a
    logits shard, or block by block by `chunked_target_logit_and_lse`)."""
    lm_log_p = z_y - lse  # log softmax_V(z)_y
    if copy is None:
        log_p, share = lm_log_p, torch.zeros_like(lm_log_p)
    else:
        w = mix_weights(lse, copy, mix)
        log_p = mixture(w, lm_log_p, copy.copy_match.to(lse.dtype))
        share = -torch.expm1(w.lm.detach())
    keep = labels != IGNORE_INDEX
    zero = torch.zeros_like(log_p)
    return TokenLoss(torch.where(keep, -log_p, zero), torch.where(keep, -lm_log_p.detach(), zero),
                     torch.where(keep, share, zero))


# ---------------------------------------------------------------------------------------------
# 4. the full next-token distribution, shard by shard (evaluation and generation; no gradient)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def vocab_parallel_lse(logits: torch.Tensor, tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """LSE_V over the sharded last dimension, float32 [...]."""
    logits = logits.float()
    m = logits.amax(dim=-1)
    all_reduce(m, dist.ReduceOp.MAX, tp_group)
    sum_exp = torch.exp(logits - m.unsqueeze(-1)).sum(dim=-1)
    all_reduce(sum_exp, dist.ReduceOp.SUM, tp_group)
    return m + torch.log(sum_exp)


@torch.no_grad()
def scatter_copy_log_probs(
    weights: torch.Tensor, src_ids: torch.Tensor, v_local: int, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """log p_copy(w) on this rank's vocabulary shard: log sum_{j: src_j = w} weights_tj.

    weights [B, T, J] copy distribution over context positions (rows sum to 1, or 0 when empty)
    src_ids [B, J]    the global id position j pastes (< 0: never pasted)
    returns [B, T, v_local] float32, -inf where no candidate pastes w
    """
    start, end = vocab_range(v_local, tp_group)
    owned = (src_ids >= start) & (src_ids < end)  # (B, J)
    local = torch.where(owned, src_ids - start, torch.zeros_like(src_ids))
    w = weights.float() * owned.unsqueeze(1)  # (B, T, J), mass the rank does not own dropped
    mass = torch.zeros(*weights.shape[:2], v_local, dtype=torch.float32, device=weights.device)
    mass.scatter_add_(2, local.unsqueeze(1).expand_as(w), w)  # (B, T, v_local)
    return torch.log(mass)


@torch.no_grad()
def mixed_log_probs(
    lm_logits: torch.Tensor,
    copy_log_probs: torch.Tensor | None = None,
    copy: CopyTerms | None = None,
    mix: str = "gate",
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p_w of the mixture, log of the copy component's mass on w) for this rank's vocabulary
    shard [..., V/tp], float32; copy=None: (log softmax_V(z), None), the model without copy head.

    copy_log_probs [..., V/tp] log p_copy(w) from `scatter_copy_log_probs`; copy.copy_all [...] A_t.
    """
    z = lm_logits.float()
    lse = vocab_parallel_lse(z, tp_group).unsqueeze(-1)
    if copy is None:
        return z - lse, None
    copy = CopyTerms(copy.copy_all.float().unsqueeze(-1), None, None if copy.gate is None else copy.gate.float().unsqueeze(-1))
    w = mix_weights(lse, copy, mix)
    copy_log_mass = copy.copy_all + copy_log_probs  # log sum_{j: src_j = w} exp(s_tj) (-inf where none)
    return mixture(w, z - lse, copy_log_mass), w.copy + copy_log_mass


@torch.no_grad()
def target_log_probs(shard: torch.Tensor, targets: torch.Tensor,
                     tp_group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), whether the target is the argmax over the whole vocabulary), each [...],
    from this rank's shard [..., V/tp] of log-probabilities, without gathering the vocabulary:
    the target's entry from the rank that owns it (summed over tp), and the argmax from each
    shard's maximum and its global index (the lowest index among equal maxima, as torch.argmax
    of the gathered row). Targets outside the vocabulary (IGNORE_INDEX): 0 and False."""
    start, end = vocab_range(shard.shape[-1], tp_group)
    owned = (targets >= start) & (targets < end)
    picked = shard.gather(-1, torch.where(owned, targets - start, torch.zeros_like(targets)).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(owned, picked.float(), torch.zeros_like(picked, dtype=torch.float32))
    all_reduce(logp, dist.ReduceOp.SUM, tp_group)
    index = shard.argmax(dim=-1)  # the first maximum of this shard
    best = shard.gather(-1, index.unsqueeze(-1)).squeeze(-1).float()
    top = best.clone()
    all_reduce(top, dist.ReduceOp.MAX, tp_group)
    first = torch.where(best == top, index + start, torch.full_like(index, torch.iinfo(index.dtype).max))
    all_reduce(first, dist.ReduceOp.MIN, tp_group)
    return logp, first == targets


@torch.no_grad()
def gather_vocab(shard: torch.Tensor, tp_group: dist.ProcessGroup | None = None, dim: int = -1) -> torch.Tensor:
    """Vocabulary shards (V/tp along `dim`: the last for logits, 0 for an LM-head weight) -> the
    whole vocabulary on every rank (the only gather of the vocabulary; evaluation only)."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return shard
    # (megatron's gather_from_tensor_model_parallel_region allocates on CUDA unconditionally)
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, shard.contiguous(), group=tp_group)
    return torch.cat(parts, dim=dim)
