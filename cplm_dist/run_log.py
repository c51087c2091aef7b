"""What a run reports, from rank 0: a progress bar, a console line and a JSON-lines record every
`train.log_interval` steps, TensorBoard scalars, optionally Weights & Biases, and the closing table.

    <out_dir>/logs/metrics.jsonl     one record per line: {"event": "train" | "valid" | "summary", ...}
    <out_dir>/logs/tensorboard/      event files (`tensorboard --logdir <out_dir>/logs/tensorboard`)

A resumed run appends; when steps repeat after a resume, the later record of a step is the one
that counts (`read_metrics` keeps it).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from cplm_dist.config import Config, to_dict
from cplm_dist.errors import ConfigError


class RunLog:
    def __init__(self, out_dir: str | Path, cfg: Config, enabled: bool, total_steps: int, start_step: int):
        self.enabled = enabled
        self.dir = Path(out_dir) / "logs"
        self.bar = self.tb = self.wandb = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        if cfg.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tensorboard"), purge_step=start_step or None)
        if cfg.train.wandb:
            try:
                import wandb
            except ImportError:
                raise ConfigError("train.wandb=true needs the wandb package: pip install wandb (or set train.wandb=false)") from None
            self.wandb = wandb.init(project=cfg.train.wandb_project, config=to_dict(cfg), dir=str(self.dir), resume="allow")
        from tqdm import tqdm

        # disable=None: a bar on a terminal, none in a log file (the console lines carry the numbers)
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", disable=None, dynamic_ncols=True, file=sys.stderr)

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.write(message)  # above the bar, not through it
        else:
            print(message, flush=True)

    def step_done(self, loss: float, tokens_per_s: float | None) -> None:
        if self.enabled and self.bar is not None:
            self.bar.update(1)
            postfix = f"loss {loss:.4f}" + (f", {tokens_per_s:,.0f} tok/s" if tokens_per_s else "")
            self.bar.set_postfix_str(postfix, refresh=False)

    def record(self, event: str, values: dict) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"event": event, **values}) + "\n")
        step = values.get("step")
        if self.tb is not None and step is not None:
            for key, value in values.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(f"{event}/{key}", value, step)
        if self.wandb is not None and step is not None:
            self.wandb.log({f"{event}/{k}": v for k, v in values.items() if k != "step"}, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.jsonl.close()


def read_metrics(path: str | Path, event: str = "train") -> dict[int, dict]:
    """step -> the last record of `event` for that step (a resumed run's records win)."""
    records = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if r.get("event") == event and "step" in r:
            records[r["step"]] = r
    return records
