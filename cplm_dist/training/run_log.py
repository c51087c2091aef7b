"""What a run reports, from rank 0: a progress bar, a console line and a JSON-lines record every
`train.log_interval` steps, TensorBoard scalars, optionally Weights & Biases, and the closing table.
TensorBoard and W&B are guarded: one that raises (a full disk, a W&B outage) is one warning line
and is dropped for the rest of this start; training and metrics.jsonl go on.

    <out_dir>/logs/metrics.jsonl     one record per line: {"event": "train" | "valid" | "resume" | "summary", ...}
    <out_dir>/logs/tensorboard/      event files (`tensorboard --logdir <out_dir>/logs/tensorboard`)

A sparse model's train records carry its routing under "moe" (per layer and over layers:
cplm_dist.training.moe_log). A resumed run appends; when steps repeat after a resume, the later record of a step is the one
that counts (`read_metrics` keeps it). Each resume first records the work it repeats,
{"event": "resume", "step": N, "reached": M, "recomputed": M - N}: M is the highest step the run
before it logged (exact at train.log_interval=1, else the last logged step), so summing
"recomputed" over a run's resume records gives the steps its faults cost (`lost_steps`).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cplm_dist.config import Config
from cplm_dist.config.curriculum import source_names
from cplm_dist.distributed import ParallelDims
from cplm_dist.training.moe_log import MoEWindow, console
from cplm_dist.training.reduction import source_figures
from cplm_dist.training.step import StepResult
from cplm_dist.training.throughput import device_peak_flops, flops_per_token, peak_memory_bytes
from cplm_dist.training.wandb_log import first_line, flat_values, start_wandb, wandb_values, warn


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


class RunLog:
    """Every rank makes one and calls it alike; only the first rank writes."""

    def __init__(self, cfg: Config, dims: ParallelDims, device: torch.device, start_step: int):
        t = cfg.train
        self.enabled = dims.is_first
        self.dir = Path(t.out_dir) / "logs"
        self.bar = self.tb = self.wandb = None
        self.log_interval, self.total_steps, self.world = t.log_interval, t.train_steps, dims.world_size
        self.tokens_per_step = t.global_batch_size * cfg.data.seq_length
        self.flops_per_token = flops_per_token(cfg, cfg.data.seq_length)
        self.peak_flops = device_peak_flops(t.precision, device)
        self.device, self.hosts = device, dims.hosts
        self.source_names = source_names(cfg)
        self.source_tokens = dict.fromkeys(self.source_names, 0)  # cumulative trained tokens (load_state on resume)
        # a sparse model's routing figures over the window, every stage's at pp > 1 (cplm_dist.training.moe_log)
        self.moe = MoEWindow(dims.pp_group if dims.pp_size > 1 else None) if cfg.model.moe.num_experts else None
        self._new_window()
        if not self.enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        if cfg.train.wandb:  # a W&B that fails to start is one warning line (cplm_dist.training.wandb_log)
            self.wandb = start_wandb(cfg, self.dir)
        if cfg.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = self._guarded("tb", "TensorBoard", lambda: SummaryWriter(str(self.dir / "tensorboard"),
                                                                               purge_step=start_step or None))
        from tqdm import tqdm

        # disable=None: a bar on a terminal, none in a log file (the console lines carry the numbers)
        self.bar = tqdm(total=t.train_steps, initial=start_step, unit="step", disable=None, dynamic_ncols=True, file=sys.stderr)

    def _guarded(self, sink: str, name: str, write):
        """`write()` to a logger beside metrics.jsonl (TensorBoard, W&B): when it raises, one warning
        line, the logger dropped for the rest of this start, and training goes on (None is returned)."""
        try:
            return write()
        except Exception as e:  # noqa: BLE001 - a full disk, a dead server: the run outlives its loggers
            setattr(self, sink, None)
            warn(f"{name} failed ({type(e).__name__}: {first_line(e)}); training goes on without it for the rest of "
                 f"this start (every record is in {self.dir / 'metrics.jsonl'})")
            return None

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.write(message)  # above the bar, not through it
        else:
            print(message, flush=True)

    def _new_window(self) -> None:
        self.window = {"loss": [], "lm": [], "share": [], "time": 0.0, "steps": 0, "data_wait": 0.0,
                       "sources": [0.0] * (4 * len(self.source_names))}

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the log: each source's cumulative trained tokens."""
        return {"source_tokens": dict(self.source_tokens)}

    def load_state_dict(self, state: dict) -> None:
        for name, tokens in (state or {}).get("source_tokens", {}).items():
            self.source_tokens[name] = int(tokens)  # a source no stage names any more is kept too

    def sources_record(self, sums, cumulative: bool = True) -> dict:
        """{source: {loss, lm_loss, copy_share, tokens[, cumulative_tokens]}} of summed per-source terms."""
        out = source_figures(sums, self.source_names)
        for name, figures in out.items() if cumulative else ():
            figures["cumulative_tokens"] = self.source_tokens[name]
        return out

    def step_done(self, step: int, result: StepResult, seconds: float, consumed_tokens: int, skipped_total: int) -> None:
        """Count a finished step; every train.log_interval steps (and the last) write its record:
        means over the window's good steps, throughput over all of them."""
        w = self.window
        for i, name in enumerate(self.source_names):
            if 4 * i + 3 < len(result.source_sums):
                self.source_tokens[name] += int(result.source_sums[4 * i + 3])
        if not result.bad:
            w["loss"].append(result.loss)
            w["lm"].append(result.lm_loss)
            w["share"].append(result.copy_share)
            w["sources"] = [a + b for a, b in zip(w["sources"], result.source_sums)] or w["sources"]
            if self.moe is not None:
                self.moe.add(result.moe)
        w["time"] += seconds
        w["data_wait"] += result.data_wait_s
        w["steps"] += 1
        if self.enabled and self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {result.loss:.4f}, {self.tokens_per_step / seconds:,.0f} tok/s", refresh=False)
        if step % self.log_interval and step != self.total_steps:
            return
        tps = self.tokens_per_step * w["steps"] / w["time"]
        per_device = self.flops_per_token * tps / self.world
        waits = self._per_rank(w["data_wait"] / w["steps"])
        memory = max(self._per_rank(peak_memory_bytes(self.device) / 1e9))  # the fullest rank (pipeline stages differ)
        record = {
            "step": step, "consumed_tokens": consumed_tokens, "lr": result.lr, "loss": _mean(w["loss"]),
            "lm_loss": _mean(w["lm"]), "copy_share": _mean(w["share"]), "grad_norm": result.grad_norm,
            "skipped_steps": skipped_total, "tokens_per_s": tps, "tokens_per_s_per_device": tps / self.world,
            "tflops_per_device": per_device / 1e12, "mfu": per_device / self.peak_flops if self.peak_flops else None,
            "peak_memory_gb": memory,
            "step_time_s": w["time"] / w["steps"], "data_wait_s": waits[0], "data_wait_max_s": max(waits),
            "data_wait_max_rank": waits.index(max(waits)),
        }
        record["sources"] = self.sources_record(w["sources"])  # per source: token means over the window's good steps
        if self.moe is not None:  # every rank: the stages' figures are gathered over pp
            record["moe"] = self.moe.record()
        self.record("train", record)
        self.info(f"step {step:>6}/{self.total_steps} | loss {record['loss']:.4f} | lm {record['lm_loss']:.4f} | "
                  f"copy share {record['copy_share']:.3f} | lr {record['lr']:.2e} | grad norm {result.grad_norm:.3f} | "
                  f"{tps:,.0f} tok/s | {record['tflops_per_device']:.2f} TFLOP/s/device"
                  + (f" | MFU {record['mfu']:.1%}" if record["mfu"] is not None else "")
                  + f" | mem {record['peak_memory_gb']:.2f} GB"
                  + console(record.get("moe", {}))
                  + (f" | data wait {max(waits):.3f}s (rank {record['data_wait_max_rank']}{self.hosts.on_host(record['data_wait_max_rank'])})"
                     if max(waits) > 0.05 * record["step_time_s"] else ""))
        self._new_window()

    def spike(self, step: int, spike, skipped: bool, source_sums) -> None:
        """A loss or grad-norm spike (cplm_dist.training.stability): its record and one line, with the
        sources of its batch (their trained tokens)."""
        sources = {name: f["tokens"] for name, f in source_figures(source_sums, self.source_names).items()}
        self.record("spike", {"step": step, **spike.as_record(), "skipped": skipped, "sources": sources})
        self.info(f"step {step}: {spike.metric} spike {spike.value:.4g} ({spike.zscore:.1f} std above the window's mean "
                  f"{spike.mean:.4g}){'; update skipped' if skipped else ''}; batch sources: "
                  + ", ".join(f"{n} {k:,} tokens" for n, k in sources.items()))

    def _per_rank(self, seconds: float) -> list[float]:
        """Every rank's figure (all ranks call this together): peak memory, data wait. Step times are equal on every rank
        (each waits for the slowest in its collectives); what a rank spent waiting for its own
        data is not, so the log names the rank that holds the others up."""
        if self.world == 1:
            return [seconds]
        mine = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        times = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(times, mine)
        return [float(t) for t in times]

    def summary(self, rows: list[tuple[str, str]], values: dict) -> None:
        """The closing table, with the last logged training loss, and its record."""
        if not self.enabled:
            return
        records = read_metrics(self.dir / "metrics.jsonl")
        rows.insert(1, ("train loss", f"{records[max(records)]['loss']:.4f} (last logged window)" if records else "-"))
        width = max(len(k) for k, _ in rows)
        self.record("summary", values)
        self.info("\n".join(["summary"] + [f"  {k:<{width}}  {v}" for k, v in rows]))

    def record(self, event: str, values: dict) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"event": event, **values}) + "\n")
        step = values.get("step")
        if self.tb is not None and step is not None:
            self._guarded("tb", "TensorBoard", lambda: self._scalars(event, values, step))
        if self.wandb is not None and step is not None:
            self._guarded("wandb", "W&B", lambda: self.wandb.log(wandb_values(event, values), step=step))

    def _scalars(self, event: str, values: dict, step: int) -> None:
        for key, value in flat_values(event, values).items():  # per-source figures as <event>/sources/<name>/<figure>
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.tb.add_scalar(key, value, step)

    def resumed(self, step: int | None) -> None:
        """A resume at `step` (None: a fresh start): one line and a "resume" record with the steps done again."""
        if not self.enabled or step is None:
            return
        reached = max(step, previous_reach(self.dir / "metrics.jsonl"))
        self.info(f"resuming at step {step}: the previous run had reached step {reached}, "
                  f"{reached - step} steps are recomputed")
        self.record("resume", {"step": step, "reached": reached, "recomputed": reached - step})

    def close(self, failed: bool = False) -> None:
        """At the run's end; `failed`: it ends with an exception (W&B marks the run failed)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self._guarded("tb", "TensorBoard", self.tb.close)
        if self.wandb is not None:
            self._guarded("wandb", "W&B", lambda: self.wandb.finish(exit_code=1 if failed else 0))
        self.jsonl.close()


def read_metrics(path: str | Path, event: str = "train") -> dict[int, dict]:
    """step -> the last record of `event` for that step (a resumed run's records win)."""
    records = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if r.get("event") == event and "step" in r:
            records[r["step"]] = r
    return records


def _records(path: str | Path):
    for line in Path(path).read_text().splitlines() if Path(path).is_file() else []:
        try:
            yield json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue


def previous_reach(path: str | Path) -> int:
    """The highest step the last run in this metrics file recorded (its train and valid records,
    and the step it resumed at: those after the file's last "resume" record, or after the last
    start from scratch, where the train steps go back); 0 for none."""
    reached = last = 0
    for r in _records(path):
        event, step = r.get("event"), r.get("step")
        if event == "resume":
            reached = last = step or 0
        elif event in ("train", "valid") and isinstance(step, int):
            if event == "train":
                reached, last = (step if step <= last else max(reached, step)), step
            else:
                reached = max(reached, step)
    return reached


def lost_steps(path: str | Path) -> int:
    """The steps a run's resumes recomputed: the sum of its "resume" records' `recomputed`."""
    return sum(r.get("recomputed", 0) for r in _records(path) if r.get("event") == "resume")
