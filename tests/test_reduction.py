"""The one reduction of a batch's figures (cplm_dist.training.reduction) on 8 gloo ranks,
dp 2 x cp 2 x pp 2 (the layout the pipeline x context-parallel work will train with), against the
same figures computed densely in one process: the mean of the micro-batches' per-token means
(loss, LM-only loss, copy share), and the per-token mean and count over the whole batch, on
every stage. The training paths that use it are followed against one rank in test_train.py
(dp, pp) and test_context_parallel.py (cp x dp)."""

import pytest
import torch

from tests.spawn import run_ranks

DP, CP, PP, MICRO_BATCHES, B, T = 2, 2, 2, 3, 2, 8


def _terms(replica: int, micro: int) -> tuple[torch.Tensor, ...]:
    """One micro-batch of whole sequences (B, T): nll, LM-only nll, copy share (0 where ignored), labels."""
    g = torch.Generator().manual_seed(100 * replica + micro)
    labels = torch.randint(0, 50, (B, T), generator=g)
    labels[torch.rand(B, T, generator=g) < 0.3] = -100  # uneven over the cp chunks
    kept = labels != -100
    nll, lm, share = (torch.rand(B, T, generator=g) * kept for _ in range(3))
    return nll * 4, lm * 5, share, labels


def _reduce_worker():
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model.parallel.context import ContextShard
    from cplm_dist.training.reduction import BatchSums, ReduceGroups

    dims = init_distributed(1, pp_size=PP, cp_size=CP)
    shard = ContextShard(dims.cp_rank, CP, dims.cp_group)
    groups = ReduceGroups.of(dims)
    train, valid = BatchSums(), BatchSums()
    if dims.is_last_stage:  # the loss function runs on the last stage only
        for micro in range(MICRO_BATCHES):
            nll, lm, share, labels = (shard.take(t) for t in _terms(dims.dp_rank, micro))
            train.add(nll, lm, share, labels, groups.sequence_tokens(labels))
            valid.add_tokens(nll, labels)
    return groups.reduce(train), groups.reduce(valid)


def test_the_reduction_over_dp_cp_and_pp_equals_one_process():
    ranks = run_ranks(_reduce_worker, DP * CP * PP, timeout=240)
    batch = [_terms(d, m) for d in range(DP) for m in range(MICRO_BATCHES)]
    means = torch.tensor([[t.sum() / (labels != -100).sum() for t in (nll, lm, share)] for nll, lm, share, labels in batch],
                         dtype=torch.float64).mean(0)
    tokens = sum(int((labels != -100).sum()) for *_, labels in batch)
    nll_sum = sum(float(nll.double().sum()) for nll, *_ in batch)
    for rank, (train, valid) in enumerate(ranks):
        assert [train.loss, train.lm_loss, train.copy_share] == pytest.approx(means.tolist(), rel=1e-6), rank
        assert train.tokens == valid.tokens == tokens, rank
        assert train.token_loss == pytest.approx(nll_sum / tokens, rel=1e-6) and valid.token_loss == train.token_loss, rank
