"""Training end to end on gloo ranks: the loss falls; tp x dp with ZeRO-1/2 and ZeRO stages 0-3,
and pipeline stages (pp = 2, pp = 2 x tp = 2), follow one rank's trajectory; resume is exact; a save killed midway leaves a valid `latest`;
non-finite steps are skipped and a run of them stops with the last good state; bad input gives
one line and exit code 2 with nothing written."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cplm_dist.config import load_config
from cplm_dist.training.optim import lr_factor
from cplm_dist.training.run_log import read_metrics
from tests.spawn import run_ranks

REPO = Path(__file__).resolve().parent.parent


def argv(small_data, out_dir, *extra):
    blend = ", ".join(f"{{path: {small_data.prefixes[n]}, weight: 0.5}}" for n in ("code", "copy"))
    return ["--config", str(REPO / "configs/quickstart.yaml"), "model.vocab_size=512", "model.max_seq_len=64",
            f"data.tokenizer={small_data.tokenizer}", f"data.blend=[{blend}]", "data.seq_length=64",
            "data.num_workers=0", "train.log_interval=1", "train.eval_interval=1000", "train.eval_batches=2",
            "train.save_interval=1000", "optim.warmup_steps=2", f"train.out_dir={out_dir}", *extra]


def _train(args):
    from cplm_dist.train.driver import main

    return main(args)


def train(world, args, env=None, timeout=300):
    return run_ranks(_train, world, args=(args,), timeout=timeout, env=env)


def losses(out_dir):
    return {s: r["loss"] for s, r in read_metrics(Path(out_dir) / "logs" / "metrics.jsonl").items()}


# --- the loss falls; what a run writes ----------------------------------------------------------


FORTY = ("train.train_steps=40", "train.eval_interval=20")


@pytest.fixture(scope="module")
def forty_steps(small_data, tmp_path_factory):
    """One eager 40-step run, shared by the tests that read or follow it."""
    out = tmp_path_factory.mktemp("forty") / "run"
    assert train(1, argv(small_data, out, *FORTY)) == [0]
    return out


def test_loss_goes_down_and_the_run_reports_everything(forty_steps):
    out = forty_steps
    log = read_metrics(out / "logs" / "metrics.jsonl")
    first, last = log[1]["loss"], sum(log[s]["loss"] for s in range(36, 41)) / 5
    assert last < first - 0.75, (first, last)
    for key in ("step", "consumed_tokens", "lr", "loss", "lm_loss", "copy_share", "grad_norm", "tokens_per_s",
                "tokens_per_s_per_device", "tflops_per_device", "mfu", "peak_memory_gb", "skipped_steps"):
        assert key in log[40], key
    assert log[40]["consumed_tokens"] == 40 * 16 * 64 and log[40]["mfu"] is None  # no MFU on CPU
    # the logged lr is the one the step used: half the peak in step 1 of a 2-step warmup
    assert log[1]["lr"] == pytest.approx(log[2]["lr"] / 2)
    valid = read_metrics(out / "logs" / "metrics.jsonl", "valid")
    assert sorted(valid) == [20, 40] and valid[40]["loss"] < valid[20]["loss"]
    assert list((out / "logs" / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000040"


def test_compiled_layers_train_like_eager(small_data, tmp_path, forty_steps):
    """train.compile=true (regional torch.compile) follows the eager run: its first 10 steps within
    1e-5, all 20 within 2e-4. Inductor's fused CPU kernels sum in another order than eager's, by
    the CPU's vector width, and training amplifies the last-bit differences: on an AVX2 machine
    step 17 (a grad-norm spike) differed by 4.7e-5, on AVX-512 ones all 20 steps stay under 1e-5.
    A compile that changed the computation (a layer skipped, recomputed wrongly, a mix lost) moves
    the losses by 1e-2 and more within a few steps."""
    out = tmp_path / "compiled"
    assert train(1, argv(small_data, out, *FORTY, "train.compile=true", "train.exit_at_step=20"), timeout=600) == [0]
    got, want = losses(out), losses(forty_steps)
    assert sorted(got) == list(range(1, 21))
    for step in got:
        assert abs(got[step] - want[step]) < (1e-5 if step <= 10 else 2e-4), (step, got[step], want[step])


# --- gradient accumulation in fp32 (train.grad_accum_dtype) ----------------------------------------


def _accumulated_gradients():
    """The fp32 gradients the optimizer is handed (clipping off), bf16 ZeRO-1, for grad_accum_dtype
    fp32 and bf16: for each of four micro-batches alone, and for the four accumulated."""
    from cplm_dist.config import load_config
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model.cplm import build_model
    from cplm_dist.training.engine import build_engine
    from cplm_dist.training.step import TrainStep

    dims = init_distributed(1)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, 512, (1, 64), generator=g)
        batches.append({"input_ids": ids, "labels": torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)})
    out = {}
    for dtype in ("fp32", "bf16"):
        for name, micro in [(i, [b]) for i, b in enumerate(batches)] + [("all", batches)]:
            cfg = load_config("tiny", ["train.precision=bf16", "train.zero_stage=1", "train.micro_batch_size=1",
                                       f"train.global_batch_size={len(micro)}", "optim.clip_grad=0",
                                       f"train.grad_accum_dtype={dtype}", "data.seq_length=64"])
            engine, optimizer, scheduler = build_engine(build_model(cfg, device="cpu"), cfg, dims)
            seen = []
            optimizer.before_step = lambda: seen.append(  # noqa: B023 - called within this iteration
                torch.cat([p.grad.flatten().clone() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]))
            TrainStep(engine, optimizer, scheduler, dims, cfg)(iter(micro))
            out[dtype, name] = (type(engine.optimizer).__name__, seen[0])
    return out


def test_fp32_gradient_accumulation_sums_bf16_micro_batches_in_fp32():
    """Four micro-batches accumulated (each scaled by 1/4, exact in bf16) against the fp32 mean of
    their gradients taken one at a time: train.grad_accum_dtype=fp32 (DeepSpeed's BF16_Optimizer)
    is that mean to fp32 rounding; bf16 accumulation (DeepSpeed's default) rounds at every
    addition, the control that shows the comparison can tell them apart."""
    (grads,) = run_ranks(_accumulated_gradients, 1, timeout=300)
    assert grads["fp32", "all"][0] == "BF16_Optimizer" and grads["bf16", "all"][0] != "BF16_Optimizer"
    error = {}
    for dtype in ("fp32", "bf16"):
        mean = sum(grads[dtype, i][1].double() for i in range(4)) / 4
        assert mean.abs().sum() > 0
        error[dtype] = ((grads[dtype, "all"][1].double() - mean).norm() / mean.norm()).item()
    assert error["fp32"] < 1e-6 and error["bf16"] > 1e-4, error


# --- parallel layouts follow one rank -----------------------------------------------------------

STEPS = 4


def _layout_args(small_data, out, zero, tp, *extra):
    # global batch 4: one rank takes micro 4; dp = 2 takes micro 2 each
    return argv(small_data, out, f"train.train_steps={STEPS}", f"train.zero_stage={zero}", f"parallel.tp={tp}",
                "train.global_batch_size=4", "optim.clip_grad=1.0", *extra)


@pytest.fixture(scope="module")
def one_rank(small_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts") / "one"
    assert train(1, _layout_args(small_data, out, 0, 1, "train.micro_batch_size=4")) == [0]
    return losses(out)


@pytest.mark.parametrize("zero,extra", [(1, ()), (2, ("parallel.sequence_parallel=true",))])
def test_tp2_dp2_zero_matches_one_rank(small_data, tmp_path, one_rank, zero, extra):
    """tp=2 x dp=2 through DeepSpeed, at ZeRO-2 with sequence parallelism (ZeRO-3 with it: below)."""
    out = tmp_path / f"tp2dp2z{zero}"
    assert train(4, _layout_args(small_data, out, zero, 2, "train.micro_batch_size=2", *extra)) == [0] * 4
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert abs(got[step] - one_rank[step]) < 1e-4, (step, got[step], one_rank[step])


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages_at_dp2_match_one_rank(small_data, tmp_path, one_rank, zero):
    out = tmp_path / f"dp2z{zero}"
    assert train(2, _layout_args(small_data, out, zero, 1, "train.micro_batch_size=2")) == [0, 0]
    got = losses(out)
    for step in got:
        assert abs(got[step] - one_rank[step]) < 1e-4, (step, got[step], one_rank[step])


def test_zero3_with_the_sentinel_mix_matches_one_rank(small_data, tmp_path):
    """The sentinel key is the copy head's own parameter (not a submodule's): ZeRO-3 must gather it
    again for backward, which needs its hooks to see the copy head's outputs (a NamedTuple). Run at
    tp=2 x dp=2 with sequence parallelism and recomputation: ZeRO-3 must also gather the norms' and
    copy head's weights whose gradients are summed over tp inside the graph."""
    ref, out = tmp_path / "one", tmp_path / "z3"
    assert train(1, _layout_args(small_data, ref, 0, 1, "train.micro_batch_size=4", "copy.mix=sentinel")) == [0]
    assert train(4, _layout_args(small_data, out, 3, 2, "train.micro_batch_size=2", "copy.mix=sentinel",
                                 "parallel.sequence_parallel=true", "train.activation_checkpointing=true")) == [0] * 4
    want, got = losses(ref), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert abs(got[step] - want[step]) < 1e-4, (step, got[step], want[step])

def test_activation_checkpointing_changes_nothing(small_data, tmp_path, one_rank):
    out = tmp_path / "ckpt"
    assert train(1, _layout_args(small_data, out, 0, 1, "train.micro_batch_size=4",
                                 "train.activation_checkpointing=true")) == [0]
    got = losses(out)
    for step in got:
        assert abs(got[step] - one_rank[step]) < 1e-6


# --- pipeline parallelism -------------------------------------------------------------------------

PP_STEPS = 10


def _pp_args(small_data, out, micro, *extra):
    # 4 layers (room for 3 stages), global batch 4; evaluated at the end over the same 8 validation
    # sequences whatever the micro-batch
    return argv(small_data, out, "model.num_layers=4", f"train.train_steps={PP_STEPS}", "train.global_batch_size=4",
                "optim.clip_grad=1.0",
                f"train.micro_batch_size={micro}", f"train.eval_interval={PP_STEPS}", f"train.eval_batches={8 // micro}",
                *extra)


@pytest.fixture(scope="module")
def pp_reference(small_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline") / "one"
    assert train(1, _pp_args(small_data, out, 4, "train.zero_stage=0")) == [0]
    return out


@pytest.fixture(scope="module")
def pp2_run(small_data, tmp_path_factory):
    """pp = 2 at ZeRO-1, micro-batch 1: four micro-batches through the 1F1B schedule each step."""
    out = tmp_path_factory.mktemp("pipeline") / "pp2"
    assert train(2, _pp_args(small_data, out, 1, "parallel.pp=2", "train.zero_stage=1")) == [0, 0]
    return out


def _assert_follows(got_dir, want_dir, tolerance):
    got, want = losses(got_dir), losses(want_dir)
    assert sorted(got) == list(range(1, PP_STEPS + 1))
    for step in got:
        assert abs(got[step] - want[step]) < tolerance, (step, got[step], want[step])
    valid = [read_metrics(d / "logs" / "metrics.jsonl", "valid")[PP_STEPS]["loss"] for d in (got_dir, want_dir)]
    assert abs(valid[0] - valid[1]) < tolerance, valid


def test_pipeline_follows_one_rank(pp_reference, pp2_run):
    """Tied embeddings on both stages, the copy head on the last with the ids carried to it;
    losses, LM-only losses, copy shares and gradient norms (clipping at 1.0) all follow."""
    _assert_follows(pp2_run, pp_reference, 1e-4)
    got, want = (read_metrics(d / "logs" / "metrics.jsonl") for d in (pp2_run, pp_reference))
    for step in (1, PP_STEPS):
        for key in ("lm_loss", "copy_share", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-3, abs=1e-4), (step, key)
    assert max(r["grad_norm"] for r in want.values()) > 1.0, "clipping must be exercised"
    state = torch.load(pp2_run / "checkpoints" / "step-00000010" / "mp_rank_01_model_states.pt", weights_only=False)
    assert state["loader"] == {"consumed_samples": PP_STEPS * 4}


@pytest.mark.parametrize("sp", [False, True], ids=["partitioned", "sequence-parallel"])
def test_pipeline_with_tensor_parallel_stages_follows_one_rank(small_data, tmp_path, pp_reference, sp):
    """pp = 2 x tp = 2 at ZeRO-0 (the optimizer clips with the norm over both stages) with
    recomputation inside the stages. Without sequence parallelism DeepSpeed partitions the
    activations and gradients it sends over the tp ranks and gathers them back; with it each tp
    rank sends its own sequence shard."""
    out = tmp_path / "pp2tp2"
    assert train(4, _pp_args(small_data, out, 2, "parallel.pp=2", "parallel.tp=2", "train.zero_stage=0",
                             "train.activation_checkpointing=true", f"parallel.sequence_parallel={str(sp).lower()}")) == [0] * 4
    _assert_follows(out, pp_reference, 1e-4)


def test_three_stages_follow_one_rank_and_the_middle_keeps_the_data_position(small_data, tmp_path, pp_reference):
    """pp = 3: the middle stage reads no data but counts what the others read, so its checkpoint
    holds the same position (a resume continues with the right samples on every stage)."""
    out = tmp_path / "pp3"
    assert train(3, _pp_args(small_data, out, 2, "parallel.pp=3", "train.zero_stage=1")) == [0] * 3
    _assert_follows(out, pp_reference, 1e-4)
    step_dir = out / "checkpoints" / f"step-{PP_STEPS:08d}"
    for stage in range(3):
        state = torch.load(step_dir / f"mp_rank_{stage:02d}_model_states.pt", weights_only=False)
        assert state["loader"] == {"consumed_samples": PP_STEPS * 4}, stage


def test_pipeline_resume_is_exact(small_data, tmp_path, pp2_run):
    out = tmp_path / "resumed"
    args = _pp_args(small_data, out, 1, "parallel.pp=2", "train.zero_stage=1")
    assert train(2, args + ["train.exit_at_step=5"]) == [0, 0]
    assert max(losses(out)) == 5
    assert train(2, args + ["--resume", "auto"]) == [0, 0]
    a, b = losses(pp2_run), losses(out)
    assert sorted(a) == sorted(b) == list(range(1, PP_STEPS + 1))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-6, (step, a[step], b[step])
    # another layout does not take a pipeline checkpoint in place (--reshape converts it: test_reshape_pipeline)
    proc = run_cli(_pp_args(small_data, out, 1, "train.zero_stage=1", f"train.train_steps={PP_STEPS + 1}")
                   + ["--resume", "auto"])
    assert proc.returncode == 2
    assert "was saved with another layout (pp 2 -> 1): resume with the layout it was saved with, or add --reshape" in (
        proc.stderr.strip().splitlines()[-1])


def _valid_loss_of_checkpoint(path, args):
    from cplm_dist.checkpoint import load_model
    from cplm_dist.config.cli import config_parser, load_from_args
    from cplm_dist.data.gpt_data import build_datasets
    from cplm_dist.distributed import default_device, init_distributed
    from cplm_dist.evaluation.perplexity import validation_perplexity
    from cplm_dist.training.validation_loss import evaluate

    dims = init_distributed(1)
    cfg = load_from_args(config_parser("").parse_intermixed_args(args))
    model, _, info = load_model(path)
    t = cfg.train
    data = build_datasets(cfg, (t.train_steps * t.global_batch_size, t.eval_batches * t.micro_batch_size, 0))
    evaluated = validation_perplexity(model, data, t.micro_batch_size)[0]  # tools/evaluate.py's, over the same split
    return info["layout"], evaluate(model, data.valid, cfg, dims, default_device()), evaluated


def test_a_pipeline_checkpoint_loads_as_a_whole_model(small_data, pp2_run):
    """Evaluation reads the per-stage layer files into a plain CPLM: its validation loss, as
    training's validation and as evaluate.py's perplexity compute it, is the one the pipeline
    computed at the same step."""
    args = _pp_args(small_data, pp2_run, 1)
    layout, loss, evaluated = run_ranks(_valid_loss_of_checkpoint, 1, args=(pp2_run, args))[0]
    assert layout["pp"] == 2
    piped = read_metrics(pp2_run / "logs" / "metrics.jsonl", "valid")[PP_STEPS]["loss"]
    assert loss == pytest.approx(piped, abs=1e-5)
    assert evaluated["loss"] == loss and evaluated["perplexity"] == pytest.approx(math.exp(loss), rel=1e-12)
    assert 0 < evaluated["tokens"] <= 8 * 64  # the 8 sequences of 64 tokens


# --- the profiler measures training's own step ------------------------------------------------------


def _profiler_step_losses(args, steps):
    """The losses of `steps` steps of the step the profiler builds and measures, on the batches
    training reads (the same datasets, samples and order)."""
    from cplm_dist.config.cli import config_parser, load_from_args
    from cplm_dist.data.gpt_data import build_datasets
    from cplm_dist.data.loader import ResumableLoader
    from cplm_dist.distributed import default_device, init_distributed
    from cplm_dist.training.step import build_train_step as build

    cfg = load_from_args(config_parser("").parse_intermixed_args(args))
    t = cfg.train
    dims = init_distributed(cfg.parallel.tp)
    step = build(cfg, dims, default_device())
    data = build_datasets(cfg, (t.train_steps * t.global_batch_size, t.eval_batches * t.micro_batch_size, 0))
    loader = ResumableLoader(data.train, t.micro_batch_size)
    return [step(loader).loss for _ in range(steps)]


def test_the_profiler_step_is_the_training_step(small_data, tmp_path):
    # eod_mask_loss: some labels are ignored, so a step normalising by all tokens would differ
    args = argv(small_data, tmp_path / "run", "train.train_steps=3", "train.zero_stage=1", "data.eod_mask_loss=true")
    assert train(1, args) == [0]
    trained = losses(tmp_path / "run")
    profiled = run_ranks(_profiler_step_losses, 1, args=(args, 3))[0]
    assert [trained[s] for s in (1, 2, 3)] == pytest.approx(profiled, rel=0, abs=1e-6)


# --- exact resume --------------------------------------------------------------------------------


def test_resume_is_exact(small_data, tmp_path):
    common = ["train.train_steps=8", "train.zero_stage=1"]
    assert train(1, argv(small_data, tmp_path / "straight", *common)) == [0]
    interrupted = tmp_path / "resumed"
    assert train(1, argv(small_data, interrupted, *common, "train.exit_at_step=4")) == [0]
    assert (interrupted / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    assert max(losses(interrupted)) == 4
    assert train(1, argv(small_data, interrupted, *common) + ["--resume", "auto"]) == [0]
    a, b = losses(tmp_path / "straight"), losses(interrupted)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-6, (step, a[step], b[step])
    state = torch.load(interrupted / "checkpoints" / "step-00000008" / "mp_rank_00_model_states.pt", weights_only=False)
    assert state["loader"] == {"consumed_samples": 8 * 16} and state["step"] == 8


def _states(step_dir: Path) -> dict:
    """Every file's tensors of a checkpoint (RNG states aside: Python's and NumPy's generators are
    seeded by each process from the OS, and nothing in training draws from them)."""
    out = {}
    for f in sorted(step_dir.glob("*.pt")):
        state = torch.load(f, weights_only=False)
        state.pop("rng", None)
        out[f.name] = _tensors(state)
    return out


def _tensors(obj, path=""):
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in _tensors(value, f"{path}/{key}").items()}


def test_asynchronous_saves_write_what_synchronous_saves_write(small_data, tmp_path):
    """train.async_save at dp 2 (the ranks agree through the store): the same files, tensors equal
    bit for bit, the same losses; a run stopped at step 2 and resumed from its asynchronous
    checkpoint ends with the straight synchronous run's weights, bit for bit."""
    common = ("train.train_steps=4", "train.save_interval=2", "train.zero_stage=1", "train.global_batch_size=8",
              "train.micro_batch_size=4")
    sync, behind = tmp_path / "sync", tmp_path / "async"
    assert train(2, argv(small_data, sync, *common)) == [0, 0]
    assert train(2, argv(small_data, behind, *common, "train.async_save=true", "train.exit_at_step=2")) == [0, 0]
    assert train(2, argv(small_data, behind, *common, "train.async_save=true") + ["--resume", "auto"]) == [0, 0]
    assert losses(sync) == losses(behind)
    for tag in ("step-00000002", "step-00000004"):
        a, b = (json.loads((run / "checkpoints" / tag / "complete.json").read_text()) for run in (sync, behind))
        assert sorted(a["files"]) == sorted(b["files"]) and a["step"] == b["step"]
        want, got = _states(sync / "checkpoints" / tag), _states(behind / "checkpoints" / tag)
        assert want.keys() == got.keys()
        for name in want:
            assert want[name].keys() == got[name].keys(), name
            assert all(torch.equal(want[name][k], got[name][k]) for k in want[name]), (tag, name)
    assert (behind / "checkpoints" / "latest").read_text().strip() == "step-00000004"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigkill_during_a_save_leaves_a_valid_latest(small_data, tmp_path, async_save):
    """Kill the trainer while a checkpoint directory exists without its completion marker (with
    train.async_save: while the background thread writes), then resume from what `latest` names."""
    out = tmp_path / "killed"
    args = argv(small_data, out, "train.train_steps=400", "train.save_interval=1", "train.keep_last=2",
                "model.tie_embeddings=false", f"train.async_save={str(async_save).lower()}")  # untied: a longer window
    script = f"import sys; from cplm_dist.train.driver import main; sys.exit(main({args!r}))"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts, killed_in = out / "checkpoints", None
    deadline = time.monotonic() + 240
    try:
        while killed_in is None and time.monotonic() < deadline and proc.poll() is None:
            for d in sorted(ckpts.glob("step-*")) if (ckpts / "latest").exists() else []:
                if not (d / "complete.json").exists() and any(d.iterdir()):
                    proc.send_signal(signal.SIGKILL)
                    killed_in = d.name
                    break
            time.sleep(0.002)
    finally:
        proc.kill()
        proc.wait()
    assert killed_in is not None, "never caught a save in progress"
    latest = (ckpts / "latest").read_text().strip()
    assert latest != killed_in and (ckpts / latest / "complete.json").exists()
    # the run continues from `latest`
    resumed = argv(small_data, out, f"train.train_steps={int(latest.split('-')[1]) + 2}", "train.save_interval=1",
                   "train.keep_last=2", "model.tie_embeddings=false", f"train.async_save={str(async_save).lower()}") + [
        "--resume", "auto"]
    assert train(1, resumed) == [0]
    assert not (ckpts / killed_in).exists() or (ckpts / killed_in / "complete.json").exists()


# --- non-finite steps ------------------------------------------------------------------------------


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_nonfinite_step_is_skipped_and_counted(small_data, tmp_path, zero):
    """The skipped update uses up its step of the schedule at every ZeRO stage (DeepSpeed itself
    stepped it at ZeRO-1 and ZeRO-3 but not at ZeRO-0, where the engine reads our guard's overflow)."""
    from cplm_dist.config import load_config
    from cplm_dist.training.optim import lr_factor

    out = tmp_path / f"nan{zero}"
    args = argv(small_data, out, "train.train_steps=6", f"train.zero_stage={zero}", "train.inject_nonfinite_at=[3]",
                "optim.warmup_steps=4")
    assert train(1, args) == [0]
    log = read_metrics(out / "logs" / "metrics.jsonl")
    assert log[2]["skipped_steps"] == 0 and log[3]["skipped_steps"] == 1 and log[6]["skipped_steps"] == 1
    assert all(log[s]["loss"] == log[s]["loss"] for s in (4, 5, 6)), "training goes on with finite losses"
    cfg = load_config(args[1], args[2:])
    assert [log[s]["lr"] for s in range(1, 7)] == pytest.approx([cfg.optim.lr * lr_factor(s - 1, cfg) for s in range(1, 7)])
    summary = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()][-1]
    assert (summary["event"], summary["skipped_steps"], summary["skipped_spikes"]) == ("summary", 1, 0)


def test_a_run_of_nonfinite_steps_stops_with_the_last_good_state(small_data, tmp_path):
    out = tmp_path / "nanrun"
    args = argv(small_data, out, "train.train_steps=10", "train.inject_nonfinite_at=[3, 4, 5]", "train.max_bad_steps=3",
                "train.save_interval=2")
    assert train(1, args) == [3]
    stopped = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["event"] == "stopped"]
    assert len(stopped) == 1 and "3 consecutive steps with a non-finite loss" in stopped[0]["reason"]
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-00000005"
    good = torch.load(ckpts / "step-00000002" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    last = torch.load(ckpts / "step-00000005" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    weights = [k for k, v in good.items() if isinstance(v, torch.Tensor)]
    assert len(weights) > 10 and all(torch.equal(good[k], last[k]) for k in weights), "skipped steps must not touch the weights"


# --- bad input: one line, exit code 2, nothing written ------------------------------------------


def run_cli(args, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "cplm_dist.train", *args], capture_output=True, text=True,
                          timeout=180, env=env, cwd=REPO)


def snapshot(path: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_bad_input_one_line_exit_2_nothing_written(small_data, tmp_path):
    fresh = tmp_path / "fresh"
    cases = [
        (argv(small_data, fresh, "parallel.tp=2"), {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
         "error: parallel.tp=2 does not divide WORLD_SIZE=3 (dp = world / tp must be whole; valid tp here: [1, 3])"),
        (argv(small_data, fresh, "train.global_batch_size=12", "train.micro_batch_size=4"),
         {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
         "error: train.global_batch_size=12 is not micro_batch_size=4 x dp=2 (=8) x an integer accumulation: "
         "use one of [8, 16] or change micro_batch_size"),
        (argv(small_data, fresh, f"data.blend=[{{path: {tmp_path / 'missing'}}}]"), None,
         f"error: dataset {tmp_path / 'missing'}: {tmp_path / 'missing.idx'} is missing (rebuild it with "
         "tools/preprocess_data.py, or fix data.blend)"),
        *([(argv(small_data, fresh, "copy.impl=flex"), None,
             "error: copy.impl=flex trains on CUDA only (FlexAttention has no CPU backward): set copy.impl=auto "
             "(chunked; flex on CUDA once a GPU check recorded it) or copy.impl=chunked")] if not torch.cuda.is_available() else []),
        (argv(small_data, fresh, "model.vocab_size=256"), None,  # a tokenizer larger than the model
         f"error: tokenizer {small_data.tokenizer} has 512 ids but model.vocab_size=256: set model.vocab_size=512 "
         "(or use the tokenizer the model was made for)"),
        (argv(small_data, fresh, f"data.blend=[{{path: {tmp_path}/parts/web-*, weight: tokens}}]"), None,
         f"error: data.blend[0].path={tmp_path}/parts/web-* matches no dataset (no {tmp_path}/parts/web-*.idx): fix the "
         "pattern (it matches dataset prefixes, e.g. data/parts/web-* for web-00000.bin/.idx ...)"),
        (argv(small_data, fresh) + ["--resume", str(tmp_path / "nothing-here")], None,
         f"error: --resume {tmp_path / 'nothing-here'}: no complete checkpoint in {tmp_path / 'nothing-here'}; "
         "give a run directory, its checkpoints/ directory or one step-* directory, or --resume auto for a new out_dir"),
    ]
    for args, env, expected in cases:
        proc = run_cli(args, env)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == expected
        assert [line for line in proc.stderr.splitlines() if line.startswith(("error", "Traceback"))] == [expected]
        assert not fresh.exists(), "nothing may be written on bad input"


def test_an_existing_run_is_never_overwritten(small_data, tmp_path):
    out = tmp_path / "existing"
    assert train(1, argv(small_data, out, "train.train_steps=2")) == [0]
    before = snapshot(out)
    proc = run_cli(argv(small_data, out, "train.train_steps=2"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: train.out_dir={out} already holds a run: continue it with --resume auto, or choose another train.out_dir")
    assert snapshot(out) == before
    # no pointer: the newest complete checkpoint is found by scanning, with a warning, and
    # continued; it is never started over nor written in place (a pointer to nothing or to
    # garbage takes the same path: test_a_lost_or_bad_latest_pointer_is_replaced_by_scanning)
    saved = snapshot(out / "checkpoints" / "step-00000002")
    (out / "checkpoints" / "latest").unlink()
    proc = run_cli(argv(small_data, out, "train.train_steps=3", "train.keep_last=5") + ["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "using the newest complete checkpoint, step-00000002" in proc.stderr
    assert snapshot(out / "checkpoints" / "step-00000002") == saved
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000003"


def test_a_lost_or_bad_latest_pointer_is_replaced_by_scanning(tmp_path, caplog):
    from cplm_dist.checkpoint import latest_tag

    root = tmp_path / "checkpoints"
    for tag in ("step-00000002", "step-00000004"):
        (root / tag).mkdir(parents=True)
        (root / tag / "complete.json").write_text("{}")
    (root / "step-00000006").mkdir()  # a save that never completed
    assert latest_tag(tmp_path / "nothing") is None
    for pointer in (None, "step-00000099\n", "step-00000006\n", b"\xff\xfe\x00garbage", "step-00000002\n"):
        (root / "latest").unlink(missing_ok=True)
        if isinstance(pointer, bytes):
            (root / "latest").write_bytes(pointer)
        elif pointer is not None:
            (root / "latest").write_text(pointer)
        caplog.clear()
        want = "step-00000002" if pointer == "step-00000002\n" else "step-00000004"
        assert latest_tag(root) == want
        assert ("using the newest complete checkpoint, step-00000004" in caplog.text) == (want == "step-00000004")


# --- schedules -----------------------------------------------------------------------------------


def test_lr_schedules():
    cos = load_config("tiny", ["optim.schedule=cosine", "optim.warmup_steps=10", "train.train_steps=110",
                               "optim.lr=1.0", "optim.min_lr=0.1"])
    assert [round(lr_factor(s, cos), 6) for s in (0, 9, 10, 60, 110)] == [0.1, 1.0, 1.0, 0.55, 0.1]
    wsd = load_config("tiny", ["optim.schedule=wsd", "optim.warmup_steps=10", "train.train_steps=100",
                               "optim.decay_fraction=0.2", "optim.lr=1.0", "optim.min_lr=0.0"])
    assert [round(lr_factor(s, wsd), 6) for s in (0, 9, 50, 79, 80, 90, 100)] == [0.1, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0]


def _groups_worker(override_sets):
    from cplm_dist.distributed import init_distributed
    from cplm_dist.errors import UsageError
    from cplm_dist.model import build_model
    from cplm_dist.training.optim import parameter_groups

    init_distributed(1)
    out = []
    for overrides in override_sets:
        cfg = load_config("tiny", ["model.tie_embeddings=false", *overrides])
        model = build_model(cfg)
        names = {id(p): n for n, p in model.named_parameters()}
        try:
            out.append({g["name"]: sorted(names[id(p)] for p in g["params"]) for g in parameter_groups(model, cfg)})
        except UsageError as e:
            out.append(str(e))
    return out


def test_weight_decay_groups():
    default, embeddings, copy_head, gate, typo, muon = run_ranks(_groups_worker, 1, args=([
        ["optim.decay_embeddings=false"], ["optim.decay_embeddings=true"], ["optim.no_decay=[copy_head.]"],
        ["optim.no_decay=[copy_head.gate.]"], ["optim.no_decay=[copy_hed.]"],
        ["optim.name=muon", "optim.muon.copy_head=true", "optim.no_decay=[copy_head.q.]"]],))[0]
    groups = default
    assert "embedding.weight" in groups["no_decay"] and "lm_head.weight" in groups["no_decay"]
    assert all(n.endswith(("norm.weight", ".bias")) or n.startswith(("embedding", "lm_head")) for n in groups["no_decay"])
    assert "layers.0.attention.qkv.weight" in groups["decay"] and "copy_head.q.weight" in groups["decay"]
    assert "copy_head.gate.bias" in groups["no_decay"] and "final_norm.weight" in groups["no_decay"]
    assert "copy_head.gate.weight" in groups["decay"]
    assert "embedding.weight" in embeddings["decay"] and "lm_head.weight" in embeddings["decay"]
    # optim.no_decay: the copy head (or its gate alone) out of the decayed matrices, the rest as before
    assert not any(n.startswith("copy_head.") for n in copy_head["decay"])
    assert {"copy_head.q.weight", "copy_head.k.weight", "copy_head.gate.weight"} <= set(copy_head["no_decay"])
    assert set(copy_head["decay"]) == {n for n in default["decay"] if not n.startswith("copy_head.")}
    assert "copy_head.gate.weight" in gate["no_decay"] and "copy_head.q.weight" in gate["decay"]
    assert "'copy_hed.' names no parameter" in typo and "fix the prefix" in typo
    assert "names Muon matrices" in muon


# --- optimizer kernels and ZeRO settings ---------------------------------------------------------


def test_fused_adamw_steps_like_foreach_and_keeps_the_guard():
    """optim.impl=fused (CUDA's default) makes the same updates as foreach, and a non-finite
    gradient still leaves every parameter untouched."""
    from cplm_dist.training.optim import GuardedAdamW, adamw_kernels

    assert adamw_kernels("auto", torch.device("cuda")) == {"fused": True}
    assert adamw_kernels("auto", torch.device("cpu")) == {"foreach": True}
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 32, generator=gen), torch.randn(32, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in start] for _ in range(4)]
    grads[2][1][3] = float("nan")
    finals = {}
    for impl in ("fused", "foreach"):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = GuardedAdamW([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}],
                           lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **adamw_kernels(impl, torch.device("cpu")))
        for i, step_grads in enumerate(grads):
            before = [p.detach().clone() for p in params]
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
            assert opt.skipped_last == (i == 2)
            if i == 2:
                assert all(torch.equal(b, p) for b, p in zip(before, params))
        finals[impl] = [p.detach() for p in params]
    for a, b in zip(finals["fused"], finals["foreach"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not torch.equal(finals["fused"][0], start[0])


def test_zero_settings_reach_deepspeed():
    from cplm_dist.distributed import ParallelDims
    from cplm_dist.training.engine import deepspeed_config

    dims = ParallelDims(rank=0, world_size=1, tp_rank=0, tp_size=1, tp_group=None, dp_rank=0, dp_size=1, dp_group=None)
    cfg = load_config(REPO / "configs/quickstart.yaml", ["train.zero_stage=3", "train.reduce_bucket_size=1000",
                                                         "train.stage3_prefetch_bucket_size=77", "train.overlap_comm=true"])
    zero = deepspeed_config(cfg, dims)["zero_optimization"]
    assert zero == {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 1000,
                    "allgather_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 77}
    default = deepspeed_config(load_config(REPO / "configs/quickstart.yaml"), dims)["zero_optimization"]
    assert default["overlap_comm"] is torch.cuda.is_available()  # null: overlap where there are CUDA streams


def test_per_source_figures_at_pp2_equal_the_step_re_scored(small_data, pp2_run):
    """The pipeline's loss stage adds each row to its source's sums ((labels, source) travel
    together): step 1's per-source losses equal one process re-scoring each source's samples."""
    from tests.source_reference import assert_first_step_sources_rescored

    assert_first_step_sources_rescored(pp2_run, _pp_args(small_data, pp2_run, 1, "parallel.pp=2", "train.zero_stage=1"))
