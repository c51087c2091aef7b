"""The Copy-Paste head (docs/copy_head.md), replicated on every tp rank.

H_c heads of width d_c score every context position j for every position t:
    q_t = W_q h_t,  k_j = W_k h_j,  s_tj = q_t . k_j / sqrt(d_c)          (optional RoPE on q, k)
over the candidates C_t of the paste mode (`next`: j < t pastes x_{j+1}; `self`: j <= t pastes
x_j), summarised per token by two log-sum-exps, never a T x V tensor:
    A_t = logsumexp_{j in C_t} s_tj,   M_t = logsumexp_{j in C_t, src_j = y_t} s_tj.

Several heads are combined into one (A_t, M_t) so that the loss interface stays per-token, as the
mix's record says (cplm_dist.model.mixes, `average_heads`):
  - averaged (gate): the heads' copy distributions are averaged, p_copy = mean_h softmax(s_h);
    returned as A_t = 0 and M_t = log mean_h exp(M_h - A_h) (so M - A = log p_copy(y)), A_t = -inf
    if C_t empty;
  - pooled (joint, sentinel): the heads' candidates join one pool with weight 1/H_c each:
    A_t = log mean_h exp(A_h), M_t = log mean_h exp(M_h), and the sentinel score likewise.
The mix's own parameters (a gate's linear, the sentinel keys) and its per-token gate term are the
record's too.
With one head both reduce to the formulas above.

Three paths in cplm_dist.model.copy_lse compute the per-head (A, M), chosen by `copy.impl`:
  - dense: forms the (B, H_c, T, T) scores and lets autograd keep what it needs; the reference
    every faster path is tested against;
  - chunked: query rows in blocks of `copy.chunk_size`, scores recomputed in backward; memory
    linear in T for a fixed block. A sequence that fits in one block (T <= chunk_size) takes the
    dense path: the same peak memory, no recomputation;
  - flex: two fused FlexAttention kernels (one per log-sum-exp) on CUDA, memory linear in T;
  - auto (default): chunked (dense within one block), and flex for training on CUDA once the
    flex path has run on a GPU with this torch (the record tools/gpu_check.sh writes,
    cplm_dist/model/flex_record.py), where Triton is installed and the lengths are whole
    128-blocks. If the kernel then fails to build, the run warns once and goes on chunked.

Under train.compile the pointwise parts (the projections' layout, casts and RoPE, the heads'
combination and the gate) run as compiled graphs (`compile_pointwise`); the log-sum-exps are
compiled on their own (flex) or stay eager (dense, chunked).

Under sequence parallelism (`sp_group`, the tp group) a rank holds the final states of its own
T/tp positions. It projects its own queries and keys, all-gathers the keys (B x T x H_c x d_c
floats; backward reduce-scatters their gradient), scores its own query rows against every key,
and all-gathers the per-token results (A_t, M_t, gate: at most 3 floats a token; backward keeps
its own rows, the loss being replicated over tp). The hidden states themselves never move. The
head's weights then see this rank's positions only, so their gradients are summed over tp.

Under context parallelism each cp rank holds two chunks of the sequence: its queries score the
keys all-gathered over cp (the source ids from the gathered input ids), chunk by chunk, by the
same paths with the chunk's offset (cplm_dist.model.parallel.context).
"""

from __future__ import annotations

import logging
import math

import torch

from cplm_dist.config import CopyConfig, ModelConfig
from cplm_dist.errors import ConfigError
from cplm_dist.model.compiled import unavailable_reason
from cplm_dist.model.copy_lse import (FLEX_BLOCK, candidate_mask, chunked_copy_lse, dense_copy_lse, flex_copy_lse,
                                      masked_logsumexp, per_head, query_positions)
from cplm_dist.model.flex_record import read_record
from cplm_dist.model.loss import NEG_INF, CopyTerms
from cplm_dist.model.mixes import MIXES
from cplm_dist.model.parallel.sequence import ReplicatedLinear, active, gather_sequence, sum_grad_over
from cplm_dist.model.positions import apply_rope, rope_angles

log = logging.getLogger(__name__)


FLEX_NEEDS_CUDA = ("copy.impl=flex trains on CUDA only (FlexAttention has no {device} backward): set copy.impl=auto "
                   "(chunked; flex on CUDA once a GPU check recorded it) or copy.impl=chunked")


def check_copy_impl(copy: CopyConfig, cuda: bool) -> None:
    """Before a training run starts: copy.impl=flex needs CUDA (one line, exit 2, nothing written)."""
    if copy.enabled and copy.impl == "flex" and not cuda:
        raise ConfigError(FLEX_NEEDS_CUDA.format(device="CPU"))


class CopyHead(torch.nn.Module):
    def __init__(self, model_cfg: ModelConfig, cfg: CopyConfig, *, device=None, dtype=None, sp_group=None):
        """sp_group: the tp group under sequence parallelism (None: h holds every position)."""
        super().__init__()
        self.cfg = cfg
        self.sp_group = sp_group if active(sp_group) else None
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.rope_theta = model_cfg.rope_theta
        self.rope_scaling = getattr(model_cfg, "rope_scaling", None)  # the backbone's (context extension)
        self.shift = -1 if cfg.paste == "next" else 0  # C_t = {j <= t + shift}: next j < t, self j <= t
        self.mix = MIXES[cfg.mix]
        if cfg.gate_detach and self.mix.gate != "hidden":
            raise ConfigError(f"copy.gate_detach=true needs a gate read from h (copy.mix gate or joint_gate), not "
                              f"copy.mix={cfg.mix}: set copy.gate_detach=false or change the mix")
        self.gate_detach = cfg.gate_detach  # the gate's input detached from the trunk
        self.average_heads = self.mix.average_heads  # each head its own copy distribution, averaged; else pooled
        width = cfg.num_heads * cfg.head_dim
        self.q = ReplicatedLinear(model_cfg.hidden_size, width, bias=False, device=device, dtype=dtype, grad_group=self.sp_group)
        self.k = ReplicatedLinear(model_cfg.hidden_size, width, bias=False, device=device, dtype=dtype, grad_group=self.sp_group)
        if self.mix.gate == "hidden":  # the mix's own parameters (cplm_dist.model.mixes: Mix.own_parameters)
            self.gate = ReplicatedLinear(model_cfg.hidden_size, 1, bias=True, device=device, dtype=dtype, grad_group=self.sp_group)
        elif self.mix.gate == "query":
            self.sentinel = torch.nn.Parameter(torch.empty(cfg.num_heads, cfg.head_dim, device=device, dtype=dtype))
        self._arrange, self._terms = self.arrange, self.terms  # compiled by compile_pointwise
        self._flex_failed: str | None = None  # copy.impl=auto: why the flex kernel could not run here
        self._flex_record: dict | None = None  # copy.impl=auto: flex_record.read_record(), read once ({}: none)
        self._flex_probed = False  # copy.impl=auto: the first flex call ran forward and backward once
        self.last_path: str | None = None  # the path the last forward took (lse_path), for the profiler

    def compile_pointwise(self, device: torch.device) -> bool:
        """train.compile: the pointwise parts (the projections' layout, casts and RoPE; the
        per-token combination of heads and the gate) as compiled graphs. False, with one warning,
        where compilation is unavailable, and under sequence parallelism, whose weight gradients
        are summed over tp inside the graph."""
        reason = unavailable_reason(device) or ("sequence parallelism is on" if self.sp_group is not None else None)
        if reason:
            log.warning("train.compile=true but %s: the copy head runs eager", reason)
            return False
        self._arrange, self._terms = torch.compile(self.arrange), torch.compile(self.terms)
        return True

    # --- pieces ---------------------------------------------------------------------------------

    def source_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) id pasted from position j; -1 where position j pastes nothing."""
        if self.cfg.paste == "self":
            return input_ids
        return torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], -1)], dim=1)

    def project(self, h: torch.Tensor, offset: int = 0, seq_first: bool = False,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k of shape (B, H, T, d) in float32, for positions offset .. offset + T - 1 of
        h (B, T, D), or (T, B, D) with seq_first (projected in that layout: no copy of h);
        `positions` (B, T): the positions RoPE reads instead (document masking)."""
        return self.arrange(self.q(h), self.k(h), offset, seq_first, positions)

    def arrange(self, q: torch.Tensor, k: torch.Tensor, offset: int = 0, seq_first: bool = False,
                positions: torch.Tensor | None = None):
        """The projections (B, T, H d), or (T, B, H d) with seq_first, as `project` returns them
        (pointwise: compiled under train.compile)."""
        T = q.shape[0] if seq_first else q.shape[1]
        order = (1, 2, 0, 3) if seq_first else (0, 2, 1, 3)
        q = q.unflatten(-1, (self.heads, self.head_dim)).permute(order).float()  # (B, H, T, d)
        k = k.unflatten(-1, (self.heads, self.head_dim)).permute(order).float()  # (B, H, T, d)
        if self.cfg.rope:
            if positions is None:
                positions = torch.arange(offset, offset + T, device=q.device)
            cos, sin = rope_angles(positions, self.head_dim, self.rope_theta, self.rope_scaling)
            if cos.dim() == 3:  # per row: (B, 1, T, d)
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k

    def gate_logit(self, h: torch.Tensor, q: torch.Tensor, seq_first: bool = False) -> torch.Tensor | None:
        """(B, T): the mix's gate term (cplm_dist.model.mixes, Mix.gate): the gate logit from h, the
        sentinel score from q, or None; h as `project` takes it."""
        if self.mix.gate == "hidden":
            gate = self.gate(h.detach() if self.gate_detach else h).squeeze(-1).float()
            return gate.t() if seq_first else gate
        if self.mix.gate == "query":
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

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor | None,
                docs: torch.Tensor | None = None, positions: torch.Tensor | None = None, context=None) -> CopyTerms:
        """h (B, T, D) final-norm states, input_ids (B, T), labels (B, T) global ids or -100;
        under document masking the document index `docs` and `positions` (B, T) of every position
        (cplm_dist.model.documents). Under sequence parallelism h is this rank's (T/tp, B, D)
        positions and the terms come back for all T positions, sequence-first (T, B), as the loss
        takes them. Under context parallelism (`context`, a ContextInputs) input_ids, labels and
        positions are this rank's chunks, docs the whole row's, and the keys are all-gathered
        over cp (cplm_dist.model.parallel.context)."""
        sp, offset = self.sp_group is not None, 0
        rows = h.shape[0] if sp else h.shape[1]
        if sp:
            offset = self.sp_group.rank() * rows
            labels = None if labels is None else labels[:, offset : offset + rows]
            positions = None if positions is None else positions[:, offset : offset + rows]
        q, k = self._arrange(self.q(h), self.k(h), offset, sp, positions)  # (B, H, T or T/tp, d)
        if self.sp_group is not None:  # every key, from every rank: (B, H, T, d)
            k = gather_sequence(k.permute(2, 0, 1, 3), self.sp_group, sum_grad=True).permute(1, 2, 0, 3)
        if context is None:
            a_heads, m_heads = self.log_sum_exps(q, k, self.source_ids(input_ids), labels, offset, docs)  # (B, H, Tq) each
        else:
            a_heads, m_heads = self._context_log_sum_exps(q, k, labels, offset, input_ids.shape[1], context)
        terms = self._terms(a_heads, m_heads, h, q, seq_first=sp)
        return self._gather_terms(terms) if sp else terms

    def _context_log_sum_exps(self, q, k, labels, offset: int, local_length: int, context):
        """Context parallelism: the keys of every cp rank (all-gathered; backward returns each
        key's gradient to its owner), and (A, M) of this rank's query rows offset.. of its
        `local_length`, run by run of consecutive positions, each over the prefix it sees."""
        k = context.shard.gather(k, dim=2)  # (B, H, T, d) in sequence order
        src = self.source_ids(context.ids)
        outs = []
        for a, b, pos in context.shard.runs(offset, offset + q.shape[2], local_length):
            keys = min(k.shape[2], pos + b - a)
            rows = slice(a - offset, b - offset)
            outs.append(self.log_sum_exps(q[:, :, rows], k[:, :, :keys], src[:, :keys],
                                          None if labels is None else labels[:, rows], pos, context.docs))
        a_heads = torch.cat([o[0] for o in outs], dim=2)
        return a_heads, None if labels is None else torch.cat([o[1] for o in outs], dim=2)

    def lse_path(self, q: torch.Tensor, k: torch.Tensor) -> str:
        """Which of dense, chunked, flex computes (A, M) for these queries and keys (copy.impl).
        flex runs for training only: evaluation's changing shapes would recompile its kernel."""
        impl, training = self.cfg.impl, torch.is_grad_enabled() and q.requires_grad
        if impl == "flex" and training and q.device.type != "cuda":
            raise ConfigError(FLEX_NEEDS_CUDA.format(device=q.device.type))
        whole_blocks = q.shape[2] % FLEX_BLOCK == 0 and k.shape[2] % FLEX_BLOCK == 0  # no padded rows for mask_mod to index
        if (impl == "auto" and training and whole_blocks and self._flex_trains_on(q.device)
                and self._flex_has_run_on_a_gpu() and self._flex_unavailable(q.device) is None):
            return "flex"
        if impl == "flex" and training:
            return "flex"
        if impl == "dense" or k.shape[2] <= self.cfg.chunk_size:
            return "dense"  # one block: the same peak memory, no recomputation
        return "chunked"

    @staticmethod
    def _flex_trains_on(device: torch.device) -> bool:
        return device.type == "cuda"  # torch has FlexAttention's backward on CUDA only

    def _flex_has_run_on_a_gpu(self) -> bool:
        """auto takes flex only once a GPU check recorded it for this torch (flex_record.py);
        until then chunked, the path the GPU figures were measured with."""
        if self._flex_record is None:
            self._flex_record = read_record() or {}
        return bool(self._flex_record)

    def _flex_unavailable(self, device: torch.device) -> str | None:
        if self._flex_failed is None:
            self._flex_failed = unavailable_reason(device) or ""
        return self._flex_failed or None

    def log_sum_exps(self, q, k, src, labels, offset: int, docs=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-head (A, M), (B, H, Tq) each, by the path `lse_path` picks. With copy.impl=auto the
        first flex call also runs a backward on copies of q and k, so that a kernel which cannot
        be built, forward or backward, sends the run to the chunked path (warned once) instead of
        stopping it."""
        path = self.last_path = self.lse_path(q, k)
        if path == "flex" and self.cfg.impl == "auto" and not self._flex_probed:
            try:
                self._probe_flex(q, k, src, labels, offset, docs)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure to build the kernel: auto goes on chunked
                first = (str(e).strip().splitlines() or [""])[0]
                self._flex_failed = f"{type(e).__name__}: {first[:200]}"
                log.warning("copy.impl=auto: the FlexAttention kernel failed (%s); the copy head goes on chunked",
                            self._flex_failed)
                path = self.last_path = self.lse_path(q, k)  # flex now unavailable: chunked or dense
        if path == "flex":
            return flex_copy_lse(q, k, src, labels, self.shift, offset, docs=docs)
        if path == "chunked":
            return chunked_copy_lse(q, k, src, labels, self.shift, self.cfg.chunk_size, offset, docs)
        return dense_copy_lse(q, k, src, labels, self.shift, offset, docs)

    def _probe_flex(self, q, k, src, labels, offset: int, docs=None) -> None:
        """One forward and backward of the flex path on detached copies (the kernels are compiled
        for these shapes and reused by the real call)."""
        self._flex_probed = True
        qp, kp = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        outs = [x for x in flex_copy_lse(qp, kp, src, labels, self.shift, offset, docs=docs) if x is not None]
        torch.autograd.grad(sum(x.masked_fill(~torch.isfinite(x), 0).sum() for x in outs), [qp, kp])

    def terms(self, a_heads: torch.Tensor, m_heads: torch.Tensor | None, h: torch.Tensor, q: torch.Tensor,
              seq_first: bool = False) -> CopyTerms:
        """The per-token CopyTerms from the per-head log-sum-exps (pointwise: compiled under train.compile)."""
        copy_match = self._combine(m_heads, a_heads) if m_heads is not None else None
        return CopyTerms(self._copy_all(a_heads), copy_match, self.gate_logit(h, q, seq_first=seq_first))

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
        T = h.shape[1]
        return self.weights_for(q, k, input_ids, h, candidate_mask(query_positions(0, T, h.device), T, self.shift))

    @torch.no_grad()
    def weights_for(self, q: torch.Tensor, k: torch.Tensor, ids: torch.Tensor, h: torch.Tensor, cand: torch.Tensor):
        """The copy distribution of queries q (B, H, Tq, d) over keys k (B, H, Tk, d) whose ids are
        `ids` (B, Tk), among the candidates `cand` ((Tq, Tk) or (B, Tq, Tk):
        cplm_dist.model.copy_lse.candidate_mask); h (B, Tq, D) for the gate."""
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # (B, H, Tq, Tk)
        scores = scores.masked_fill(~per_head(cand), NEG_INF)
        a_heads = masked_logsumexp(scores, None, dim=-1)  # (B, H, Tq)
        copy_all = self._copy_all(a_heads)
        # each head's normaliser: its own A (averaged heads) or the pool's (B, H or 1, Tq)
        norm = a_heads if self.average_heads else copy_all.unsqueeze(1)
        norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
        weights = torch.exp(scores - norm.unsqueeze(-1)).mean(dim=1)  # (B, Tq, Tk)
        return weights, self.source_ids(ids), CopyTerms(copy_all, None, self.gate_logit(h, q))
