"""The copy head's gradient path and the LM head's bottleneck, measured on a live (tp-sharded) model
without gathering the vocabulary and without touching its parameters' gradients.

    figures = gradient_paths(model, input_ids, labels, position_ids)   # a dict of floats

The final hidden states h are fed to the two heads as two separate leaves (as
cplm_dist.evaluation.bottleneck's `measure` does), and torch.autograd.grad returns dL/dh through
each and G = dL/dz for this rank's vocabulary shard of the LM logits; nothing is accumulated into
`.grad`, so a training step in progress is undisturbed. For W (V x D) the LM head's weight, the
share of ||G||^2 the backbone can see is ||G Q||^2 / ||G||^2 with Q an orthonormal basis of W's
columns, and

    ||G Q||^2 = tr((G W) (W^T W)^-1 (G W)^T)

needs only W^T W (D x D) and G W (N x D), both sums over the vocabulary shards (all-reduced over
tp): the (N, V) gradient is never gathered. Padded vocabulary rows are left out. Figures:

    suppressed_fraction         1 - ||G Q||^2 / ||G||^2 (the LM head's part of the mixed loss)
    grad_norm_logits            ||G||
    grad_norm_h_via_lm_head     ||dL/dh|| through the LM head
    grad_norm_h_via_copy_head   ||dL/dh|| through the copy head (0 without one)
    copy_to_lm_ratio            their ratio
    copy_share_mean / _std      the copy side's share of the next-token mass (the gate's or the sentinel's), over trained tokens
    copy_dominates              the fraction of trained tokens where that share exceeds 1/2
    loss, tokens
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import cplm_dist.model.loss as loss
from cplm_dist.model.documents import document_index


def gradient_paths(model, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                   *, lm_only: bool = False) -> dict:
    """The figures of the module docstring for one micro-batch through `model` (a CPLM, any tp,
    sequence parallel or not; not context parallel). lm_only=True measures the LM head's own loss
    (as if the copy head were off) on the same model."""
    head, group = model.parts.head, model.tp_group
    sp = model.sequence_parallel
    with torch.no_grad():
        h = model.hidden_states(input_ids, position_ids)
    h_lm, h_copy = h.detach().clone().requires_grad_(True), h.detach().clone().requires_grad_(True)
    logits = model.lm_logits(h_lm, model.tied)  # (B, T, V/tp); sequence parallel: (T, B, V/tp), the whole sequence
    copy = None
    if model.copy_head is not None and not lm_only:
        docs = None if position_ids is None else document_index(position_ids)
        copy = model.copy_head(h_copy, input_ids, labels, docs, position_ids)
    token_labels = labels.t().contiguous() if sp else labels
    out = loss.mixed_nll(logits, token_labels, copy, model.copy_cfg.mix, group)
    keep = token_labels != loss.IGNORE_INDEX
    mean_nll = out.nll.sum() / keep.sum()
    leaves = [logits, h_lm] + ([h_copy] if copy is not None else [])
    grads = torch.autograd.grad(mean_nll, leaves, allow_unused=True)
    real = head.real_local
    g = grads[0].detach().flatten(0, -2)[:, :real].double()  # (N, V_real/tp): this rank's vocabulary shard
    weight = (model.tied if model.tied is not None else model.lm_head.weight).detach()[:real].double()  # (V_real/tp, D)
    gw, wtw, g_sq = g @ weight, weight.t() @ weight, g.pow(2).sum()
    for t in (gw, wtw, g_sq):
        loss.all_reduce(t, dist.ReduceOp.SUM, group)
    seen = torch.trace(gw @ torch.linalg.solve(wtw, gw.t()))  # ||G Q||^2
    via_lm = _h_norm(grads[1], sp, group)
    via_copy = _h_norm(grads[2], sp, group) if copy is not None and grads[2] is not None else 0.0
    share = out.copy_share.detach()[keep].double()
    return {
        "loss": float(mean_nll.detach()),
        "suppressed_fraction": float(1.0 - seen / g_sq),
        "grad_norm_logits": float(g_sq.sqrt()),
        "grad_norm_h_via_lm_head": via_lm,
        "grad_norm_h_via_copy_head": via_copy,
        "copy_to_lm_ratio": via_copy / via_lm if via_lm > 0 else float("nan"),
        "copy_share_mean": float(share.mean()),
        "copy_share_std": float(share.std(unbiased=False)),
        "copy_dominates": float((share > 0.5).double().mean()),
        "tokens": int(keep.sum()),
    }


def _h_norm(grad: torch.Tensor, sequence_parallel: bool, group) -> float:
    """||dL/dh||: whole on every tp rank, or (sequence parallel) summed over the ranks' positions."""
    sq = grad.detach().double().pow(2).sum()
    return float((loss.all_reduce(sq, dist.ReduceOp.SUM, group) if sequence_parallel else sq).sqrt())
