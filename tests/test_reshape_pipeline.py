"""Reshape across pipeline stages (cplm_dist.checkpoint.reshape): one run saved at pp 2 x tp 2 ZeRO-1
continues at pp 1 x tp 1, and from there back into pipeline stages (1F1B at ZeRO-0, then DualPipeV at
ZeRO-1), every step's loss the uninterrupted run's; a saved run's AdamW state reads the same at
another pp. The cp x pp -> plain dp reshape is tests/test_context_pipeline.py's (it shares that run)."""

import pytest
import torch

from tests.spawn import run_ranks
from tests.test_train import argv, losses, train

STEPS = 8
# four layers: room for DualPipeV's two stages a rank at pp 2; micro-batch 1, so a pipeline runs
# four micro-batches a step (and DualPipeV, which needs 2 pp of them, can run)
COMMON = ("model.num_layers=4", f"train.train_steps={STEPS}", "train.global_batch_size=4", "optim.clip_grad=1.0",
          "train.micro_batch_size=1", "train.eval_batches=4", "train.keep_last=3")


def layout(tp, pp, zero, schedule="1f1b"):
    return [f"parallel.tp={tp}", f"parallel.pp={pp}", f"train.zero_stage={zero}", f"parallel.pp_schedule={schedule}"]


@pytest.fixture(scope="module")
def straight(small_data, tmp_path_factory):
    """The uninterrupted pp 2 x tp 2 ZeRO-1 run; its checkpoint at step 3 is the one reshaped."""
    out = tmp_path_factory.mktemp("reshape_pp") / "straight"
    assert train(4, argv(small_data, out, *COMMON, *layout(2, 2, 1), "train.save_interval=3")) == [0] * 4
    return out, losses(out)


def follows(want, out, steps):
    got = losses(out)
    assert sorted(got) == list(steps), sorted(got)
    for step in steps:
        assert abs(got[step] - want[step]) < 1e-5, (step, got[step], want[step])


def test_pp2_tp2_continues_at_pp1_and_back_into_both_schedules(small_data, tmp_path, straight):
    """pp 2 x tp 2 ZeRO-1 at step 3 -> pp 1 x tp 1 ZeRO-0 (step 4) -> pp 2 1F1B ZeRO-0 (step 5) ->
    pp 2 DualPipeV ZeRO-1 (steps 6-8): DeepSpeed's converter reads the pipeline's flat ZeRO-1
    partitions under their layer-index names, ours a ZeRO-0 pipeline's layer files and per-stage
    AdamW states; each continues exactly where the straight run went."""
    src, want = straight
    hops = [((1, 1, 0), 4), ((1, 2, 0), 5), ((1, 2, 1, "dualpipev"), STEPS)]
    source = src / "checkpoints" / "step-00000003"
    for i, (shape, last) in enumerate(hops):
        out = tmp_path / f"hop{i}"
        world = shape[0] * shape[1]
        args = argv(small_data, out, *COMMON, *layout(*shape), f"train.exit_at_step={last}")
        assert train(world, args + ["--resume", str(source), "--reshape"]) == [0] * world, shape
        first = 4 if i == 0 else hops[i - 1][1] + 1
        follows(want, out, range(first, last + 1))
        assert not any(p.name.startswith(".reshape") for p in out.iterdir())
        source = out


def test_a_pipeline_checkpoint_reads_the_same_adamw_state_at_pp1(straight, tmp_path):
    """Weights, moments and step of the pp 2 x tp 2 ZeRO-1 checkpoint, reshaped to pp 1 x tp 1
    at ZeRO-1 and at ZeRO-0, equal one another and the saved stages' own (read at their layout)."""
    source = straight[0] / "checkpoints" / "step-00000003"
    saved = {}
    for part in run_ranks(_optimizer_state, 4, args=(source, tmp_path / "saved", 2, 2, 1)):
        saved.update(part)
    assert all(v[3] == 3.0 for v in saved.values()) and "embedding.weight" in saved
    for zero in (1, 0):
        got = run_ranks(_optimizer_state, 1, args=(source, tmp_path / f"pp1-{zero}", 1, 1, zero))[0]
        assert sorted(got) == sorted(saved)
        for name, want in saved.items():
            for what, a, b in zip(("weight", "exp_avg", "exp_avg_sq", "step"), got[name], want):
                assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), (zero, name, what)


def _optimizer_state(source, out_dir, tp, pp, zero):
    """{CPLM name: (fp32 weight, exp_avg, exp_avg_sq, step)} of the parameters this rank holds,
    full over tp, after loading `source` at tp x pp ZeRO-`zero` (dp 1)."""
    import deepspeed

    from cplm_dist.checkpoint import Checkpointer, read_checkpoint
    from cplm_dist.checkpoint.parameter_record import canonical_names
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model
    from cplm_dist.training.pipeline import build_pipeline_model
    from cplm_dist.model.parallel.sharding import gather_full, spec_of
    from cplm_dist.training.engine import build_engine

    cfg, manifest = read_checkpoint(source)
    cfg.parallel.tp, cfg.parallel.pp, cfg.train.zero_stage, cfg.train.out_dir = tp, pp, zero, str(out_dir)
    dims = init_distributed(tp, pp_size=pp)
    checkpointer = Checkpointer(out_dir, cfg, dims)
    model = build_pipeline_model(cfg, dims) if pp > 1 else build_model(cfg)
    engine, optimizer, _ = build_engine(model, cfg, dims, load_universal=checkpointer.loads_universal(manifest))
    checkpointer.load(engine, manifest, reshape=manifest.layout.pp != pp or manifest.layout.tp != tp)
    if zero == 1:  # ZeRO-1 links the moments to the parameters at its first step
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    names, state = canonical_names(engine.module), {}
    for name, p in engine.module.named_parameters():
        if zero == 0:
            s = optimizer.state[p]
            parts, step = (p, s["exp_avg"], s["exp_avg_sq"]), float(s["step"])
        else:
            parts = (deepspeed.utils.safe_get_full_fp32_param(p),
                     *(deepspeed.utils.safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")))
            step = float(next(iter(engine.optimizer.optimizer.state.values()))["step"])
        state[names[name]] = (*(gather_full(t.reshape(p.shape), spec_of(p), dims.tp_group) for t in parts), step)
    return state
