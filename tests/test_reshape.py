"""Reshape on resume (cplm_dist.checkpoint.reshape): one run saved at tp=2 x dp=2 ZeRO-1 continues at other
tp, dp and ZeRO stages and follows the uninterrupted run; the AdamW moments after a reshape equal
the saved ones; an impossible reshape is one line."""

import pytest
import torch

from tests.spawn import run_ranks
from tests.test_train import argv, losses, run_cli, train

STEPS = 8
COMMON = (f"train.train_steps={STEPS}", "train.global_batch_size=4", "optim.clip_grad=1.0", "train.keep_last=3")


def layout(tp, dp, zero):
    return [f"parallel.tp={tp}", f"train.zero_stage={zero}", f"train.micro_batch_size={4 // dp}"]


@pytest.fixture(scope="module")
def straight(small_data, tmp_path_factory):
    """The uninterrupted tp=2 x dp=2 ZeRO-1 run; its checkpoint at step 3 is the one reshaped."""
    out = tmp_path_factory.mktemp("reshape") / "straight"
    assert train(4, argv(small_data, out, *COMMON, *layout(2, 2, 1), "train.save_interval=3")) == [0] * 4
    return out, losses(out)


def follows(straight_losses, out, steps):
    got = losses(out)
    for step in steps:
        assert abs(got[step] - straight_losses[step]) < 1e-4, (step, got[step], straight_losses[step])


def resume(small_data, out, source, tp, dp, zero, *extra):
    args = argv(small_data, out, *COMMON, *layout(tp, dp, zero), *extra)
    assert train(tp * dp, args + ["--resume", str(source), "--reshape"]) == [0] * tp * dp


def test_tp2_dp2_zero1_continues_at_tp4_zero2(small_data, tmp_path, straight):
    src, want = straight
    resume(small_data, tmp_path / "tp4", src / "checkpoints" / "step-00000003", 4, 1, 2)
    follows(want, tmp_path / "tp4", range(4, STEPS + 1))


@pytest.mark.parametrize("middle,last", [((1, 1, 0), (2, 1, 1)), ((1, 2, 3), (1, 1, 3))],
                         ids=["zero0-and-back", "zero3-dp2-to-dp1"])
def test_a_chain_of_reshapes_follows_the_straight_run(small_data, tmp_path, straight, middle, last):
    """tp=2 x dp=2 ZeRO-1 at step 3 -> `middle` for steps 4-6 -> `last` for steps 7-8: ZeRO-0's
    own files are read and written on the way, and ZeRO-3 changes dp."""
    src, want = straight
    resume(small_data, tmp_path / "middle", src / "checkpoints" / "step-00000003", *middle, "train.exit_at_step=6")
    follows(want, tmp_path / "middle", range(4, 7))
    resume(small_data, tmp_path / "last", tmp_path / "middle", *last)
    follows(want, tmp_path / "last", range(7, STEPS + 1))


def test_adamw_state_after_a_reshape_equals_the_saved_one(straight, tmp_path):
    """Weights, moments and step of the tp=2 x dp=2 ZeRO-1 checkpoint, gathered after loading it
    as saved and after reshaping it to tp=4 ZeRO-2, tp=1 ZeRO-0 and tp=1 x dp=2 ZeRO-3."""
    source = straight[0] / "checkpoints" / "step-00000003"
    saved, saved_groups = run_ranks(_optimizer_state, 4, args=(source, tmp_path / "saved", 2, 2, 1))[0]
    assert all(v[3] == 3.0 for v in saved.values())
    assert [g[:2] for g in saved_groups] == [("decay", 0.1), ("no_decay", 0.0)]
    for tp, dp, zero in [(4, 1, 2), (1, 1, 0), (1, 2, 3)]:
        got, groups = run_ranks(_optimizer_state, tp * dp, args=(source, tmp_path / f"{tp}{dp}{zero}", tp, dp, zero))[0]
        assert groups == saved_groups, (tp, dp, zero)  # per-group weight decay and the schedule's lr
        assert sorted(got) == sorted(saved)
        for name, want in saved.items():
            for what, a, b in zip(("weight", "exp_avg", "exp_avg_sq", "step"), got[name], want):
                assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), (tp, dp, zero, name, what)
        assert not any(p.name.startswith(".reshape") for p in (tmp_path / f"{tp}{dp}{zero}").iterdir())


def test_a_layout_change_needs_reshape_one_line(small_data, straight, tmp_path):
    out = tmp_path / "new"
    source = straight[0] / "checkpoints" / "step-00000003"
    proc = run_cli(argv(small_data, out, *COMMON, *layout(1, 1, 0)) + ["--resume", str(source)])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {source} was saved with another layout (tp 2 -> 1, zero_stage 1 -> 0, dp 2 -> 1): resume "
        "with the layout it was saved with, or add --reshape to convert it to this one")
    assert not out.exists()


def _optimizer_state(source, out_dir, tp, dp, zero):
    """{name: (fp32 weight, exp_avg, exp_avg_sq, step)} of every parameter, full (tp shards
    joined, ZeRO partitions gathered), after loading `source` at tp x dp ZeRO-`zero`."""
    import deepspeed

    from cplm_dist.checkpoint import Checkpointer, read_checkpoint
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model
    from cplm_dist.model.parallel.sharding import gather_full, spec_of
    from cplm_dist.training.engine import build_engine

    cfg, manifest = read_checkpoint(source)
    cfg.parallel.tp, cfg.train.zero_stage, cfg.train.out_dir = tp, zero, str(out_dir)
    cfg.train.micro_batch_size = cfg.train.global_batch_size // dp
    dims = init_distributed(tp)
    checkpointer = Checkpointer(out_dir, cfg, dims)
    engine, optimizer, _ = build_engine(build_model(cfg), cfg, dims, load_universal=checkpointer.loads_universal(manifest))
    checkpointer.load(engine, manifest, reshape=True)
    if zero in (1, 2):  # ZeRO-1/2 link the moments to the parameters at their first step
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    state = {}
    for name, p in engine.module.named_parameters():
        if zero == 0:
            s = optimizer.state[p]
            parts, step = (p, s["exp_avg"], s["exp_avg_sq"]), float(s["step"])
        else:
            parts = (deepspeed.utils.safe_get_full_fp32_param(p),
                     *(deepspeed.utils.safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")))
            step = float(next(iter(engine.optimizer.optimizer.state.values()))["step"])
        full = [gather_full(t.reshape(p.ds_shape if zero == 3 else p.shape), spec_of(p), dims.tp_group) for t in parts]
        state[name] = (*full, step)
    groups = [(g["name"], g["weight_decay"], g["lr"]) for g in engine.optimizer.param_groups]
    return state, groups
