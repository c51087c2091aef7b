"""Context parallelism (parallel.cp): cp = 2 and 4 give the per-token nll and the gradients (summed
over cp) of cp = 1, for every mix and paste mode, copy off, every backbone, the chunked copy path
and the chunked loss, with and without document masking, at tp 1 and at tp 2 with sequence
parallelism; the chunk arithmetic; training at cp 2 x dp 2 follows one rank at ZeRO-1 and ZeRO-3;
a stopped and resumed cp run equals the straight one; --reshape from cp 2 to cp 1; bad layouts get
one line."""

import json

import pytest
import torch

from cplm_dist.config import load_config
from cplm_dist.model.parallel.context import ContextShard
from tests.spawn import run_ranks
from tests.test_documents import DOC_VARIANTS, _labels, packed_row
from tests.test_model import VARIANTS, batch

# every mix and paste mode, copy off (padded, untied), the chunked copy path (chunk 5 or 7 of 24),
# gpt2 (learned positions; plain heads), qwen3 (qk-norm, heads of model.head_dim), the chunked loss
CP_VARIANTS = {name: VARIANTS[name] for name in (
    "copy-off-padded-untied", "gate-next-2heads-rope", "gate-self", "joint-next", "joint-self-padded-untied",
    "sentinel-next-2heads", "sentinel-self", "gpt2-gate-next", "gpt2-mha-copy-off-untied", "joint-next+chunked-loss",
    "qwen3-gate-next")}
CP4_VARIANTS = ("gate-next-2heads-rope", "joint-self-padded-untied", "sentinel-next-2heads", "gpt2-gate-next")
LAYOUTS = {"cp2": (1, 2, False, tuple(CP_VARIANTS)), "cp4": (1, 4, False, CP4_VARIANTS),
           "tp2-cp2-sp": (2, 2, True, ("gate-next-2heads-rope", "joint-next+chunked-loss", "sentinel-self", "gpt2-gate-next",
                                       "qwen3-gate-next"))}


def _next_labels(ids):
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)


def _max_error(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _cp_worker(tp, cp, sp, names):
    """{(variant, documents): (nll error, gradient error, copy share error, (the cp bytes the
    profiler's counter files under the copy head, its keys' whole bytes gathered and scattered))}
    of the cp model against the cp = 1 model on the same tp ranks."""
    import torch.distributed as dist

    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model
    from cplm_dist.profiling.measure import CommTimer

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
            copy_head, c = model.parts.head.copy_head, model.copy_cfg
            with CommTimer(dims, torch.device("cpu"), regions={"copy": copy_head} if copy_head is not None else {}) as timer:
                out = model(shard.take(ids), shard.take(labels), None if positions is None else shard.take(positions))
                (out.nll * shard.take(weights)).sum().backward()
            copy_keys = 2 * ids.numel() * c.num_heads * c.head_dim * 4 if c.enabled else 0  # (B, H_c, T, d_c) fp32 there and back
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            for g in grads.values():
                dist.all_reduce(g, group=dims.cp_group)
            ref_grads = {n: p.grad.detach() for n, p in ref.named_parameters()}
            results[(name, documents)] = ((out.nll - shard.take(out_ref.nll)).abs().max().item(),
                                          _max_error(grads, ref_grads),
                                          (out.copy_share - shard.take(out_ref.copy_share)).abs().max().item(),
                                          (timer.by_region[("copy", "cp")][1], copy_keys))
    return results


@pytest.fixture(scope="module")
def cp_runs():
    return {key: run_ranks(_cp_worker, tp * cp, args=(tp, cp, sp, names), timeout=400)
            for key, (tp, cp, sp, names) in LAYOUTS.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_equals_one_rank_in_nll_and_gradients(cp_runs, layout):
    for rank, result in enumerate(cp_runs[layout]):
        for (name, documents), (nll_err, grad_err, share_err, (copy_bytes, copy_keys)) in result.items():
            where = f"{layout} rank {rank} {name} documents={documents}"
            assert nll_err < 1e-5, f"{where}: nll off by {nll_err}"
            assert grad_err < 1e-5, f"{where}: gradients off by {grad_err}"
            assert share_err < 1e-5, f"{where}: copy share off by {share_err}"
            assert copy_bytes == copy_keys, f"{where}: the timer's copy-head region has {copy_bytes} cp bytes, not {copy_keys}"
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


# --- training: cp 2 x dp 2 follows one rank; resume; reshape ------------------------------------

CP_STEPS = 10


def _cp_args(small_data, out, *extra):
    """Global batch 4 of 64 tokens: one rank takes micro 4; dp 2 micro 2 each (cp ranks share a sample)."""
    from tests.test_train import argv

    return argv(small_data, out, f"train.train_steps={CP_STEPS}", "train.global_batch_size=4", "optim.clip_grad=1.0",
                "train.save_interval=5", "train.eval_interval=10", *extra)


@pytest.fixture(scope="module")
def cp_training(small_data, tmp_path_factory):
    """{name: out_dir}: one rank, and cp 2 x dp 2 at ZeRO-1 and ZeRO-3."""
    from tests.test_train import train

    root = tmp_path_factory.mktemp("cp_training")
    runs = {"one": (1, ["train.micro_batch_size=4", "train.zero_stage=1"]),
            "cp2-dp2-z1": (4, ["train.micro_batch_size=2", "train.zero_stage=1", "parallel.cp=2"]),
            "cp2-dp2-z3": (4, ["train.micro_batch_size=2", "train.zero_stage=3", "parallel.cp=2"])}
    for name, (world, extra) in runs.items():
        assert train(world, _cp_args(small_data, root / name, *extra)) == [0] * world, name
    return root


def _assert_follows(got_dir, want_dir, tolerance, steps=range(1, CP_STEPS + 1)):
    from tests.test_train import losses

    got, want = losses(got_dir), losses(want_dir)
    assert sorted(got) == list(steps), sorted(got)
    for step in got:
        assert abs(got[step] - want[step]) < tolerance, (step, got[step], want[step])


@pytest.mark.parametrize("run", ["cp2-dp2-z1", "cp2-dp2-z3"])
def test_cp2_dp2_training_follows_one_rank(cp_training, run):
    """Losses, LM-only losses, copy shares (each cp rank's part of a micro-batch's mean, summed over
    cp, averaged over dp) and the validation loss follow one rank."""
    from cplm_dist.training.run_log import read_metrics

    _assert_follows(cp_training / run, cp_training / "one", 1e-4)
    got, want = (read_metrics(cp_training / d / "logs" / "metrics.jsonl") for d in (run, "one"))
    for step in (1, CP_STEPS):
        for key in ("lm_loss", "copy_share"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-5), (step, key)
    valid = [read_metrics(cp_training / d / "logs" / "metrics.jsonl", "valid")[CP_STEPS]["loss"] for d in (run, "one")]
    assert abs(valid[0] - valid[1]) < 1e-4, valid
    manifest = json.loads((cp_training / run / "checkpoints" / "step-00000010" / "complete.json").read_text())
    assert manifest["layout"]["cp"] == 2 and manifest["layout"]["dp"] == 2


def test_a_stopped_and_resumed_cp_run_equals_the_straight_one(small_data, cp_training, tmp_path):
    """cp 2 x dp 2 resumed from the straight run's step 5 (a new out_dir) repeats steps 6-10 exactly."""
    from tests.test_train import losses, train

    source = cp_training / "cp2-dp2-z1" / "checkpoints" / "step-00000005"
    out = tmp_path / "resumed"
    args = _cp_args(small_data, out, "train.micro_batch_size=2", "train.zero_stage=1", "parallel.cp=2")
    assert train(4, args + ["--resume", str(source)]) == [0] * 4
    got, want = losses(out), losses(cp_training / "cp2-dp2-z1")
    assert sorted(got) == list(range(6, CP_STEPS + 1))
    for step in got:
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])


def test_reshape_from_cp2_to_cp1_follows_one_rank(small_data, cp_training, tmp_path):
    from tests.test_train import losses, train

    source = cp_training / "cp2-dp2-z1" / "checkpoints" / "step-00000005"
    out = tmp_path / "cp1"
    args = _cp_args(small_data, out, "train.micro_batch_size=2", "train.zero_stage=1")
    assert train(2, args + ["--resume", str(source), "--reshape"]) == [0, 0]
    got, want = losses(out), losses(cp_training / "one")
    assert sorted(got) == list(range(6, CP_STEPS + 1))
    for step in got:
        assert abs(got[step] - want[step]) < 1e-4, (step, got[step], want[step])


def test_bad_cp_layouts_get_one_line(small_data, cp_training, tmp_path):
    from cplm_dist.checkpoint.manifest import check_layout, read_manifest
    from cplm_dist.distributed import check_world
    from cplm_dist.errors import CheckpointError, ConfigError
    from tests.test_train import argv, run_cli

    refusals = {
        ("parallel.cp=4", "data.seq_length=20"): "data.seq_length=20 is not divisible by 2 x cp = 8, which parallel.cp=4 needs "
                                                 "(each cp rank holds 2 of 2 x cp equal chunks): use data.seq_length=16 or 24, or another cp",
        ("parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_length=20"):
            "data.seq_length=20 is not divisible by 2 x cp x tp = 8 (sequence parallelism splits each chunk over tp), which "
            "parallel.cp=2 needs (each cp rank holds 2 of 2 x cp equal chunks): use data.seq_length=16 or 24, or another cp",
        ("parallel.cp=0",): "parallel.cp=0 must be a positive integer",
    }
    for overrides, message in refusals.items():
        with pytest.raises(ConfigError) as e:
            load_config("tiny", list(overrides))
        assert str(e.value) == message
    with pytest.raises(ConfigError, match=r"parallel.tp=1 x parallel.cp=4 x parallel.pp=1 = 4 does not divide WORLD_SIZE=6"):
        check_world(1, 6, 1, 4)
    with pytest.raises(ConfigError, match=r"parallel.tp=1 x parallel.cp=2 x parallel.pp=2 = 4 does not divide WORLD_SIZE=6"):
        check_world(1, 6, 2, 2)  # cp x pp composes; a grid that does not divide the world is still one line
    load_config("tiny", ["parallel.cp=2", "parallel.pp=2"])  # no longer refused
    cfg = load_config("tiny", ["train.zero_stage=1"])
    with pytest.raises(CheckpointError, match=r"saved with another layout \(cp 2 -> 1, dp 2 -> 2|cp 2 -> 1"):
        check_layout(read_manifest(cp_training / "cp2-dp2-z1" / "checkpoints" / "step-00000005"), cfg, 1, 2)
    fresh = tmp_path / "fresh"
    proc = run_cli(argv(small_data, fresh, "parallel.cp=2"), {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                                                             "MASTER_PORT": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: parallel.tp=1 x parallel.cp=2 x parallel.pp=1 = 2 does not divide WORLD_SIZE=3 (dp = world / (tp x cp x pp) "
        "must be whole; tp x cp x pp must be one of [1, 3])")
    assert not fresh.exists()


def test_per_source_figures_at_cp2_dp2_equal_the_step_re_scored(small_data, cp_training):
    """Per source, reduced over dp x cp (each cp rank's chunk tokens, the rows' sources whole):
    step 1's figures equal one process re-scoring each source's samples of that step."""
    from tests.source_reference import assert_first_step_sources_rescored

    args = _cp_args(small_data, cp_training / "cp2-dp2-z1", "train.micro_batch_size=2", "train.zero_stage=1", "parallel.cp=2")
    assert_first_step_sources_rescored(cp_training / "cp2-dp2-z1", args, tolerance=1e-5)
