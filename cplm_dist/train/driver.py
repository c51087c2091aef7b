"""Pretrain a Copy-Paste LM: megatron-core tensor parallelism x DeepSpeed ZeRO data parallelism x pipeline stages.

    # CPU, one process: the quickstart (data from tools/build_quickstart_data.py)
    python -m cplm_dist.train --config configs/quickstart.yaml
    # the matched baseline: the same run without the copy head
    python -m cplm_dist.train --config configs/quickstart.yaml copy.enabled=false train.out_dir=runs/quickstart-nocopy
    # 2 CPU processes, tp=2 (gloo); or two pipeline stages
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m cplm_dist.train --config configs/quickstart.yaml parallel.tp=2
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m cplm_dist.train --config configs/quickstart.yaml parallel.pp=2
    # one node of 8 GPUs, tp=2 x dp=4, ZeRO-1 (nccl)
    torchrun --nproc-per-node 8 -m cplm_dist.train --config configs/runs/cplm-1.7b.yaml parallel.tp=2
    # slurm / mpirun / DeepSpeed's launcher: see launch/README.md
    # continue the run in train.out_dir from its latest checkpoint (a fresh start if there is none)
    python -m cplm_dist.train --config configs/quickstart.yaml --resume auto

Bad input (config, batch arithmetic, data, checkpoint, launch) stops before anything is written,
with one line and exit code 2. SIGTERM or SIGUSR1 saves a checkpoint at the next step boundary
and exits 0, for a requeue to continue with --resume auto.

The pieces, in the order `main` uses them: config (cplm_dist.config) -> checks -> parallel groups
(cplm_dist.distributed) -> model (cplm_dist.model) -> DeepSpeed engine (cplm_dist.training.engine) -> resume
(cplm_dist.checkpoint) -> data at the resumed position, per data stage (cplm_dist.data) -> the step (cplm_dist.training.step, the one
the profiler measures too) and its log (cplm_dist.training.run_log) -> checkpoints.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cplm_dist.checkpoint import Checkpointer, Manifest, RunLock, check_async_save, check_out_dir, find_resume
from cplm_dist.config import BatchLayout, Config
from cplm_dist.config.cli import config_parser, exit_on_usage_error, load_from_args
from cplm_dist.config.sparse import check_expert_world, expert_tp
from cplm_dist.data.blend import budget_lines, resolve_blend
from cplm_dist.data.gpt_data import check_data
from cplm_dist.data.staged_loader import StagedLoader, build_train_data
from cplm_dist.distributed import ParallelDims, default_device, destroy_distributed, init_distributed, synchronize
from cplm_dist.distributed.heartbeat import Heartbeat
from cplm_dist.distributed.launch_env import LaunchEnv
from cplm_dist.distributed.lost_rank import lost_rank_message
from cplm_dist.evaluation.in_loop import in_loop_eval
from cplm_dist.interop.init_from import init_source, initialise_from
from cplm_dist.model.copy_head import check_copy_impl
from cplm_dist.model.counting import active_parameters, parameter_count
from cplm_dist.model.parallel.context import context_of
from cplm_dist.model.parallel.stages import stage_summary
from cplm_dist.train.diagnostics import diagnose, due
from cplm_dist.training.optim import parameters_finite
from cplm_dist.training.run_log import RunLog
from cplm_dist.training.step import build_train_step, build_training_model
from cplm_dist.training.step_profile import StepProfiler
from cplm_dist.training.validation_loss import validation_figures
from cplm_dist.training.wandb_log import check_wandb

EXIT_BAD_STEPS = 3
EXIT_LOST_RANK = 4
SPIKE_FACTOR = 10.0  # train.inject_spike_at: the planted spike's loss factor


class StopDuringStartup(Exception):
    """A stop signal before training began: there is no new state worth saving."""


class StopRequest:
    """SIGTERM / SIGUSR1 (a scheduler's warning before preemption or the time limit).

    During start-up (checks, process group, model, engine, data indexing, checkpoint load) a
    signal ends the process at once: nothing new exists to save. Once training runs, it finishes
    the current step, saves, exits; ranks agree through an all-reduce, so all stop at the same
    step. `phase` names what the process is doing, for these messages and for a lost rank's."""

    def __init__(self, announce: bool):
        self.signal: int | None = None
        self.phase, self.running, self.announce = "reading the config", False, announce
        self.heartbeat: Heartbeat | None = None  # tells the other ranks this phase
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.signal = signum
        if not self.running:
            raise StopDuringStartup(f"stopped by signal {signum} while {self.phase}: nothing to save; "
                                    "continue with --resume auto")

    def enter(self, phase: str, running: bool = False) -> None:
        self.phase, self.running = phase, running
        if self.heartbeat is not None:
            self.heartbeat.update(phase=phase)
        if self.announce and not running:
            print(f"start-up: {phase}", flush=True)

    def agreed(self, device) -> bool:
        flag = torch.tensor([1.0 if self.signal is not None else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


@exit_on_usage_error
def main(argv=None) -> int:
    stop = StopRequest(announce=LaunchEnv.from_environ(mpi_rendezvous=False).rank == 0)
    try:
        return run(argv, stop)
    except StopDuringStartup as e:
        print(str(e), file=sys.stderr, flush=True)
        return 0


def train_parser():
    """cplm-train's arguments (launch/submit.sh's pre-flight check parses the same)."""
    parser = config_parser(__doc__.splitlines()[0])
    parser.add_argument("--resume", metavar="auto|PATH", help="continue from the latest checkpoint of out_dir (auto) or of PATH")
    parser.add_argument("--reshape", action="store_true",
                        help="the checkpoint may have another layout (tp, dp, ZeRO stage): convert it to this one")
    parser.add_argument("--allow-data-change", action="store_true",
                        help="resume although a dataset of data.blend changed since the checkpoint was saved (its "
                             "content fingerprint differs); the next checkpoint records the new one")
    return parser


def run(argv, stop: StopRequest) -> int:
    # 1. config ----------------------------------------------------------------------------------
    args = train_parser().parse_intermixed_args(argv)
    cfg = load_from_args(args)
    t = cfg.train

    # 2. everything the user can get wrong, checked before the first byte or connection ---------
    stop.enter("checking the launch, checkpoint and data")
    world = LaunchEnv.from_environ(mpi_rendezvous=False).world_size
    batch = BatchLayout.of(cfg, world)  # tp x cp x pp dividing the world, then micro x accumulation x dp
    dp, accumulation = batch.dp, batch.accumulation
    check_expert_world(cfg, world)  # ep x expert_tp dividing a stage's ranks
    resolve_blend(cfg)  # globs and weights by tokens expanded: the form a checkpoint saves and a resume compares
    resume = find_resume(cfg, args.resume, cfg.parallel.tp, dp, args.reshape, args.allow_data_change)
    if cfg.model.init_from and resume is None:  # one of our checkpoints or a HF Llama (cplm_dist.interop.init_from)
        init_source(cfg)
    check_copy_impl(cfg.copy, torch.cuda.is_available())
    check_async_save(cfg, world)
    check_wandb(cfg)
    check_out_dir(cfg)
    samples = (t.train_steps * t.global_batch_size, t.eval_batches * t.micro_batch_size * dp, 0)
    tokenizer = check_data(cfg, samples)

    # 3. distributed: process group, TP x DP groups; from here on one teardown -------------------
    stop.enter("joining the process group")
    dims = init_distributed(cfg.parallel.tp, pp_size=cfg.parallel.pp, cp_size=cfg.parallel.cp, ep_size=cfg.parallel.ep,
                            expert_tp_size=expert_tp(cfg), timeout_minutes=t.collective_timeout_minutes,
                            join_timeout_minutes=t.join_timeout_minutes, shared_dir=t.out_dir)
    lock = None
    try:
        stop.enter("taking the run lock on train.out_dir")  # one trainer at a time (cplm_dist.checkpoint.run_lock)
        lock = RunLock.acquire_for_run(cfg, dims)
        stop.heartbeat = Heartbeat.start(phase=stop.phase)
        return train(cfg, dims, accumulation, resume, samples, tokenizer, stop, args.reshape)
    except (RuntimeError, dist.DistError) as e:
        message = lost_rank_message(e, stop.phase, stop.heartbeat, dims.hosts, t.collective_timeout_minutes)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        return EXIT_LOST_RANK
    finally:
        if stop.heartbeat is not None:
            stop.heartbeat.close()
        if lock is not None:  # removes run.lock: what is left of one names a trainer that did not release it
            lock.release()
        destroy_distributed()


def train(cfg: Config, dims: ParallelDims, accumulation: int, resume: Manifest | None, samples: tuple, tokenizer,
          stop: StopRequest, reshape: bool = False) -> int:
    t = cfg.train
    device = default_device()
    torch.manual_seed(cfg.seed)

    # 4. model, 5. DeepSpeed engine (ZeRO over dp, our AdamW and schedule), the step -------------
    stop.enter("building the model and the DeepSpeed engine")
    model = build_training_model(cfg, dims, device)
    if cfg.model.init_from and resume is None:  # a fresh run from a checkpoint or a HF Llama; a resume reads its own
        stop.enter(f"loading {cfg.model.init_from}")
        initialise_from(model, cfg, dims.tp_rank, dims.tp_size)
    ckpt = Checkpointer(Path(t.out_dir) / "checkpoints", cfg, dims)
    resume = ckpt.newest_intact(resume) if resume is not None else None
    train_step = build_train_step(cfg, dims, device, model, load_universal=ckpt.loads_universal(resume))
    engine = train_step.engine

    # 6. resume: weights, optimizer, schedule (DeepSpeed) + step, data position, RNG (ours) -------
    step, skipped_total, state = resume_from(ckpt, engine, resume, reshape, stop)

    # 7. data: megatron's blended GPTDatasets per data stage, our resumable loader at the resumed position
    stop.enter("indexing the data")
    data, loader = build_train_data(cfg, dims, tokenizer, samples[1], state, step, context_of(dims),
                                    pin_memory=device.type == "cuda", info=print if dims.is_first else lambda _: None)
    log = RunLog(cfg, dims, device, step)
    log.load_state_dict(state.get("log"))  # each source's cumulative tokens
    train_step.monitor.load_state_dict(state.get("spikes"))  # the spike windows (cplm_dist.training.stability)
    log.info(banner(cfg, dims, accumulation, resume.tag if resume is not None else None))
    log.resumed(step if resume is not None else None)  # a resume records the steps it recomputes

    def save(reason: str) -> Path:
        return save_and_log(ckpt, engine, log, step, reason, loader, {"bad_steps_total": skipped_total, "log": log.state_dict(),
                                                                         "spikes": train_step.monitor.state_dict()})

    # 8. train loop --------------------------------------------------------------------------------
    valid_loss, start_step, run_start, skipped_in_a_row = float("nan"), step, time.perf_counter(), 0
    profile = StepProfiler(t.profile_steps, log.dir, dims.rank)  # train.profile_steps (cplm_dist.training.step_profile)
    stop.enter("training", running=True)
    try:
        while step < t.train_steps:
            if stop.agreed(device):
                save(f"signal {stop.signal or 'on another rank'}")
                log.info(f"stopped at step {step} on request; continue with --resume auto")
                return 0
            step_start = time.perf_counter()
            loader.at_step(step)  # the data stage of step + 1 (cplm_dist.config.curriculum)
            result = one_step(train_step, loader, step + 1, t, profile)
            step += 1
            if stop.heartbeat is not None:
                stop.heartbeat.update(step=step)
            synchronize(device)
            skipped_in_a_row, skipped_total = count_bad(log, step, result, skipped_in_a_row, skipped_total)
            log.step_done(step, result, time.perf_counter() - step_start,
                          loader.consumed_samples * cfg.data.seq_length, skipped_total)
            watch_step(log, step, result, train_step, cfg, device)
            if skipped_in_a_row >= t.max_bad_steps:
                # only a finite state is worth keeping: the last update may already have broken it
                path = save("last good state") if parameters_finite(engine.module) else None
                return stop_for_bad_steps(log, path or ckpt.latest_tag(), step, skipped_in_a_row, t.max_bad_steps)
            if step % t.eval_interval == 0 or step == t.train_steps:
                valid_loss = evaluate_and_log(engine, data, cfg, dims, device, log, step)
            if step % t.save_interval == 0 or step == t.train_steps or step == t.exit_at_step:
                save("interval" if step < t.train_steps else "end of training")
            elif ckpt.background is not None and ckpt.background.done():
                log_completed(log, step, ckpt.finish())
            if step == t.exit_at_step and step < t.train_steps:
                log.info(f"stopped at train.exit_at_step={step}; continue with --resume auto")
                return 0

        # 9. summary ---------------------------------------------------------------------------------
        log_completed(log, step, ckpt.finish(last=True))
        summarize(log, ckpt, dims, step - start_step, time.perf_counter() - run_start, step,
                  (skipped_total, train_step.monitor.skipped_updates), valid_loss)
        return 0
    finally:
        failed = sys.exc_info()[0] is not None
        profile.close(step)  # a run ended inside train.profile_steps writes what it has
        if not failed:  # the run ends: an asynchronous save still in flight completes first
            log_completed(log, step, ckpt.finish(last=True))
        log.close(failed)


def one_step(train_step, loader, step: int, t, profile: StepProfiler):
    """Step `step` (1-based) with its fault injection (train.inject_*), inside the profiler when it
    is one of train.profile_steps (cplm_dist.training.step_profile)."""
    with profile.around(step):
        return train_step(loader, inject_nonfinite=step in t.inject_nonfinite_at,
                          inject_scale=SPIKE_FACTOR if step in t.inject_spike_at else 1.0)


def count_bad(log: RunLog, step: int, result, in_a_row: int, total: int) -> tuple[int, int]:
    """(bad steps in a row, in all) after this step; a bad one (non-finite) gets its line."""
    in_a_row, total = (in_a_row + 1 if result.bad else 0), total + result.bad
    if result.bad:
        log.info(f"step {step}: non-finite loss {result.loss} / grad norm {result.grad_norm}: update skipped "
                 f"({in_a_row} in a row, {total} in all)")
    return in_a_row, total


def watch_step(log: RunLog, step: int, result, train_step, cfg: Config, device) -> None:
    """The step's spikes (cplm_dist.training.stability) and, every train.diagnostics_interval steps,
    the live bottleneck on its last micro-batch (cplm_dist.train.diagnostics)."""
    for spike in result.spikes:
        log.spike(step, spike, result.spike_skipped and spike.metric == "loss", result.source_sums)
    if due(cfg.train.diagnostics_interval, step) and train_step.last_batch is not None:
        log.record("diagnostics", {"step": step, **diagnose(train_step.engine, train_step.last_batch, device)})


def evaluate_and_log(engine, data, cfg: Config, dims: ParallelDims, device, log: RunLog, step: int) -> float:
    """Validation (per source too) and, with train.eval_tasks or train.eval_task_lengths, the
    in-loop suite (cplm_dist.evaluation.in_loop): their records and lines; the validation loss."""
    figures = validation_figures(engine, data.valid, cfg, dims, device)
    log.record("valid", {"step": step, "loss": figures.token_loss,
                         "sources": log.sources_record(figures.source_sums, cumulative=False)})
    log.info(f"step {step:>6}/{cfg.train.train_steps} | validation loss {figures.token_loss:.4f}")
    if cfg.train.eval_tasks or cfg.train.eval_task_lengths:
        tasks = in_loop_eval(engine.module, cfg, dims, data.tokenizer)
        log.record("eval_tasks", {"step": step, **tasks})
        scores = [f"{task}{' by length' if section == 'by_length' else ''} {sum(r['accuracy'] for r in rows.values()) / len(rows):.3f}"
                  for section in ("tasks", "by_length") for task, rows in tasks[section].items()]
        log.info(f"step {step:>6}/{cfg.train.train_steps} | in-loop accuracy: {', '.join(scores)} ({tasks['seconds']:.1f}s)")
    return figures.token_loss


def resume_from(ckpt: Checkpointer, engine, resume: Manifest | None, reshape: bool,
                stop: StopRequest) -> tuple[int, int, dict]:
    """(step, skipped steps in all, the client state: data position, ...) of the checkpoint `resume`
    ((0, 0, {}) for a fresh run), whose weights, optimizer and schedule (DeepSpeed) and RNG (ours) are loaded."""
    if resume is None:
        return 0, 0, {}
    stop.enter(f"loading checkpoint {resume.step_dir}")
    state = ckpt.load(engine, resume, reshape=reshape)
    return state["step"], state["bad_steps_total"], state


def save_and_log(ckpt: Checkpointer, engine, log: RunLog, step: int, reason: str, loader: StagedLoader,
                 client_state: dict) -> Path:
    """A checkpoint of `step` and its log line: how long the step loop blocked (with train.async_save:
    the host copy, and the wait for the previous save when it is still being written)."""
    start = time.perf_counter()
    if ckpt.background is not None:  # the next save waits for the previous one
        log_completed(log, step, ckpt.finish())
    path, written = ckpt.save(engine, step, loader.consumed_samples, {"loader": loader.state_dict(),
                                                                      "data_stages": loader.stages_state(), **client_state})
    blocked = f"; the step loop blocked {time.perf_counter() - start:.2f}s" if written else ""
    if written and ckpt.background is not None:
        log.info(f"step {step}: saving {path} in the background ({reason}{blocked})")
    else:
        log.info(f"step {step}: {'saved ' if written else ''}{path}{'' if written else ' already holds this state'} "
                 f"({reason}{blocked})")
    return path


def log_completed(log: RunLog, step: int, done) -> None:
    """The line for an asynchronous save that has completed (`done`, from Checkpointer.finish), if any."""
    if done is not None:
        log.info(f"step {step}: {done.step_dir} complete (written in the background in {done.write_s:.2f}s)")


def summarize(log: RunLog, ckpt: Checkpointer, dims: ParallelDims, steps_run: int, seconds: float, step: int,
              skipped: tuple[int, int], valid_loss: float) -> None:
    """The closing table and its record. `skipped`: (updates skipped for a non-finite loss or gradient,
    updates skipped for a loss spike under train.skip_spikes), counted apart, over the whole run."""
    tokens = steps_run * log.tokens_per_step
    skipped_total, spikes = skipped
    log.summary([
        ("steps", f"{step} ({skipped_total} skipped" + (f" non-finite, {spikes} skipped loss spike{'s' * (spikes > 1)})"
                                                        if spikes else ")")),
        ("valid loss", f"{valid_loss:.4f}"),
        ("tokens", f"{tokens:,} in {seconds:.1f}s: {tokens / seconds:,.0f} tokens/s, "
                   f"{tokens / seconds / dims.world_size:,.0f} per device"),
        ("checkpoints", f"{ckpt.root} (latest {ckpt.latest_tag() if dims.is_first else ''})"),
        ("logs", f"{log.dir} (metrics.jsonl" + (", tensorboard/)" if ckpt.cfg.train.tensorboard else ")")),
    ], {"step": step, "valid_loss": valid_loss, "tokens_per_s": tokens / seconds, "seconds": seconds,
        "skipped_steps": skipped_total, "skipped_spikes": spikes})


def banner(cfg: Config, dims: ParallelDims, accumulation: int, resume_tag: str | None) -> str:
    t = cfg.train
    total, active = parameter_count(cfg)["total"], active_parameters(cfg)  # a sparse model: a token uses top_k experts
    return (f"cplm_dist: {cfg.model.name} {total / 1e6:.1f}M parameters"
            + (f" ({active / 1e6:.1f}M active a token)" if active != total else "") + ", "
            f"copy {cfg.copy.mix + '/' + cfg.copy.paste if cfg.copy.enabled else 'off'}, tp={dims.tp_size} "
            + (f"pp={dims.pp_size} " if dims.pp_size > 1 else "") + (f"cp={dims.cp_size} " if dims.cp_size > 1 else "")
            + f"dp={dims.dp_size} ZeRO-{t.zero_stage} {t.precision}, global batch {t.global_batch_size} = "
            f"{t.micro_batch_size} x {accumulation} x {dims.dp_size}, "
            f"{t.global_batch_size * cfg.data.seq_length:,} tokens/step" + (f", resuming {resume_tag}" if resume_tag else "")
            + f"\nbudget: {t.train_steps:,} steps x {t.global_batch_size * cfg.data.seq_length:,} tokens = "
            f"{t.train_steps * t.global_batch_size * cfg.data.seq_length:,} tokens"
            + (f" (train.train_tokens={t.train_tokens:,}, rounded up to whole steps)" if t.train_tokens is not None else "")
            + "".join(f"\n{line}" for line in budget_lines(cfg))
            + (f"\npipeline (balanced by parameters): {stage_summary(cfg, dims.pp_size)}" if dims.pp_size > 1 else ""))


def stop_for_bad_steps(log: RunLog, saved: Path | str | None, step: int, in_a_row: int, limit: int) -> int:
    """`saved`: the checkpoint of the last good state (a Path), or, when the parameters themselves
    are no longer finite and nothing was saved, the tag of the latest earlier checkpoint (or None)."""
    where = (f"the parameters of the last good step are in {saved}" if isinstance(saved, Path) else
             "the parameters are no longer finite, so nothing was saved; "
             + (f"the latest checkpoint is {saved}" if saved else "there is no earlier checkpoint"))
    message = (f"stopping: {in_a_row} consecutive steps with a non-finite loss or gradient norm "
               f"(train.max_bad_steps={limit}); {where}. "
               "Lower optim.lr, check the data, then continue with --resume auto")
    log.info(message)
    log.record("stopped", {"step": step, "reason": message})
    return EXIT_BAD_STEPS


if __name__ == "__main__":
    sys.exit(main())
