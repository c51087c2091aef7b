"""Loss and gradient-norm spikes (OLMo-core's stability monitor, in its z-score form).

A step's loss (or global gradient norm) is a spike when it lies more than train.spike_zscore
standard deviations above the mean of the last train.spike_window good steps' values (one-sided:
a falling loss is never one; the window must be full first). A spike is logged with its step and
the sources of its batch (their tokens); it does not enter the window, so a run of spikes is
measured against the steps before them. With train.skip_spikes the update of a step whose *loss*
spikes is skipped beside the non-finite guard (cplm_dist.training.optim.GuardedAdamW.skip_check): the
loss is reduced over dp x cp and sent over pp before the optimizer step, so every rank and every
pipeline stage decides alike; the gradient norm is only known inside DeepSpeed's step, so its
spikes are logged, never skipped.

    monitor = SpikeMonitor(cfg.train)
    monitor.skips(loss)                      # in the optimizer step: skip this update? (a loss spike)
    spikes = monitor.observe(loss, grad_norm, skipped)   # after the step: [Spike], the windows advanced

The windows are saved with the checkpoint (`state_dict`), so a resumed run decides as the
straight run would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_STD = 1e-6  # relative to the mean: a flat window does not make every wobble a spike


@dataclass(frozen=True)
class Spike:
    metric: str  # "loss" | "grad_norm"
    value: float
    mean: float
    std: float
    zscore: float

    def as_record(self) -> dict:
        return {"metric": self.metric, "value": self.value, "mean": self.mean, "std": self.std, "zscore": self.zscore}


class SpikeMonitor:
    METRICS = ("loss", "grad_norm")

    def __init__(self, train_cfg):
        self.window, self.threshold, self.skip = train_cfg.spike_window, train_cfg.spike_zscore, train_cfg.skip_spikes
        self.values: dict[str, list[float]] = {m: [] for m in self.METRICS}
        self.skipped_updates = 0  # steps whose update train.skip_spikes skipped (not counting non-finite ones)

    @property
    def enabled(self) -> bool:
        return self.window > 0

    def spike(self, metric: str, value: float) -> Spike | None:
        """`value` against the window of `metric`: a Spike, or None (not one, or the window not yet full)."""
        history = self.values[metric]
        if not self.enabled or len(history) < self.window or not math.isfinite(value):
            return None
        mean = math.fsum(history) / len(history)
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in history) / len(history))
        std = max(std, MIN_STD * abs(mean), 1e-12)
        z = (value - mean) / std
        return Spike(metric, value, mean, std, z) if z > self.threshold else None

    def skips(self, loss: float) -> bool:
        """train.skip_spikes: whether the update of a step with this (reduced) loss is skipped."""
        return self.skip and self.spike("loss", loss) is not None

    def observe(self, loss: float, grad_norm: float, bad: bool = False) -> list[Spike]:
        """The step's spikes, then its values into the windows (not a spike's, not a bad step's)."""
        if not self.enabled:
            return []
        spikes = []
        for metric, value in (("loss", loss), ("grad_norm", grad_norm)):
            found = self.spike(metric, value)
            spikes += [found] if found is not None else []
            if found is None and not bad and math.isfinite(value):
                self.values[metric] = (self.values[metric] + [value])[-self.window:]
        return spikes

    def state_dict(self) -> dict:
        return {**{m: list(v) for m, v in self.values.items()}, "skipped_updates": self.skipped_updates}

    def load_state_dict(self, state: dict | None) -> None:
        self.skipped_updates = int((state or {}).get("skipped_updates", 0))  # absent before 2026-12-07: none counted
        for metric in self.METRICS:
            self.values[metric] = [float(v) for v in (state or {}).get(metric, [])][-self.window:] if self.window else []
