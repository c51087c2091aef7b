"""torch.profiler over chosen steps of a real run (`train.profile_steps: [a, b]`), a Chrome trace
per rank, as torchtitan's profile_freq and Megatron's --profile-step-start/--profile-step-end give.

    <out_dir>/logs/profile/rank<r>-step<a>-<b>.json     a Chrome trace per rank (chrome://tracing, Perfetto)

Steps are counted as the run counts them (1-based, the step the log line names), the data wait
and the optimizer step included; CUDA kernels too where there is a GPU. A run resumed inside
[a, b] profiles the steps still ahead (the file names the steps it holds); one resumed after b
profiles nothing. A run stopped inside the window (a signal, train.exit_at_step) writes what it has.
A trace that cannot be written is one warning line: the run goes on.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch


class StepProfiler:
    def __init__(self, steps: list[int], log_dir: Path, rank: int):
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.dir, self.rank = log_dir / "profile", rank
        self.profiler: torch.profiler.profile | None = None
        self.span: torch.profiler.record_function | None = None
        self.started_at = 0

    @contextlib.contextmanager
    def around(self, step: int):
        """Step `step` (1-based) runs inside: profiled when it lies in the window."""
        self.before(step)
        try:
            yield
        finally:
            self.after(step)

    def before(self, step: int) -> None:
        """Before step `step` (1-based) runs: the profiler starts at the window's first step still
        ahead; each profiled step is a span `ProfilerStep#<step>` (the run's step number)."""
        if self.profiler is None and self.first <= step <= self.last:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.start()
            self.started_at = step
        if self.profiler is not None:
            self.span = torch.profiler.record_function(f"ProfilerStep#{step}")
            self.span.__enter__()

    def after(self, step: int) -> None:
        """After step `step` ran: its span closed; at the window's last step, the trace written."""
        if self.profiler is None:
            return
        self._end_span()
        if step >= self.last:
            self.close(step)

    def _end_span(self) -> None:
        span, self.span = self.span, None
        if span is not None:
            span.__exit__(None, None, None)

    def close(self, step: int) -> Path | None:
        """Stop and write the trace of steps started_at..step (also when the run ends inside the window)."""
        self._end_span()  # a step that raised
        profiler, self.profiler = self.profiler, None
        if profiler is None:
            return None
        path = self.dir / f"rank{self.rank}-step{self.started_at}-{step}.json"
        try:
            profiler.stop()
            self.dir.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(path))
        except Exception as e:  # noqa: BLE001 - a profile is never worth the run
            print(f"warning: train.profile_steps: the trace of steps {self.started_at}-{step} was not written "
                  f"({type(e).__name__}: {str(e)[:160]}); training goes on", file=sys.stderr, flush=True)
            return None
        if self.rank == 0:
            print(f"step {step}: profile of steps {self.started_at}-{step} written to {self.dir}/rank*-step"
                  f"{self.started_at}-{step}.json (open in https://ui.perfetto.dev)", flush=True)
        return path
