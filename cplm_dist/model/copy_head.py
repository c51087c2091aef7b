"""The Copy-Paste head (docs/copy_head.md), replicated on every tp rank.

H_c heads of width d_c score every context position j for every position t:
    q_t = W_q h_t,  k_j = W_k h_j,  s_tj = q_t . k_j / sqrt(d_c)          (optional RoPE on q, k)
over the candidates C_t of the paste mode (`next`: j < t pastes x_{j+1}; `self`: j <= t pastes
x_j), summarised per token by two log-sum-exps, never a T x V tensor:
    A_t = logsumexp_{j in C_t} s_tj,   M_t = logsumexp_{j in C_t, src_j = y_t} s_tj.

Several heads are combined into one (A_t, M_t) so that the loss interface stays per-token:
  - gate: the heads' copy distributions are averaged, p_copy = mean_h softmax(s_h); returned as
    A_t = 0 and M_t = log mean_h exp(M_h - A_h) (so M - A = log p_copy(y)), A_t = -inf if C_t empty;
  - joint, sentinel: the heads' candidates join one pool with weight 1/H_c each:
    A_t = log mean_h exp(A_h), M_t = log mean_h exp(M_h), and the sentinel score likewise.
With one head both reduce to the formulas above.

Two paths in cplm_dist.model.copy_lse compute the per-head (A, M), chosen by `copy.impl`:
  - dense: forms the (B, H_c, T, T) scores and lets autograd keep what it needs; the reference
    every faster path is tested against;
  - chunked (default): query rows in blocks of `copy.chunk_size`, scores recomputed in backward;
    memory linear in T for a fixed block. A sequence that fits in one block (T <= chunk_size)
    takes the dense path: the same peak memory, no recomputation.

Under sequence parallelism (`sp_group`, the tp group) a rank holds the final states of its own
T/tp positions. It projects its own queries and keys, all-gathers the keys (B x T x H_c x d_c
floats; backward reduce-scatters their gradient), scores its own query rows against every key,
and all-gathers the per-token results (A_t, M_t, gate: at most 3 floats a token; backward keeps
its own rows, the loss being replicated over tp). The hidden states themselves never move. The
head's weights then see this rank's positions only, so their gradients are summed over tp.
"""

from __future__ import annotations

import math

import torch

from cplm_dist.config import CopyConfig, ModelConfig
from cplm_dist.model.copy_lse import candidate_mask, chunked_copy_lse, dense_copy_lse, masked_logsumexp
from cplm_dist.model.rotary import apply_rope, rope_tables
from cplm_dist.model.sequence_parallel import ReplicatedLinear, active, gather_sequence, sum_grad_over
from cplm_dist.vocab_parallel import NEG_INF, CopyTerms


class CopyHead(torch.nn.Module):
    def __init__(self, model_cfg: ModelConfig, cfg: CopyConfig, *, device=None, dtype=None, sp_group=None):
        """sp_group: the tp group under sequence parallelism (None: h holds every position)."""
        super().__init__()
        self.cfg = cfg
        self.sp_group = sp_group if active(sp_group) else None
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.rope_theta = model_cfg.rope_theta
        self.shift = -1 if cfg.paste == "next" else 0  # C_t = {j <= t + shift}: next j < t, self j <= t
        self.average_heads = cfg.mix == "gate"  # each head its own copy distribution, averaged; else pooled
        width = cfg.num_heads * cfg.head_dim
        self.q = ReplicatedLinear(model_cfg.hidden_size, width, bias=False, device=device, dtype=dtype, grad_group=self.sp_group)
        self.k = ReplicatedLinear(model_cfg.hidden_size, width, bias=False, device=device, dtype=dtype, grad_group=self.sp_group)
        if cfg.mix == "gate":
            self.gate = ReplicatedLinear(model_cfg.hidden_size, 1, bias=True, device=device, dtype=dtype, grad_group=self.sp_group)
        elif cfg.mix == "sentinel":
            self.sentinel = torch.nn.Parameter(torch.empty(cfg.num_heads, cfg.head_dim, device=device, dtype=dtype))

    # --- pieces ---------------------------------------------------------------------------------

    def source_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) id pasted from position j; -1 where position j pastes nothing."""
        if self.cfg.paste == "self":
            return input_ids
        return torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], -1)], dim=1)

    def project(self, h: torch.Tensor, offset: int = 0, seq_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k of shape (B, H, T, d) in float32, for positions offset .. offset + T - 1 of
        h (B, T, D), or (T, B, D) with seq_first (projected in that layout: no copy of h)."""
        T = h.shape[0] if seq_first else h.shape[1]
        order = (1, 2, 0, 3) if seq_first else (0, 2, 1, 3)
        q = self.q(h).unflatten(-1, (self.heads, self.head_dim)).permute(order).float()  # (B, H, T, d)
        k = self.k(h).unflatten(-1, (self.heads, self.head_dim)).permute(order).float()  # (B, H, T, d)
        if self.cfg.rope:
            cos, sin = rope_tables(offset + T, self.head_dim, self.rope_theta, device=h.device)
            q, k = apply_rope(q, cos[offset:], sin[offset:]), apply_rope(k, cos[offset:], sin[offset:])
        return q, k

    def gate_logit(self, h: torch.Tensor, q: torch.Tensor, seq_first: bool = False) -> torch.Tensor | None:
        """(B, T): the gate logit (gate mix), the sentinel score (sentinel mix), None (joint);
        h as `project` takes it."""
        if self.cfg.mix == "gate":
            gate = self.gate(h).squeeze(-1).float()
            return gate.t() if seq_first else gate
        if self.cfg.mix == "sentinel":
            sentinel = sum_grad_over(self.sentinel, self.sp_group).float()
            sent = torch.einsum("bhtd,hd->bht", q, sentinel) / math.sqrt(self.head_dim)  # (B, H, T)
            return torch.logsumexp(sent, dim=1) - math.log(self.heads)
        return None

    def _combine(self, per_head: torch.Tensor, a_heads: torch.Tensor) -> torch.Tensor:
        """(B, H, T) per-head log-sum-exps -> (B, T) as the module docstring defines."""
        if self.average_heads:
            safe_a = torch.where(torch.isfinite(a_heads), a_heads, torch.zeros_like(a_heads))
            per_head = per_head - safe_a
        return masked_logsumexp(per_head, None, dim=1) - math.log(self.heads)

    def _copy_all(self, a_heads: torch.Tensor) -> torch.Tensor:
        """A_t (B, T) from the per-head (B, H, T): with averaged heads 0 (-inf for an empty row),
        as the heads' distributions are normalised one by one; pooled, their log-mean-exp."""
        if self.average_heads:
            return torch.where(torch.isfinite(a_heads[:, 0]), 0.0, NEG_INF)
        return self._combine(a_heads, a_heads)

    # --- training: per-token terms ----------------------------------------------------------------

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor | None) -> CopyTerms:
        """h (B, T, D) final-norm states, input_ids (B, T), labels (B, T) global ids or -100.
        Under sequence parallelism h is this rank's (T/tp, B, D) positions and the terms come back
        for all T positions, sequence-first (T, B), as the loss takes them."""
        sp, offset = self.sp_group is not None, 0
        if sp:
            offset = self.sp_group.rank() * h.shape[0]
            labels = None if labels is None else labels[:, offset : offset + h.shape[0]]
        q, k = self.project(h, offset, seq_first=sp)  # (B, H, T or T/tp, d)
        if self.sp_group is not None:  # every key, from every rank: (B, H, T, d)
            k = gather_sequence(k.permute(2, 0, 1, 3), self.sp_group, sum_grad=True).permute(1, 2, 0, 3)
        src = self.source_ids(input_ids)  # (B, T)
        if self.cfg.impl == "chunked" and k.shape[2] > self.cfg.chunk_size:
            a_heads, m_heads = chunked_copy_lse(q, k, src, labels, self.shift, self.cfg.chunk_size, offset)  # (B, H, Tq) each
        else:
            a_heads, m_heads = dense_copy_lse(q, k, src, labels, self.shift, offset)
        copy_match = self._combine(m_heads, a_heads) if labels is not None else None
        terms = CopyTerms(self._copy_all(a_heads), copy_match, self.gate_logit(h, q, seq_first=sp))
        return self._gather_terms(terms) if sp else terms

    def _gather_terms(self, terms: CopyTerms) -> CopyTerms:
        """This rank's (B, T/tp) terms -> all positions' (T, B), in one all-gather of (T/tp, B, n<=3)."""
        present = [t for t in terms if t is not None]
        rows = gather_sequence(torch.stack(present, dim=-1).transpose(0, 1), self.sp_group, sum_grad=False)
        parts = iter(rows.unbind(-1))
        return CopyTerms(*(None if t is None else next(parts) for t in terms))

    # --- evaluation: the copy distribution over positions ------------------------------------------

    @torch.no_grad()
    def position_weights(self, h: torch.Tensor, input_ids: torch.Tensor):
        """(weights (B, T, T) over context positions, rows summing to 1 or 0 when empty,
        src_ids (B, T), CopyTerms without copy_match)."""
        q, k = self.project(h)
        return self.weights_for(q, k, input_ids, 0, h)

    @torch.no_grad()
    def weights_for(self, q: torch.Tensor, k: torch.Tensor, ids: torch.Tensor, offset: int, h: torch.Tensor):
        """The copy distribution of queries q (B, H, Tq, d) at positions offset.. over keys k
        (B, H, Tk, d) of the positions 0..Tk-1 whose ids are `ids` (B, Tk); h (B, Tq, D) for the gate."""
        Tq, Tk = q.shape[2], k.shape[2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # (B, H, Tq, Tk)
        cand = candidate_mask(Tq, Tk, offset, self.shift, q.device)
        scores = scores.masked_fill(~cand, NEG_INF)
        a_heads = masked_logsumexp(scores, None, dim=-1)  # (B, H, Tq)
        copy_all = self._copy_all(a_heads)
        # each head's normaliser: its own A (averaged heads) or the pool's (B, H or 1, Tq)
        norm = a_heads if self.average_heads else copy_all.unsqueeze(1)
        norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
        weights = torch.exp(scores - norm.unsqueeze(-1)).mean(dim=1)  # (B, Tq, Tk)
        return weights, self.source_ids(ids), CopyTerms(copy_all, None, self.gate_logit(h, q))
