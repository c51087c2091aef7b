"""Pretrain a Copy-Paste LM: megatron-core tensor parallelism x DeepSpeed ZeRO data parallelism.

    # CPU, one process: the quickstart (data from tools/build_quickstart_data.py)
    python -m cplm_dist.train --config configs/quickstart.yaml
    # the matched baseline: the same run without the copy head
    python -m cplm_dist.train --config configs/quickstart.yaml copy.enabled=false train.out_dir=runs/quickstart-nocopy
    # 2 CPU processes, tp=2 (gloo)
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m cplm_dist.train --config configs/quickstart.yaml parallel.tp=2
    # one node of 8 GPUs, tp=2 x dp=4, ZeRO-1 (nccl)
    torchrun --nproc-per-node 8 -m cplm_dist.train --config configs/runs/cplm-1.7b.yaml parallel.tp=2
    # slurm / mpirun / DeepSpeed's launcher: see launch/README.md
    # continue the run in train.out_dir from its latest checkpoint (a fresh start if there is none)
    python -m cplm_dist.train --config configs/quickstart.yaml --resume auto

Bad input (config, batch arithmetic, data, checkpoint, launch) stops before anything is written,
with one line and exit code 2. SIGTERM or SIGUSR1 saves a checkpoint at the next step boundary
and exits 0, for a requeue to continue with --resume auto.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cplm_dist.checkpoint import Checkpointer, CheckpointError, check_layout, latest_tag
from cplm_dist.cli import config_parser, exit_on_usage_error, load_from_args
from cplm_dist.config import Config, batch_layout, vocab_padding_note
from cplm_dist.data.gpt_data import build_datasets, check_data
from cplm_dist.data.loader import IGNORE_INDEX, ResumableLoader
from cplm_dist.engine import build_engine
from cplm_dist.errors import UsageError
from cplm_dist.model import build_model
from cplm_dist.model.counting import parameter_count
from cplm_dist.optim import grad_norm
from cplm_dist.launch_env import LaunchEnv
from cplm_dist.parallel import ParallelDims, check_world, default_device, destroy_distributed, init_distributed
from cplm_dist.run_log import RunLog
from cplm_dist.profiling.throughput import device_peak_flops, flops_per_token, peak_memory_bytes

EXIT_BAD_STEPS = 3


class StopRequest:
    """SIGTERM / SIGUSR1 (a scheduler's warning before preemption or the time limit): finish the
    current step, save, exit. Ranks agree through an all-reduce, so all stop at the same step."""

    def __init__(self):
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.signal = signum

    def agreed(self, device) -> bool:
        flag = torch.tensor([1.0 if self.signal is not None else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def find_resume(cfg: Config, resume: str | None, tp: int, dp: int) -> tuple[Path | None, str | None]:
    """(checkpoint root, tag) to resume from, or (None, None) for a fresh start; refuses to
    write over another run. Reads only: nothing is created or changed."""
    out = Path(cfg.train.out_dir)
    if resume is None:
        if (out / "checkpoints").exists() or (out / "logs" / "metrics.jsonl").exists():
            raise UsageError(f"train.out_dir={out} already holds a run: continue it with --resume auto, "
                             "or choose another train.out_dir")
        return None, None
    if resume == "auto":
        root = out / "checkpoints"
    else:
        source = Path(resume)
        root = source / "checkpoints" if (source / "checkpoints").is_dir() else source
        if root.resolve() != (out / "checkpoints").resolve() and (out / "checkpoints").exists():
            raise UsageError(f"train.out_dir={out} already holds a run: choose another train.out_dir to continue {resume} into")
    tag = latest_tag(root) if root.is_dir() else None
    if tag is None:
        if resume == "auto":
            return None, None
        raise CheckpointError(f"--resume {resume}: no checkpoint there (no '{root / 'latest'}'); "
                              "give a run directory or its checkpoints/ directory, or --resume auto")
    check_layout(root, tag, cfg, tp, dp)
    return root, tag


@torch.no_grad()
def evaluate(engine, dataset, cfg: Config, dims: ParallelDims, device) -> float:
    """Mean per-token loss over the first eval_batches micro-batches of the validation split."""
    engine.eval()
    loader = ResumableLoader(dataset, cfg.train.micro_batch_size, dims.dp_rank, dims.dp_size)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for _, batch in zip(range(cfg.train.eval_batches), loader):
        out = engine(batch["input_ids"].to(device), batch["labels"].to(device))
        total += torch.stack([out.nll.double().sum(), (batch["labels"] != IGNORE_INDEX).sum().to(device).double()])
    dist.all_reduce(total, group=dims.dp_group)
    engine.train()
    return float(total[0] / total[1])


def summary_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(["summary"] + [f"  {k:<{width}}  {v}" for k, v in rows])


@exit_on_usage_error
def main(argv=None) -> int:
    # 1. config ----------------------------------------------------------------------------------
    parser = config_parser(__doc__.splitlines()[0])
    parser.add_argument("--resume", metavar="auto|PATH", help="continue from the latest checkpoint of out_dir (auto) or of PATH")
    args = parser.parse_intermixed_args(argv)
    cfg = load_from_args(args)
    t = cfg.train

    # 2. everything the user can get wrong, checked before the first byte or connection ---------
    world = LaunchEnv.from_environ(mpi_rendezvous=False).world_size
    check_world(cfg.parallel.tp, world)
    accumulation = batch_layout(cfg, world // cfg.parallel.tp)
    resume_root, resume_tag = find_resume(cfg, args.resume, cfg.parallel.tp, world // cfg.parallel.tp)
    check_data(cfg)

    # 3. distributed: process group, TP x DP groups -----------------------------------------------
    dims = init_distributed(cfg.parallel.tp)
    device = default_device()
    stop = StopRequest()
    torch.manual_seed(cfg.seed)

    # 4. model -------------------------------------------------------------------------------------
    model = build_model(cfg, device=device)

    # 5. DeepSpeed engine: ZeRO over dp, our AdamW and schedule ---------------------------------
    engine, optimizer, scheduler = build_engine(model, cfg, dims)

    # 6. data: megatron's blended GPTDatasets, our resumable loader -------------------------------
    samples = (t.train_steps * t.global_batch_size, t.eval_batches * t.micro_batch_size * dims.dp_size, 0)
    data = build_datasets(cfg, samples)
    loader = ResumableLoader(data.train, t.micro_batch_size, dims.dp_rank, dims.dp_size,
                             num_workers=cfg.data.num_workers, pin_memory=device.type == "cuda")

    # 7. resume: weights, optimizer, schedule (DeepSpeed) + step, data position, RNG (ours) -------
    step, bad_total, consecutive_bad = 0, 0, 0
    if resume_tag is not None:
        state = Checkpointer(resume_root, cfg, dims).load(engine, resume_tag)
        step, bad_total = state["step"], state["bad_steps_total"]
        loader.load_state_dict(state["loader"])
    ckpt = Checkpointer(Path(t.out_dir) / "checkpoints", cfg, dims)
    log = RunLog(t.out_dir, cfg, dims.is_first, t.train_steps, step)
    tokens_per_step = t.global_batch_size * cfg.data.seq_length
    flops_token = flops_per_token(cfg, cfg.data.seq_length)
    peak = device_peak_flops(t.precision, device)
    note = vocab_padding_note(cfg)
    log.info(f"cplm_dist: {cfg.model.name} {parameter_count(cfg)['total'] / 1e6:.1f}M parameters, "
             f"copy {'off' if not cfg.copy.enabled else cfg.copy.mix + '/' + cfg.copy.paste}, tp={dims.tp_size} "
             f"dp={dims.dp_size} ZeRO-{t.zero_stage} {t.precision}, global batch {t.global_batch_size} = "
             f"{t.micro_batch_size} x {accumulation} x {dims.dp_size}, {tokens_per_step:,} tokens/step"
             + (f", resuming {resume_tag}" if resume_tag else "") + (f"\n  note: {note}" if note else ""))

    # The step whose state is on disk in our checkpoint directory, and where: a stop request (or a
    # stop for bad steps) right after a save, or right after resuming, must not write that step
    # again in place, which a kill during the rewrite would leave half-written under `latest`.
    saved = None
    if resume_tag is not None and Path(resume_root).resolve() == ckpt.root.resolve():
        saved = (step, ckpt.root / resume_tag)

    def save(reason: str) -> Path:
        nonlocal saved
        if saved is not None and saved[0] == step:
            log.info(f"step {step}: {saved[1]} already holds this state ({reason})")
            return saved[1]
        path = ckpt.save(engine, step, {"loader": loader.state_dict(), "bad_steps_total": bad_total,
                                        "consumed_tokens": loader.consumed_samples * cfg.data.seq_length})
        saved = (step, path)
        log.info(f"step {step}: saved {path} ({reason})")
        return path

    # 8. train loop --------------------------------------------------------------------------------
    window = {"loss": [], "lm": [], "share": [], "time": 0.0, "steps": 0}
    valid_loss = float("nan")
    run_start = time.perf_counter()
    start_step = step
    while step < t.train_steps:
        if stop.agreed(device):
            save(f"signal {stop.signal or 'on another rank'}")
            log.info(f"stopped at step {step} on request; continue with --resume auto")
            log.close()
            destroy_distributed()
            return 0
        step_start = time.perf_counter()
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, LM-only loss, copy share
        skipped_before = engine.skipped_steps
        norm0 = None
        lr_used = scheduler.get_last_lr()[0]  # this step's rate: engine.step() advances the schedule
        for _ in range(accumulation):
            batch = next(loader)
            input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
            out = engine(input_ids, labels)
            keep = labels != IGNORE_INDEX
            n = keep.sum()
            loss = out.nll.sum() / n
            if step + 1 in t.inject_nonfinite_at:
                loss = loss * float("nan")
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():
                optimizer.skipped_last = False
                if t.zero_stage == 0:
                    norm0 = grad_norm(engine.module, dims.tp_group)
            engine.step()
            sums += torch.stack([loss.detach().double(), (out.lm_nll.sum() / n).double(),
                                 (out.copy_share[keep].sum() / n).double()])
        dist.all_reduce(sums, group=dims.dp_group)
        loss_v, lm_v, share_v = (sums / (accumulation * dims.dp_size)).tolist()
        step += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - step_start
        norm = engine.get_global_grad_norm() if norm0 is None else norm0
        norm = float(norm) if norm is not None else float("nan")
        skipped = optimizer.skipped_last or engine.skipped_steps > skipped_before
        bad = skipped or not math.isfinite(loss_v) or not math.isfinite(norm)
        bad_total += bad
        consecutive_bad = consecutive_bad + 1 if bad else 0
        if bad:
            log.info(f"step {step}: non-finite loss {loss_v} / grad norm {norm}: update skipped "
                     f"({consecutive_bad} in a row, {bad_total} in all)")
        else:
            window["loss"].append(loss_v)
            window["lm"].append(lm_v)
            window["share"].append(share_v)
        window["time"] += elapsed
        window["steps"] += 1
        log.step_done(loss_v, tokens_per_step / elapsed)

        if consecutive_bad >= t.max_bad_steps:
            path = save("last good state")
            message = (f"stopping: {consecutive_bad} consecutive steps with a non-finite loss or gradient norm "
                       f"(train.max_bad_steps={t.max_bad_steps}); the parameters of the last good step are in {path}. "
                       "Lower optim.lr, check the data, then continue with --resume auto")
            log.info(message)
            log.record("stopped", {"step": step, "reason": message})
            log.close()
            destroy_distributed()
            return EXIT_BAD_STEPS

        if step % t.log_interval == 0 or step == t.train_steps:
            tps = tokens_per_step * window["steps"] / window["time"]
            mean = (lambda xs: sum(xs) / len(xs) if xs else float("nan"))
            record = {
                "step": step, "consumed_tokens": loader.consumed_samples * cfg.data.seq_length,
                "lr": lr_used, "loss": mean(window["loss"]), "lm_loss": mean(window["lm"]),
                "copy_share": mean(window["share"]), "grad_norm": norm, "skipped_steps": bad_total,
                "tokens_per_s": tps, "tokens_per_s_per_device": tps / dims.world_size,
                "tflops_per_device": flops_token * tps / dims.world_size / 1e12,
                "mfu": (flops_token * tps / dims.world_size / peak) if peak else None,
                "peak_memory_gb": peak_memory_bytes(device) / 1e9,
            }
            log.record("train", record)
            log.info(f"step {step:>6}/{t.train_steps} | loss {record['loss']:.4f} | lm {record['lm_loss']:.4f} | "
                     f"copy share {record['copy_share']:.3f} | lr {record['lr']:.2e} | grad norm {norm:.3f} | "
                     f"{tps:,.0f} tok/s | {record['tflops_per_device']:.2f} TFLOP/s/device"
                     + (f" | MFU {record['mfu']:.1%}" if record["mfu"] is not None else "")
                     + f" | mem {record['peak_memory_gb']:.2f} GB")
            window = {"loss": [], "lm": [], "share": [], "time": 0.0, "steps": 0}

        if step % t.eval_interval == 0 or step == t.train_steps:
            valid_loss = evaluate(engine, data.valid, cfg, dims, device)
            log.record("valid", {"step": step, "loss": valid_loss})
            log.info(f"step {step:>6}/{t.train_steps} | validation loss {valid_loss:.4f}")
        if step % t.save_interval == 0 or step == t.train_steps or step == t.exit_at_step:
            save("interval" if step < t.train_steps else "end of training")
        if step == t.exit_at_step and step < t.train_steps:
            log.info(f"stopped at train.exit_at_step={step}; continue with --resume auto")
            log.close()
            destroy_distributed()
            return 0

    # 9. summary -----------------------------------------------------------------------------------
    seconds = time.perf_counter() - run_start
    trained_tokens = (step - start_step) * tokens_per_step
    last = read_last_train_loss(Path(t.out_dir) / "logs" / "metrics.jsonl") if dims.is_first else float("nan")
    rows = [
        ("steps", f"{step} ({bad_total} skipped)"),
        ("train loss", f"{last:.4f} (last logged window)"),
        ("valid loss", f"{valid_loss:.4f}"),
        ("tokens", f"{trained_tokens:,} in {seconds:.1f}s: {trained_tokens / seconds:,.0f} tokens/s, "
                   f"{trained_tokens / seconds / dims.world_size:,.0f} per device"),
        ("checkpoints", f"{ckpt.root} (latest {ckpt.latest_tag() if dims.is_first else ''})"),
        ("logs", f"{Path(t.out_dir) / 'logs'} (metrics.jsonl" + (", tensorboard/)" if t.tensorboard else ")")),
    ]
    log.record("summary", {"step": step, "valid_loss": valid_loss, "tokens_per_s": trained_tokens / seconds,
                           "seconds": seconds, "skipped_steps": bad_total})
    log.info(summary_table(rows))
    log.close()
    destroy_distributed()
    return 0


def read_last_train_loss(path: Path) -> float:
    from cplm_dist.run_log import read_metrics

    records = read_metrics(path)
    return records[max(records)]["loss"] if records else float("nan")


if __name__ == "__main__":
    sys.exit(main())
