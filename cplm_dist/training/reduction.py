"""The one reduction of a batch's figures over the ranks that share the batch: its loss, the LM
head's own loss, the copy share and the token count. The train step (pp = 1 and the pipeline),
the pipeline's last stage, validation and evaluation all add their micro-batches to `BatchSums`
and reduce them with `ReduceGroups.reduce`; only the groups differ.

    groups = ReduceGroups.of(dims)                  # dp x cp, cp and pp of this rank (ReduceGroups(): one rank alone)
    sums = BatchSums(device)
    tokens = groups.sequence_tokens(labels)         # the micro-batch's trained tokens, over its whole sequences
    loss = sums.add(out.nll, out.lm_nll, out.copy_share, labels, tokens)   # this rank's part of its mean: backward runs on it
    sums.add_tokens(out.nll, labels)                # evaluation: the summed nll and tokens only
    figures = groups.reduce(sums)                   # the same BatchFigures on every rank

Per source (the blend entry a row came from: the batch's "source", cplm_dist.data.loader), with
`BatchSums(device, sources=S)` and `source=` on add / add_tokens, each row's summed nll, LM-only
nll, copy share and trained tokens go to its source's four sums, in the same all-reduce;
`figures.per_source(names)` gives each source's token-weighted loss, lm_loss, copy_share and
tokens. Their token-weighted mean is `token_loss`, which is `loss` where the micro-batches carry
equal tokens.

A batch is `n` micro-batches on each of dp replicas. Under context parallelism the cp ranks of a
replica hold parts of the same sequences (cplm_dist.model.parallel.context), so a micro-batch's
token count is summed over cp and each cp rank's loss is its own tokens' share of the sequences'
mean: the parts add up over cp, and DeepSpeed sums their gradients over cp (cplm_dist.training.engine).
Over dp the micro-batches are different ones, and their means are averaged. Two figures follow:

    loss, lm_loss, copy_share   sum over dp x cp of the micro-batches' parts / (n x dp): the mean of the
                                micro-batches' per-token means, the loss the gradient follows
    token_loss, tokens          summed nll / summed tokens over dp x cp: validation's per-token mean

At pp > 1 the loss stage holds the sums (its loss function adds them; the last pipeline rank under
1F1B, rank 0 under DualPipeV): it reduces them over its
dp x cp group and broadcasts the figures to the other stages over pp. One all-reduce of 6 + 4 x sources
float64 numbers a batch, whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cplm_dist.data.loader import IGNORE_INDEX

PARTS, MICRO_BATCHES, NLL, TOKENS = slice(0, 3), 3, 4, 5  # BatchSums.values
SOURCES = 6  # then per source: nll, LM-only nll, copy share, trained tokens (4 x sources)


@dataclass(frozen=True)
class BatchFigures:
    loss: float  # mean over micro-batches and dp of each micro-batch's per-token loss (what is trained)
    lm_loss: float  # the LM head alone on the same tokens
    copy_share: float  # mean share of the next-token mass the copy side holds
    token_loss: float  # summed nll over summed trained tokens (validation, evaluation)
    tokens: int  # trained tokens over dp x cp
    source_sums: tuple[float, ...] = ()  # per source: summed nll, LM-only nll, copy share, trained tokens

    def per_source(self, names: list[str]) -> dict[str, dict]:
        """{name: {loss, lm_loss, copy_share, tokens}} of the sources with tokens in this batch."""
        return source_figures(self.source_sums, names)


def source_figures(sums, names: list[str]) -> dict[str, dict]:
    """Per-source token means from summed (nll, LM-only nll, copy share, tokens) x sources."""
    out = {}
    for i, name in enumerate(names):
        nll, lm, share, tokens = sums[4 * i: 4 * i + 4] if 4 * i + 4 <= len(sums) else (0.0, 0.0, 0.0, 0.0)
        if tokens > 0:
            out[name] = {"loss": nll / tokens, "lm_loss": lm / tokens, "copy_share": share / tokens, "tokens": int(tokens)}
    return out


def injected(nll: torch.Tensor, nonfinite: bool, scale: float) -> torch.Tensor:
    """The per-token loss under fault injection (train.inject_nonfinite_at: NaN; train.inject_spike_at:
    times `scale`), its gradients with it; unchanged otherwise. The one place both the step and a
    pipeline's last stage inject."""
    if nonfinite:
        return nll * float("nan")
    return nll if scale == 1 else nll * scale


class BatchSums:
    """A rank's running sums of a batch's micro-batches, float64: the parts of the micro-batches'
    means (loss, LM-only loss, copy share), the micro-batches, the summed nll and the trained tokens."""

    def __init__(self, device=None, sources: int = 0):
        self.sources = sources
        self.values = torch.zeros(SOURCES + 4 * sources, dtype=torch.float64, device=device)

    def zero_(self) -> BatchSums:
        self.values.zero_()
        return self

    def add(self, nll: torch.Tensor, lm_nll: torch.Tensor, share: torch.Tensor, labels: torch.Tensor,
            tokens: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        """Add a micro-batch of per-token terms (nll, LM-only nll, copy share; 0 where labels are
        ignored) whose whole sequences hold `tokens` trained tokens (`ReduceGroups.sequence_tokens`);
        return its loss, this rank's part of the micro-batch's mean (the tensor backward runs on).
        `source` (B,): each row's source id, for the per-source sums."""
        loss = nll.sum() / tokens
        parts = torch.stack([loss.detach().double(), (lm_nll.sum() / tokens).double(), (share.sum() / tokens).double()])
        self.values[PARTS] += parts.detach()
        self.values[MICRO_BATCHES] += 1
        self.add_tokens(nll.detach(), labels, source, lm_nll.detach(), share.detach())
        return loss

    def add_tokens(self, nll: torch.Tensor, labels: torch.Tensor, source: torch.Tensor | None = None,
                   lm_nll: torch.Tensor | None = None, share: torch.Tensor | None = None) -> None:
        """Add a micro-batch's summed nll and trained-token count (the token mean's terms alone),
        and with `source` its rows' sums to their sources' (LM-only nll and share where given)."""
        kept = (labels != IGNORE_INDEX).to(self.values.device).double()
        self.values[NLL] += nll.double().sum()
        self.values[TOKENS] += kept.sum()
        if source is None or self.sources == 0:
            return
        zero = torch.zeros_like(kept)
        rows = torch.stack([t.double().flatten(1).sum(1) for t in
                            (nll, zero if lm_nll is None else lm_nll, zero if share is None else share, kept)])
        per_source = self.values[SOURCES:].view(self.sources, 4)
        per_source.index_add_(0, source.to(self.values.device).long(), rows.t().to(self.values.device))


@dataclass(frozen=True)
class ReduceGroups:
    """The ranks a batch is spread over (None: none): `dp_cp` where the sums are added (dp x cp;
    dp alone at cp = 1), `cp` the ranks that share a sequence, and at pp > 1 the `pp` group the
    last stage (global rank `pp_source`) sends the figures over; `holds_sums`: this rank is on
    the stage whose loss function adds them (the last)."""

    dp_cp: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    pp_source: int = 0
    holds_sums: bool = True

    @classmethod
    def of(cls, dims, loss_stage: int | None = None) -> ReduceGroups:
        """This rank's groups from its ParallelDims (cplm_dist.distributed); at pp > 1 the sums are
        on pipeline rank `loss_stage` (default the last; DualPipeV's is rank 0: `loss_stage_of`)."""
        if dims.pp_size == 1:
            return cls(dims.grad_group, dims.cp_group)
        stage = dims.pp_size - 1 if loss_stage is None else loss_stage
        return cls(dims.grad_group, dims.cp_group, dims.pp_group, dist.get_global_rank(dims.pp_group, stage),
                   dims.pp_rank == stage)

    @property
    def cp_size(self) -> int:
        return 1 if self.cp is None else dist.get_world_size(self.cp)

    def sequence_tokens(self, labels: torch.Tensor) -> torch.Tensor:
        """The micro-batch's trained tokens (labels != -100) over its whole sequences: this rank's,
        summed over the cp ranks that hold the other parts of them."""
        tokens = (labels != IGNORE_INDEX).sum()
        if self.cp_size > 1:
            dist.all_reduce(tokens, group=self.cp)
        return tokens

    def reduce(self, sums: BatchSums) -> BatchFigures:
        """The batch's figures from every rank's sums (the module docstring), the same on every rank."""
        values = sums.values.clone()
        if self.holds_sums and self.dp_cp is not None:
            dist.all_reduce(values, group=self.dp_cp)
        if self.pp is not None:
            dist.broadcast(values, src=self.pp_source, group=self.pp)
        means = values[PARTS] / (values[MICRO_BATCHES] / self.cp_size)  # n x dp micro-batches, each counted cp times
        loss, lm_loss, share = means.tolist()
        return BatchFigures(loss, lm_loss, share, float(values[NLL] / values[TOKENS]), int(values[TOKENS]),
                            tuple(values[SOURCES:].tolist()))
