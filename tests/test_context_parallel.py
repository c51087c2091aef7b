"""Context parallelism (parallel.cp): cp = 2 and 4 give the per-token nll and the gradients (summed
over cp) of cp = 1, for every mix and paste mode, copy off, both backbones, the chunked copy path
and the chunked loss, with and without document masking, at tp 1 and at tp 2 with sequence
parallelism; the chunk arithmetic; training at cp 2 x dp 2 follows one rank at ZeRO-1 and ZeRO-3;
a stopped and resumed cp run equals the straight one; --reshape from cp 2 to cp 1; bad layouts get
one line."""

import pytest
import torch

from cplm_dist.config import load_config
from cplm_dist.model.context_parallel import ContextShard
from tests.spawn import run_ranks
from tests.test_documents import DOC_VARIANTS, _labels, packed_row
from tests.test_model import VARIANTS, batch

# every mix and paste mode, copy off (padded, untied), the chunked copy path (chunk 5 or 7 of 24),
# gpt2 (learned positions; plain heads), the chunked loss
CP_VARIANTS = {name: VARIANTS[name] for name in (
    "copy-off-padded-untied", "gate-next-2heads-rope", "gate-self", "joint-next", "joint-self-padded-untied",
    "sentinel-next-2heads", "sentinel-self", "gpt2-gate-next", "gpt2-mha-copy-off-untied", "joint-next+chunked-loss")}
CP4_VARIANTS = ("gate-next-2heads-rope", "joint-self-padded-untied", "sentinel-next-2heads", "gpt2-gate-next")
LAYOUTS = {"cp2": (1, 2, False, tuple(CP_VARIANTS)), "cp4": (1, 4, False, CP4_VARIANTS),
           "tp2-cp2-sp": (2, 2, True, ("gate-next-2heads-rope", "joint-next+chunked-loss", "sentinel-self", "gpt2-gate-next"))}


def _next_labels(ids):
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)


def _max_error(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _cp_worker(tp, cp, sp, names):
    """{(variant, documents): (nll error, gradient error, copy share error)} of the cp model against
    the cp = 1 model on the same tp ranks."""
    import torch.distributed as dist

    from cplm_dist.model import build_model
    from cplm_dist.parallel import init_distributed

    dims = init_distributed(tp, cp_size=cp)
    shard = ContextShard(dims.cp_rank, cp, dims.cp_group)
    results = {}
    for name in names:
        overrides = CP_VARIANTS[name] + [f"parallel.tp={tp}"]
        for documents in (False, True):
            ref = build_model(load_config("tiny", overrides))
            model = build_model(load_config("tiny", overrides + [f"parallel.cp={cp}", f"parallel.sequence_parallel={str(sp).lower()}"]))
            if documents:
                ids, positions, _ = packed_row(ref.model_cfg.vocab_size)
                labels = _labels(ids)
            else:
                ids, positions = batch(ref.model_cfg.vocab_size), None
                labels = _next_labels(ids)
            weights = torch.linspace(0.5, 1.5, ids.numel()).view_as(ids)
            out_ref = ref(ids, labels, positions)
            (out_ref.nll * weights).sum().backward()
            out = model(shard.take(ids), shard.take(labels), None if positions is None else shard.take(positions))
            (out.nll * shard.take(weights)).sum().backward()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            for g in grads.values():
                dist.all_reduce(g, group=dims.cp_group)
            ref_grads = {n: p.grad.detach() for n, p in ref.named_parameters()}
            results[(name, documents)] = ((out.nll - shard.take(out_ref.nll)).abs().max().item(),
                                          _max_error(grads, ref_grads),
                                          (out.copy_share - shard.take(out_ref.copy_share)).abs().max().item())
    return results


@pytest.fixture(scope="module")
def cp_runs():
    return {key: run_ranks(_cp_worker, tp * cp, args=(tp, cp, sp, names), timeout=400)
            for key, (tp, cp, sp, names) in LAYOUTS.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_equals_one_rank_in_nll_and_gradients(cp_runs, layout):
    for rank, result in enumerate(cp_runs[layout]):
        for (name, documents), (nll_err, grad_err, share_err) in result.items():
            where = f"{layout} rank {rank} {name} documents={documents}"
            assert nll_err < 1e-5, f"{where}: nll off by {nll_err}"
            assert grad_err < 1e-5, f"{where}: gradients off by {grad_err}"
            assert share_err < 1e-5, f"{where}: copy share off by {share_err}"
    assert len(cp_runs[layout][0]) == 2 * len(LAYOUTS[layout][3])


def test_chunks_balance_the_causal_work_and_gather_back_in_order():
    T, cp = 16, 4
    shards = [ContextShard(r, cp) for r in range(cp)]
    index = torch.cat([s.index(T) for s in shards])
    assert sorted(index.tolist()) == list(range(T))  # every position once
    assert shards[0].index(T).tolist() == [0, 1, 14, 15] and shards[3].index(T).tolist() == [6, 7, 8, 9]
    work = [int((s.index(T) + 1).sum()) for s in shards]  # keys each rank's queries see
    assert len(set(work)) == 1, work
    x = torch.arange(T).view(1, T)
    rank_order = torch.cat([s.take(x) for s in shards], dim=1)[0]
    assert rank_order.index_select(0, shards[0].global_order(T // cp)).tolist() == list(range(T))
    assert shards[1].runs(0, 4, 4) == [(0, 2, 2), (2, 4, 12)] and shards[1].runs(3, 4, 4) == [(3, 4, 13)]
