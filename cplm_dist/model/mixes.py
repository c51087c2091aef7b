"""The copy/LM mixes (docs/copy_head.md), each one record that every part of the stack reads:

| field | what | read by |
|---|---|---|
| log_weights | the log-weights of the two components, log p(w) = logaddexp(lm + log softmax_V(z)_w, copy + log copy_mass_w) | cplm_dist.model.loss (the loss and the full distribution) |
| gate | the per-token third term: "hidden" (a gate logit, a linear of h), "query" (the sentinel score q . k_s), None | the copy head (its parameters and that term), profiling.communication (floats it gathers) |
| own_parameters | what the mix adds to the copy head beside q and k | the copy head, cplm_dist.model.counting |
| average_heads | heads normalised one by one and their copy distributions averaged; else pooled | the copy head |

`experiments.VARIANTS` runs one variant a mix. The exported remote code (cplm_dist/interop/hf/remote)
spells the mixes again, standalone: a test pins it to these records. A new mix is a record here
(and its name in config.tree's `MixMode`); a new kind of `gate`, a branch in the copy head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


class MixWeights(NamedTuple):
    lm: torch.Tensor  # log weight of softmax_V(z): log g (gate, sentinel), LSE_V - log Z (joint)
    copy: torch.Tensor  # log weight of the copy mass: log(1 - g) - A (gate), -S (sentinel), -log Z (joint)


def _gate(lse, copy_all, gate, has_cand) -> MixWeights:
    """g = sigmoid(gate); an empty candidate set forces g = 1 (and no copy mass)."""
    safe_all = torch.where(has_cand, copy_all, torch.zeros_like(copy_all))
    return MixWeights(torch.where(has_cand, F.logsigmoid(gate), torch.zeros_like(gate)),
                      torch.where(has_cand, F.logsigmoid(-gate) - safe_all, torch.full_like(gate, NEG_INF)))


def _joint(lse, copy_all, gate, has_cand) -> MixWeights:
    """One softmax over vocabulary entries and context positions: Z = exp(LSE_V) + exp(A)."""
    log_z = torch.logaddexp(lse, copy_all)
    return MixWeights(lse - log_z, -log_z)


def _joint_gate(lse, copy_all, gate, has_cand) -> MixWeights:
    """The gate over the joint mix's evidence: g = sigmoid(gate + LSE_V - A). With the learned term
    at 0 it is the joint mix; the term (a linear of h) moves the split the masses give, so the copy
    head's confidence (A against LSE_V) reaches the split, which a gate of h alone never sees."""
    safe_all = torch.where(has_cand, copy_all, torch.zeros_like(copy_all))
    return _gate(lse, copy_all, gate + lse - safe_all, has_cand)


def _sentinel(lse, copy_all, gate, has_cand) -> MixWeights:
    """The sentinel (score `gate`) joins the copy softmax, S = logaddexp(sentinel, A); its share is g."""
    s = torch.logaddexp(gate, copy_all)
    return MixWeights(gate - s, -s)


@dataclass(frozen=True)
class Mix:
    name: str
    log_weights: Callable[..., MixWeights]  # (LSE_V, A_t, the gate term or None, A_t finite) -> MixWeights
    gate: str | None  # "hidden": g from a linear of h (bias included); "query": the sentinel score q . k_s / sqrt(d_c); None
    average_heads: bool  # each head its own copy distribution, averaged (else the heads' candidates pool)

    def own_parameters(self, hidden: int, heads: int, head_dim: int) -> list[tuple[str, tuple[int, ...], bool]]:
        """(name under copy_head., shape, whether it multiplies each token's hidden state) of the
        parameters the mix adds to the copy head beside q and k, in module order."""
        if self.gate == "hidden":
            return [("gate.weight", (1, hidden), True), ("gate.bias", (1,), False)]
        if self.gate == "query":
            return [("sentinel", (heads, head_dim), False)]
        return []


MIXES: dict[str, Mix] = {
    "gate": Mix("gate", _gate, gate="hidden", average_heads=True),
    "joint": Mix("joint", _joint, gate=None, average_heads=False),
    "sentinel": Mix("sentinel", _sentinel, gate="query", average_heads=False),
    "joint_gate": Mix("joint_gate", _joint_gate, gate="hidden", average_heads=False),
}
