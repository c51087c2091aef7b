"""parallel.pp_schedule=dualpipev: DeepSpeed's DualPipeV (two stages a pipeline rank, micro-batches
out through stages 0 .. pp-1 and back through pp .. 2pp-1, the loss on rank 0) runs our stages as
1F1B does. One step's loss and every parameter's gradient equal one process's; a 6-step pp 2 run
(4 layers, 4 micro-batches a step, ZeRO-1, tied embeddings, the gate mix) follows 1F1B's, resumes
exactly, and its checkpoint (the same layer files) evaluates as a whole model; a checkpoint does
not change schedule on resume without --reshape; a layout DualPipeV cannot run is one line."""

import json

import pytest
import torch

from cplm_dist.config import ConfigError, load_config
from tests.spawn import run_ranks

LAYERS = ["model.num_layers=4"]  # two stages a rank at pp 2: a transformer layer each


def _dualpipev_gradient_worker(extra):
    """(engine class, loss error, largest gradient error, parameters compared) of one DualPipeV
    train step at pp 2 (x tp or cp from `extra`'s world) against one process."""
    import torch.distributed as dist

    from cplm_dist.distributed import init_distributed
    from cplm_dist.model.parallel.context import context_of
    from cplm_dist.training.step import build_train_step
    from tests.test_context_pipeline import _micro_batches, _reference
    from tests.test_model import batch

    tp, cp = extra
    dims = init_distributed(tp, pp_size=2, cp_size=cp)
    alone = [dist.new_group([r]) for r in range(dims.world_size)][dims.rank]
    common = ["train.precision=fp32", "train.zero_stage=0", "train.global_batch_size=4", "train.micro_batch_size=1",
              "optim.clip_grad=0", "copy.mix=joint", *LAYERS]
    one = load_config("tiny", common)
    ids = torch.cat([batch(one.model.vocab_size), batch(one.model.vocab_size).flip(1)])  # 4 rows: 4 micro-batches
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    want_loss, want = _reference(one, _micro_batches(ids, labels, None), alone)
    ours = common + ["parallel.pp=2", "parallel.pp_schedule=dualpipev", f"parallel.tp={tp}", f"parallel.cp={cp}"]
    step = build_train_step(load_config("tiny", ours), dims, torch.device("cpu"))
    seen, clip = {}, step.optimizer.before_step

    def capture():
        seen.update({n: p.grad.detach().clone() for n, p in step.engine.module.canonical_named_parameters()})
        clip()

    step.optimizer.before_step = capture
    shard = context_of(dims)
    result = step(iter(_micro_batches(ids, labels, None, shard)))
    errors = [(grad - want[name]).abs().max().item() for name, grad in seen.items()]
    return type(step.engine).__name__, abs(result.loss - want_loss), max(errors), len(errors), dims.pp_rank


@pytest.mark.parametrize("tp,cp", [(1, 1), (1, 2)], ids=["pp2", "cp2-pp2"])
def test_dualpipev_gives_one_process_loss_and_gradients(tp, cp):
    results = run_ranks(_dualpipev_gradient_worker, tp * cp * 2, args=((tp, cp),), timeout=300)
    for engine, loss_err, grad_err, compared, stage in results:
        assert engine == "DualPipeVEngine" and compared > 0
        assert loss_err < 1e-5 and grad_err < 1e-5, (stage, loss_err, grad_err)
    # rank 0 holds stages 0 and 3 (the embedding and the head with their layers), rank 1 stages 1 and 2
    assert {stage: compared for _, _, _, compared, stage in results}[0] > {s: c for _, _, _, c, s in results}[1]


# --- training: DualPipeV follows 1F1B; resume; its checkpoint -----------------------------------

STEPS = 6


def _args(small_data, out, schedule, *extra):
    """pp 2, 4 layers, global batch 4 of micro 1: four micro-batches a step (DualPipeV's least at pp 2);
    validation runs eight (another count than training's: DualPipeV's buffers must follow it)."""
    from tests.test_train import argv

    return argv(small_data, out, f"train.train_steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=1",
                "optim.clip_grad=1.0", "copy.mix=gate", "train.save_interval=3", f"train.eval_interval={STEPS}",
                "train.eval_batches=8", "train.zero_stage=1", "parallel.pp=2", f"parallel.pp_schedule={schedule}",
                *LAYERS, *extra)


@pytest.fixture(scope="module")
def schedules(small_data, tmp_path_factory):
    from tests.test_train import train

    root = tmp_path_factory.mktemp("schedules")
    for schedule in ("1f1b", "dualpipev"):
        assert train(2, _args(small_data, root / schedule, schedule)) == [0, 0], schedule
    return root


def test_dualpipev_training_follows_1f1b(schedules):
    """Losses, LM-only losses, copy shares, gradient norms and the validation loss, step by step."""
    from cplm_dist.training.run_log import read_metrics

    got, want = (read_metrics(schedules / s / "logs" / "metrics.jsonl") for s in ("dualpipev", "1f1b"))
    assert sorted(got) == list(range(1, STEPS + 1)) and got[1]["loss"] != got[STEPS]["loss"]
    for step in got:
        for key in ("loss", "lm_loss", "copy_share", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5, abs=1e-6), (step, key)
    valid = [read_metrics(schedules / s / "logs" / "metrics.jsonl", "valid")[STEPS]["loss"] for s in ("dualpipev", "1f1b")]
    assert valid[0] == pytest.approx(valid[1], abs=1e-6)
    manifest = json.loads((schedules / "dualpipev" / "checkpoints" / f"step-{STEPS:08d}" / "complete.json").read_text())
    assert manifest["layout"]["pp_schedule"] == "dualpipev" and manifest["layout"]["pp"] == 2
    plain = json.loads((schedules / "1f1b" / "checkpoints" / f"step-{STEPS:08d}" / "complete.json").read_text())
    assert "pp_schedule" not in plain["layout"]  # a 1F1B manifest reads as it did before the field


def test_a_resumed_dualpipev_run_equals_the_straight_one(small_data, schedules, tmp_path):
    from tests.test_train import losses, train

    out = tmp_path / "resumed"
    source = schedules / "dualpipev" / "checkpoints" / "step-00000003"
    assert train(2, _args(small_data, out, "dualpipev") + ["--resume", str(source)]) == [0, 0]
    got, want = losses(out), losses(schedules / "dualpipev")
    assert sorted(got) == list(range(4, STEPS + 1))
    for step in got:
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])


def test_a_dualpipev_checkpoint_has_1f1b_layer_files_and_evaluates_as_a_whole_model(small_data, schedules):
    import os

    from cplm_dist.training.run_log import read_metrics
    from tests.test_train import _valid_loss_of_checkpoint

    step = {s: schedules / s / "checkpoints" / f"step-{STEPS:08d}" for s in ("dualpipev", "1f1b")}
    layers = {s: sorted(f for f in os.listdir(d) if f.startswith("layer_")) for s, d in step.items()}
    assert layers["dualpipev"] == layers["1f1b"] and layers["dualpipev"]
    run = schedules / "dualpipev"
    _, loss, evaluated = run_ranks(_valid_loss_of_checkpoint, 1, args=(step["dualpipev"], _args(small_data, run, "dualpipev")))[0]
    logged = read_metrics(run / "logs" / "metrics.jsonl", "valid")[STEPS]["loss"]
    assert loss == pytest.approx(logged, abs=1e-5) and evaluated["loss"] == loss


def test_the_schedule_is_part_of_a_checkpoints_layout(schedules):
    """Resuming a 1F1B checkpoint under DualPipeV (each rank's optimizer files hold other stages)
    is one line naming the change, and the other way; the same schedule resumes."""
    from cplm_dist.checkpoint.manifest import CheckpointError, check_layout, read_manifest

    for saved, asked in (("1f1b", "dualpipev"), ("dualpipev", "1f1b")):
        manifest = read_manifest(schedules / saved / "checkpoints" / "step-00000003")
        cfg = load_config("tiny", ["parallel.pp=2", f"parallel.pp_schedule={asked}", "train.zero_stage=1", *LAYERS])
        with pytest.raises(CheckpointError, match=rf"saved with another layout \(pp_schedule {saved} -> {asked}\): "
                                                  r"resume with the layout it was saved with, or add --reshape"):
            check_layout(manifest, cfg, 1, 1)
        cfg.parallel.pp_schedule = saved
        check_layout(manifest, cfg, 1, 1)
        assert str(manifest.layout) == ("tp=1 pp=2 dualpipev dp=1 ZeRO-1" if saved == "dualpipev" else "tp=1 pp=2 dp=1 ZeRO-1")


def test_layouts_dualpipev_cannot_run_are_one_line():
    from cplm_dist.config import BatchLayout

    with pytest.raises(ConfigError, match=r"^parallel.pp_schedule=dualpipev at parallel.pp=2 needs model.num_layers >= 4 .*"
                                          r"use parallel.pp <= 1 or parallel.pp_schedule=1f1b$"):
        load_config("tiny", ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "train.zero_stage=1"])
    cfg = load_config("tiny", ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "train.zero_stage=1", *LAYERS,
                               "train.global_batch_size=6", "train.micro_batch_size=1"])
    with pytest.raises(ConfigError, match=r"needs >= 4 micro-batches a step, this layout has 3 .* use "
                                          r"train.global_batch_size >= 8 or parallel.pp_schedule=1f1b$"):
        BatchLayout.of(cfg, 4)  # dp 2: 6 = 1 x 2 x 3
    assert BatchLayout.of(cfg, 2).accumulation == 6  # dp 1
    with pytest.raises(ConfigError, match=r"^parallel.pp_schedule=dualpipev at parallel.pp=2 evaluates >= 4 micro-batches "
                                          r"a validation pass, train.eval_batches=2: use train.eval_batches >= 4$"):
        load_config("tiny", ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "train.zero_stage=1", *LAYERS,
                             "train.eval_batches=2"])
    assert load_config("tiny", ["parallel.pp_schedule=dualpipev"]).parallel.pp == 1  # no pipeline: nothing to schedule


# --- the planner's bubble and in-flight micro-batches against DeepSpeed's own schedules ----------


def _simulate(schedule: str, m: int, p: int, forward: float = 1.0, backward: float = 2.0):
    """(bubble, peak micro-batches in flight on each rank) of DeepSpeed's instruction streams for
    `schedule` (TrainSchedule, DualPipeVSchedule), each rank running its forwards and backwards in
    order as soon as what they wait for is done (communication free): a stage's forward costs
    `forward`, its backward `backward`, half each for DualPipeV's half-sized stages."""
    from deepspeed.runtime.pipe import schedule as ds

    chunks = 2 if schedule == "dualpipev" else 1
    streams = []
    for r in range(p):
        steps = ds.DualPipeVSchedule(m, p, r) if chunks == 2 else ds.TrainSchedule(m, p, r)
        streams.append([(type(c) is ds.ForwardPass, c.kwargs.get("phase", 0)) for step in steps.steps() for c in step
                        if isinstance(c, (ds.ForwardPass, ds.BackwardPass))])
    stages = chunks * p
    done, counters, at, free = {}, [{} for _ in range(p)], [0] * p, [0.0] * p
    held, peak = [0.0] * p, [0.0] * p
    while any(at[r] < len(streams[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while at[r] < len(streams[r]):
                is_forward, phase = streams[r][at[r]]
                v = r if phase == 0 else stages - 1 - r  # the stage this instruction runs
                micro = counters[r].get((is_forward, phase), 0)
                after = (("F", v - 1, micro) if v > 0 else None) if is_forward else (
                    ("B", v + 1, micro) if v < stages - 1 else ("F", v, micro))
                if after is not None and after not in done:
                    break
                start = max(free[r], done[after] if after else 0.0)
                free[r] = start + (forward if is_forward else backward) / chunks
                done[("F" if is_forward else "B", v, micro)] = free[r]
                counters[r][(is_forward, phase)] = micro + 1
                held[r] += (1 if is_forward else -1) / chunks
                peak[r] = max(peak[r], held[r])
                at[r] += 1
                moved = True
        assert moved, "the schedule deadlocked"
    return 1 - m * (forward + backward) / max(free), peak


@pytest.mark.parametrize("p,m", [(2, 4), (2, 16), (4, 8), (4, 32), (8, 16), (8, 64)])
def test_the_modelled_bubble_and_in_flight_micro_batches_are_deepspeeds_schedules(p, m):
    from cplm_dist.model.parallel.stages import Stage
    from cplm_dist.profiling.memory import bubble, in_flight

    for schedule in ("1f1b", "dualpipev"):
        simulated, peak = _simulate(schedule, m, p)
        assert bubble(p, m, schedule) == pytest.approx(simulated, abs=1e-12), schedule
        chunks = 2 if schedule == "dualpipev" else 1
        assert [in_flight(Stage(r, p, 1, r == 0, r == p - 1, chunks), m) for r in range(p)] == pytest.approx(peak)
    assert bubble(p, m, "dualpipev") < bubble(p, m)  # at m = 32, p = 4: 5.4% against 8.6%


def test_the_estimator_and_communication_model_count_a_dualpipev_rank_as_its_two_stages():
    """A rank's stages r and 2p - 1 - r: their layers (rank 0 the embedding and the head, balanced
    by parameters), both links' p2p, no tied all-reduce; the ranks' parameters add up to the model's."""
    from cplm_dist.model.counting import parameters_per_device
    from cplm_dist.model.parallel.stages import pipeline_stages, stage_parameters, stage_transformer_layers
    from cplm_dist.profiling.communication import step_bytes

    cfg = load_config("cplm-1.7b", ["parallel.pp=4", "parallel.pp_schedule=dualpipev", "train.zero_stage=1"])
    stages = pipeline_stages(cfg, 4, 1)
    per_stage = stage_transformer_layers(cfg, 4)
    assert len(per_stage) == 8 and min(per_stage) >= 1 and sum(per_stage) == cfg.model.num_layers
    assert [s.layers for s in stages] == [per_stage[r] + per_stage[7 - r] for r in range(4)]
    assert stages[0].first and stages[0].last and not any(s.first or s.last for s in stages[1:])
    assert stages[0].layers < stages[1].layers  # the embedding and the head weigh on rank 0
    assert sum(stage_parameters(cfg, s, 1) for s in stages) == parameters_per_device(cfg, 1)
    kw = dict(tp=1, dp=2, zero=1, micro_batch=1, accumulation=8, seq_len=2048, precision="bf16",
              activation_checkpointing=False, sequence_parallel=False, pp=4)
    volumes = [step_bytes(cfg, stage=r, **kw) for r in range(4)]
    one_link = 8 * 2048 * (2 * cfg.model.hidden_size * 2 + 16)  # hidden states out, gradient back, ids and labels
    assert [v["pp/send"] for v in volumes] == [one_link, 2 * one_link, 2 * one_link, one_link]
    assert all("tied/all_reduce" not in v for v in volumes)
    flat = load_config("cplm-1.7b", ["parallel.pp=4", "train.zero_stage=1"])
    assert "tied/all_reduce" in step_bytes(flat, stage=0, **kw)
