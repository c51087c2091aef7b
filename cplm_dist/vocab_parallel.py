"""All vocabulary-sharded math: the LM head's logits live as [N, V/tp] shards and never get gathered.

The pieces, in the order a loss uses them (DESIGN.md, "The copy head"):

1. `target_logit_and_lse`  z_{t,y} and LSE_V(z_t) per row from the shards: Megatron's vocab-parallel
   cross-entropy steps (all-reduce MAX of the local max, the target logit from its owner by
   all-reduce SUM, all-reduce SUM of the local sum-exp) in an autograd Function that keeps one
   [N, V/tp] buffer, the softmax, for backward.
2. `mixed_log_prob`        log p(y_t) of the copy/LM mixture from z_y, LSE_V, A_t, M_t and the gate:
   per-row scalars only, so ordinary autograd differentiates the copy side. Chained with (1) the
   logits gradient is the closed form of DESIGN.md: the Function receives dL/dLSE = r_t and
   dL/dz_y = -r_t (gate, sentinel) or the joint pair, and returns r_t softmax - r_t onehot.
3. `mixed_nll`             the public loss: (1) then (2), 0 where labels = -100.
4. `mixed_log_probs`       the full next-token distribution, this rank's vocabulary shard, with the
   copy mass scattered into the ids the rank owns (`scatter_copy_log_probs`); `gather_vocab`
   assembles [.., V] for evaluation and generation.

`tp_group=None` means one process holding the whole vocabulary. Every function here has a dense
float64 reference in tests/reference.py that the tests compare against at tp = 1, 2 and 4.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cplm_dist.megatron_compat import VocabParallelCrossEntropy

IGNORE_INDEX = -100
MIX_MODES = ("gate", "joint", "sentinel")


def tp_rank_size(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def vocab_range(v_local: int, tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """[start, end) of the global vocabulary ids this rank's shard holds (Megatron's layout)."""
    rank, _ = tp_rank_size(tp_group)
    return rank * v_local, (rank + 1) * v_local


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, tp_group) -> None:
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(t, op=op, group=tp_group)


# ---------------------------------------------------------------------------------------------
# 1. target logit and log-sum-exp over the sharded vocabulary
# ---------------------------------------------------------------------------------------------


class _TargetLogitAndLSE(torch.autograd.Function):
    """Forward: (z_y, LSE_V(z)) per row from vocab shards, three all-reduces over tp.
    Backward: dz_w = dLSE * softmax_w + dz_y * [w = y] on the local shard, no communication."""

    @staticmethod
    def forward(ctx, logits, labels, tp_group, inplace):
        # Half-precision logits are computed in fp32 (a new buffer); fp32/fp64 ones are worked on in
        # place when the caller allows it, else on a copy.
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        elif not inplace:
            logits = logits.clone()
        # Step 1: max over the vocabulary (for a stable exp), all ranks.
        logits_max = logits.amax(dim=-1)
        _all_reduce(logits_max, dist.ReduceOp.MAX, tp_group)
        # Step 2: the target logit from the rank that owns it (0 elsewhere), and the local sum-exp.
        start, end = vocab_range(logits.size(-1), tp_group)
        target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(logits, labels, logits_max, start, end)
        )
        _all_reduce(predicted_logits, dist.ReduceOp.SUM, tp_group)
        # Step 3: the global sum-exp.
        _all_reduce(sum_exp_logits, dist.ReduceOp.SUM, tp_group)
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


# ---------------------------------------------------------------------------------------------
# 2. the mixture, per row
# ---------------------------------------------------------------------------------------------


def mixed_log_prob(
    z_y: torch.Tensor,
    lse: torch.Tensor,
    copy_all: torch.Tensor,
    copy_match: torch.Tensor,
    gate: torch.Tensor | None,
    mix: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(y_t) of the mixture and the copy side's share of the next-token mass (no gradient).

    copy_all A_t is -inf where a row has no candidate, copy_match M_t is -inf where no candidate
    pastes y_t. Those -inf are replaced by finite stand-ins wherever a difference is formed, so
    that masked rows get zero gradient instead of nan.
    """
    has_cand = torch.isfinite(copy_all)
    neg_inf = torch.full_like(z_y, float("-inf"))
    lm_log_softmax = z_y - lse  # log softmax_V(z)_y
    if mix == "gate":
        # g = sigmoid(gate); an empty candidate set forces g = 1.
        log_g = torch.where(has_cand, F.logsigmoid(gate), torch.zeros_like(z_y))
        copy_log_p = copy_match - torch.where(has_cand, copy_all, torch.zeros_like(z_y))  # M - A
        copy_term = torch.where(has_cand, F.logsigmoid(-gate) + copy_log_p, neg_inf)
        log_p = torch.logaddexp(log_g + lm_log_softmax, copy_term)
        share = torch.where(has_cand, torch.sigmoid(-gate.detach()), torch.zeros_like(z_y))
    elif mix == "joint":
        # One softmax over vocabulary entries and context positions.
        log_z = torch.logaddexp(lse, copy_all)
        log_p = torch.logaddexp(z_y, copy_match) - log_z
        share = torch.exp((copy_all - log_z).detach())
    elif mix == "sentinel":
        # The sentinel joins the copy softmax; its share is the LM head's weight.
        s_t = torch.logaddexp(gate, copy_all)
        log_g = gate - s_t
        log_p = torch.logaddexp(log_g + lm_log_softmax, copy_match - s_t)
        share = -torch.expm1(log_g.detach())
    else:
        raise ValueError(f"mix={mix!r} is not one of {MIX_MODES}")
    return log_p, share


# ---------------------------------------------------------------------------------------------
# 3. the public loss
# ---------------------------------------------------------------------------------------------


def mixed_nll(
    lm_logits: torch.Tensor,
    copy_all: torch.Tensor,
    copy_match: torch.Tensor,
    gate: torch.Tensor | None,
    labels: torch.Tensor,
    mix: str,
    tp_group: dist.ProcessGroup | None = None,
    *,
    inplace: bool = False,
) -> torch.Tensor:
    """Per-token negative log-likelihood of the copy/LM mixture, 0 where labels = -100.

    float32 (float64 for float64 logits, as gradcheck uses). Training passes inplace=True (see
    `target_logit_and_lse`).

    lm_logits  [N, V/tp] this rank's vocabulary shard (fp32 or bf16)
    copy_all   [N] A_t  (-inf where a row has no candidate)
    copy_match [N] M_t  (-inf where no candidate pastes the label)
    gate       [N] gate logit (mix="gate"), sentinel score (mix="sentinel"); ignored for "joint"
    labels     [N] global vocabulary ids; -100 = ignore
    """
    if mix not in MIX_MODES:
        raise ValueError(f"mix={mix!r} is not one of {MIX_MODES}")
    z_y, lse = target_logit_and_lse(lm_logits, labels, tp_group, inplace=inplace)
    dtype = z_y.dtype
    gate = None if mix == "joint" else gate.to(dtype)
    log_p, _ = mixed_log_prob(z_y, lse, copy_all.to(dtype), copy_match.to(dtype), gate, mix)
    return torch.where(labels == IGNORE_INDEX, torch.zeros_like(log_p), -log_p)


# ---------------------------------------------------------------------------------------------
# 4. the full next-token distribution, shard by shard (evaluation and generation; no gradient)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def vocab_parallel_lse(logits: torch.Tensor, tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """LSE_V over the sharded last dimension, float32 [...]."""
    logits = logits.float()
    m = logits.amax(dim=-1)
    _all_reduce(m, dist.ReduceOp.MAX, tp_group)
    sum_exp = torch.exp(logits - m.unsqueeze(-1)).sum(dim=-1)
    _all_reduce(sum_exp, dist.ReduceOp.SUM, tp_group)
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
    copy_log_probs: torch.Tensor,
    copy_all: torch.Tensor,
    gate: torch.Tensor | None,
    mix: str,
    tp_group: dist.ProcessGroup | None = None,
    *,
    with_copy_part: bool = False,
):
    """log p_w of the mixture for this rank's vocabulary shard [..., V/tp], float32.

    copy_log_probs [..., V/tp] log p_copy(w) from `scatter_copy_log_probs`; copy_all [...] A_t.
    with_copy_part=True also returns the copy component's share of it, log of its mass on w.
    """
    z = lm_logits.float()
    lse = vocab_parallel_lse(z, tp_group).unsqueeze(-1)
    a = copy_all.float().unsqueeze(-1)
    has_cand = torch.isfinite(a)
    copy_mass = a + copy_log_probs  # log of the unnormalised copy mass on w (-inf where none)
    if mix == "gate":
        g = gate.float().unsqueeze(-1)
        log_g = torch.where(has_cand, F.logsigmoid(g), torch.zeros_like(g))
        log_1mg = torch.where(has_cand, F.logsigmoid(-g), torch.full_like(g, float("-inf")))
        lm_part, copy_part = log_g + z - lse, log_1mg + copy_log_probs
    elif mix == "joint":
        log_z = torch.logaddexp(lse, a)
        lm_part, copy_part = z - log_z, copy_mass - log_z
    elif mix == "sentinel":
        s_t = torch.logaddexp(gate.float().unsqueeze(-1), a)
        lm_part, copy_part = gate.float().unsqueeze(-1) - s_t + z - lse, copy_mass - s_t
    else:
        raise ValueError(f"mix={mix!r} is not one of {MIX_MODES}")
    log_p = torch.logaddexp(lm_part, copy_part)
    return (log_p, copy_part) if with_copy_part else log_p


@torch.no_grad()
def vocab_parallel_log_softmax(logits: torch.Tensor, tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """log softmax_V(z) for this rank's shard, float32 (the distribution with the copy head off)."""
    return logits.float() - vocab_parallel_lse(logits, tp_group).unsqueeze(-1)


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
