"""Dense single-process references, written out the slow and obvious way (float64, loops).

Each function states docs/copy_head.md's formula over the whole vocabulary and every context position,
with no log-sum-exp tricks, no sharding and no -inf bookkeeping, so that the fast vocab-parallel
code has something independent to be compared with.
"""

from __future__ import annotations

import math

import torch

IGNORE = -100


def mixture_nll(logits, copy_all, copy_match, gate, labels, mix):
    """-log p(y_t) from full-vocabulary logits [N, V] and the per-row A_t, M_t, gate (docs/copy_head.md)."""
    out = []
    for i in range(logits.shape[0]):
        y = int(labels[i])
        if y == IGNORE:
            out.append(logits.new_zeros(()))
            continue
        z = logits[i]
        p_lm = torch.exp(z[y]) / torch.exp(z).sum()
        has_cand = bool(torch.isfinite(copy_all[i]))
        e_all = torch.exp(copy_all[i]) if has_cand else z.new_zeros(())
        e_match = torch.exp(copy_match[i]) if bool(torch.isfinite(copy_match[i])) else z.new_zeros(())
        if mix in ("gate", "joint_gate"):
            evidence = torch.log(torch.exp(z).sum()) - copy_all[i] if mix == "joint_gate" and has_cand else 0.0
            g = torch.sigmoid(gate[i] + evidence) if has_cand else z.new_ones(())
            p = g * p_lm + ((1 - g) * e_match / e_all if has_cand else 0.0)
        elif mix == "joint":
            p = (torch.exp(z[y]) + e_match) / (torch.exp(z).sum() + e_all)
        elif mix == "sentinel":
            denom = torch.exp(gate[i]) + e_all
            p = torch.exp(gate[i]) / denom * p_lm + e_match / denom
        else:
            raise ValueError(mix)
        out.append(-torch.log(p))
    return torch.stack(out)


def candidates(t: int, T: int, paste: str) -> list[int]:
    return list(range(t)) if paste == "next" else list(range(t + 1))


def source(ids, j: int, paste: str) -> int:
    return int(ids[j + 1]) if paste == "next" else int(ids[j])


def next_token_distribution(logits, scores, sentinel_or_gate, ids, mix, paste):
    """p(w | x_<=t) for one sequence: logits [T, V], scores [H, T, T] (s_htj), ids [T].

    gate, joint_gate: sentinel_or_gate [T] gate logits; sentinel: [H, T] per-head sentinel scores.
    Several heads: gate averages the heads' copy distributions; joint, sentinel and joint_gate
    pool every head's positions with weight 1/H (cplm_dist.model.copy_head).
    """
    H, T, _ = scores.shape
    V = logits.shape[1]
    out = torch.zeros(T, V, dtype=torch.float64)
    for t in range(T):
        cand = candidates(t, T, paste)
        p_lm = torch.softmax(logits[t].double(), 0)
        if mix == "gate":
            p_copy = torch.zeros(V, dtype=torch.float64)
            for h in range(H):
                if cand:
                    w = torch.softmax(scores[h, t, cand].double(), 0)
                    for j, wj in zip(cand, w):
                        p_copy[source(ids, j, paste)] += wj / H
            g = torch.sigmoid(sentinel_or_gate[t].double()) if cand else 1.0
            out[t] = g * p_lm + (1 - g) * p_copy
        else:
            mass = torch.zeros(V, dtype=torch.float64)
            for h in range(H):
                for j in cand:
                    mass[source(ids, j, paste)] += torch.exp(scores[h, t, j].double()) / H
            if mix == "joint":
                full = torch.exp(logits[t].double()) + mass
                out[t] = full / full.sum()
            elif mix == "joint_gate":
                if not cand:
                    out[t] = p_lm
                    continue
                evidence = torch.exp(logits[t].double()).sum().log() - mass.sum().log()
                g = torch.sigmoid(sentinel_or_gate[t].double() + evidence)
                out[t] = g * p_lm + (1 - g) * mass / mass.sum()
            else:
                sent = torch.exp(sentinel_or_gate[:, t].double()).mean()
                z_copy = sent + mass.sum()
                out[t] = sent / z_copy * p_lm + mass / z_copy
    return out


def copy_terms(scores, ids, labels, mix, paste):
    """(A_t, M_t) for one sequence from scores [H, T, T], as CopyHead combines heads."""
    H, T, _ = scores.shape
    A, M = torch.full((T,), -math.inf, dtype=torch.float64), torch.full((T,), -math.inf, dtype=torch.float64)
    for t in range(T):
        cand = candidates(t, T, paste)
        if not cand:
            continue
        match = [j for j in cand if source(ids, j, paste) == int(labels[t])]
        if mix == "gate":
            A[t] = 0.0
            p = sum(torch.exp(scores[h, t, match].double()).sum() / torch.exp(scores[h, t, cand].double()).sum()
                    for h in range(H)) / H
        else:
            A[t] = math.log(sum(torch.exp(scores[h, t, cand].double()).sum() for h in range(H)) / H)
            p = sum(torch.exp(scores[h, t, match].double()).sum() for h in range(H)) / H
        M[t] = math.log(p) if p > 0 else -math.inf
    return A, M
