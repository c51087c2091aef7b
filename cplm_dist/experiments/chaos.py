"""A chaos run (tools/chaos.py is its command line; docs/reliability.md, "Unattended runs"): one
training under automatic restart with K seeded faults, supervised here, and compared bit for bit
with a straight run of the same config.

The run goes through the installed `launch/torchrun.sh --max-restarts R` (each elastic restart
resumes; runs.launch_script), relaunched after a clean stop before train.train_steps (a SIGTERM'd
rank makes all save and exit 0, as at a Slurm preemption) until the latest checkpoint holds the
last step. The faults come one at a time, each a random number of steps (and part of one) after
the run recovered from the last: kill (SIGKILL of a random rank), term (SIGTERM), save-kill
(SIGKILL while a step-* directory without complete.json is written), hang (SIGSTOP: the others
exit 4 after train.collective_timeout_minutes, torchrun kills it and restarts all).

    plan = ChaosPlan(train=["--config", "configs/quickstart.yaml", ...], faults=4, kinds=list(SIGNALS))
    chaos = Chaos(plan, out, steps)
    finished = chaos.run()
    weights = same_weights(final_checkpoint(out, steps), reference)   # cplm_dist.checkpoint
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# the library is imported where it is used: the tool refuses bad arguments before torch loads

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "save-kill": signal.SIGKILL, "hang": signal.SIGSTOP}
SAME = ("model", "copy", "loss", "data", "optim", "parallel", "seed")  # what a reference run must share
SAME_TRAIN = ("precision", "zero_stage", "global_batch_size", "micro_batch_size", "train_steps")


@dataclass(frozen=True)
class ChaosPlan:
    """What the chaos run does: the training arguments (a --config and overrides, no --resume),
    how many faults of which kinds from which seed, ranks, torchrun's restarts a launch, and the
    seconds it may take."""

    train: list[str]
    faults: int = 4
    kinds: list[str] = field(default_factory=lambda: list(SIGNALS))
    seed: int = 0
    nproc_per_node: int = 2
    max_restarts: int = 4
    timeout: float = 3600.0


def config_differences(theirs: dict, cfg) -> list[str]:
    """The fields a reference run's config (its manifest's) must share with `cfg` and does not."""
    from cplm_dist.config import to_dict

    ours = to_dict(cfg)
    return [k for k in SAME if theirs.get(k) != ours[k]] + [
        f"train.{k}" for k in SAME_TRAIN if theirs["train"].get(k) != ours["train"][k]]


@dataclass
class Fault:
    kind: str
    after: int  # train records after the run recovered from the fault before
    delay: float  # and this part of a step
    rank: int | None = None
    step: int | None = None  # the last step logged when it struck
    launch: int | None = None
    at_s: float | None = None
    survived: bool = False


def launch(plan: ChaosPlan, out: Path, log: Path, restarts: int, resume: bool = True) -> subprocess.Popen:
    """One launch of the run through the installed launch/torchrun.sh, its output appended to `log`."""
    from cplm_dist.experiments.runs import launch_script, script_env

    cmd = [str(launch_script("torchrun.sh")), "--nproc-per-node", str(plan.nproc_per_node), "--max-restarts", str(restarts),
           "--", *plan.train, f"train.out_dir={out}", *(["--resume", "auto"] if resume else [])]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=script_env())


def ranks(agent: int) -> dict[int, int]:
    """{rank: pid} of the training processes torchrun's agent `agent` runs now (their RANK)."""
    found = {}
    for children in Path(f"/proc/{agent}/task").glob("*/children"):
        try:
            for pid in children.read_text().split():
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                found.update({int(e[5:]): int(pid) for e in env if e.startswith(b"RANK=")})
        except OSError:  # gone meanwhile
            continue
    return found


def saving(out: Path, recent: float = 0.5) -> bool:
    """A checkpoint is being written: a step-* directory without complete.json whose files changed
    within `recent` seconds (not one that a killed save left behind)."""
    now = time.time()
    for d in (out / "checkpoints").glob("step-*"):
        try:
            if not (d / "complete.json").exists() and any(now - f.stat().st_mtime < recent for f in d.iterdir()):
                return True
        except OSError:
            continue
    return False


def stop(proc: subprocess.Popen) -> None:
    """Nothing of a launch outlives it (a stopped rank included)."""
    for pid in [*ranks(proc.pid).values(), -proc.pid]:  # the ranks, then the launch's process group
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait()


def say(message: str) -> bool:
    print(f"[chaos] {message}", flush=True)
    return False


class Chaos:
    """Supervises the run's launches and injects the planned faults, one after another."""

    def __init__(self, plan: ChaosPlan, out: Path, steps: int):
        self.plan, self.out, self.steps, self.rng = plan, out, steps, random.Random(plan.seed)
        kinds = (plan.kinds * (plan.faults // len(plan.kinds) + 1))[: plan.faults]  # every kind asked for
        self.rng.shuffle(kinds)
        gap = max(1, steps // (plan.faults + 1))
        self.faults = [Fault(k, self.rng.randint(1, gap), self.rng.random()) for k in kinds]
        self.done: list[Fault] = []
        self.metrics, self.offset = out / "logs" / "metrics.jsonl", 0
        self.armed, self.seen, self.last_step, self.step_s = True, 0, 0, 0.0
        self.launches = self.restarts = self.lost_fresh = 0
        self.start = time.monotonic()

    def run(self) -> bool:
        """Launch until the run is finished; False when a launch failed or time ran out."""
        from cplm_dist.checkpoint.manifest import final_checkpoint

        while final_checkpoint(self.out, self.steps) is None:
            if self.launches > self.plan.faults + 1:
                return say(f"relaunched {self.launches} times without finishing")
            self.launches += 1
            log = self.out / "chaos" / f"launch-{self.launches}.log"
            rc = self.supervise(launch(self.plan, self.out, log, self.plan.max_restarts))
            if rc != 0:
                return say(f"launch {self.launches} ended with exit {rc} (its output: {log})")
            if final_checkpoint(self.out, self.steps) is None:
                say(f"launch {self.launches} stopped cleanly before step {self.steps}: relaunching")
        self.recovered(restart=False)
        return True

    def supervise(self, proc: subprocess.Popen) -> int:
        try:
            while proc.poll() is None:
                if time.monotonic() - self.start > self.plan.timeout:
                    return say(f"--timeout {self.plan.timeout:.0f}s reached") or -1
                self.follow()
                if self.faults and self.armed and self.due(self.faults[0]):
                    self.inject(self.faults[0], proc.pid)
                time.sleep(0.002 if self.faults and self.faults[0].kind == "save-kill" else 0.02)
            return proc.returncode
        finally:
            stop(proc)

    def new_records(self) -> list[dict]:
        try:
            with open(self.metrics, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        data = data[: data.rfind(b"\n") + 1]  # complete lines only
        self.offset += len(data)
        return [json.loads(line) for line in data.splitlines() if line.strip()]

    def follow(self) -> None:
        for r in self.new_records():
            if r.get("event") == "resume":
                say(f"resumed at step {r['step']} ({r['recomputed']} steps to recompute)")
                self.last_step = r["step"]
                self.recovered()
            elif r.get("event") == "train":
                if r["step"] <= self.last_step:  # started again from scratch: no checkpoint yet
                    say(f"restarted from scratch ({self.last_step} steps to recompute)")
                    self.lost_fresh += self.last_step
                    self.recovered()
                self.seen, self.last_step, self.step_s = self.seen + 1, r["step"], r.get("step_time_s", 0.0)

    def recovered(self, restart: bool = True) -> None:
        self.restarts += restart
        for fault in self.done:
            fault.survived = True
        self.armed, self.seen = True, 0

    def due(self, fault: Fault) -> bool:
        return self.seen >= fault.after and (fault.kind != "save-kill" or saving(self.out))

    def inject(self, fault: Fault, agent: int) -> None:
        targets = ranks(agent)
        if not targets:
            return  # between a failure and torchrun's restart: later
        time.sleep(0 if fault.kind == "save-kill" else fault.delay * self.step_s)
        fault.rank = self.rng.choice(sorted(targets))
        fault.step, fault.launch, fault.at_s = self.last_step, self.launches, round(time.monotonic() - self.start, 1)
        try:
            os.kill(targets[fault.rank], SIGNALS[fault.kind])
        except ProcessLookupError:
            pass
        self.done.append(self.faults.pop(0))
        self.armed = False
        say(f"fault {len(self.done)}: {fault.kind} ({SIGNALS[fault.kind].name}) rank {fault.rank} "
            f"after step {fault.step} (launch {fault.launch})")


def straight_run(plan: ChaosPlan, ref: Path, steps: int) -> tuple[Path, float]:
    """The uninterrupted run into `ref`: its final step directory and wall time (exit 1 if it fails)."""
    from cplm_dist.checkpoint.manifest import final_checkpoint

    say(f"straight run into {ref}")
    start = time.monotonic()
    proc = launch(plan, ref, ref / "chaos-reference.log", 0, resume=False)
    if proc.wait() != 0 or final_checkpoint(ref, steps) is None:
        say(f"the straight run failed (exit {proc.returncode}; its output: {ref}/chaos-reference.log)")
        raise SystemExit(1)
    return final_checkpoint(ref, steps), time.monotonic() - start


def report(chaos: Chaos, finished: bool, weights: tuple[bool, int], wall: float, ref_wall, command: list[str]) -> dict:
    """The run's record (the JSON report): ok only when every fault was injected and survived and
    the weights are equal."""
    from cplm_dist.training.run_log import lost_steps

    injected, survived = len(chaos.done), sum(f.survived for f in chaos.done)
    return {"ok": finished and weights[0] and injected == chaos.plan.faults and survived == injected,
            "faults_requested": chaos.plan.faults, "faults_injected": injected, "faults_survived": survived,
            "steps_lost": lost_steps(chaos.metrics) + chaos.lost_fresh, "restarts": chaos.restarts,
            "relaunches": chaos.launches - 1, "wall_s": round(wall, 1), "reference_wall_s": ref_wall,
            "weights_equal": weights[0], "tensors_compared": weights[1], "finished": finished, "seed": chaos.plan.seed,
            "ranks": chaos.plan.nproc_per_node, "train_steps": chaos.steps, "faults": [asdict(f) for f in chaos.done],
            "command": command}


def table(r: dict) -> str:
    """The report as the lines the tool prints."""
    rows = [f"  {i:>3}  {f['kind']:<9}  rank {f['rank']}  after step {f['step']:<5}  launch {f['launch']}  at "
            f"{f['at_s']:>6.1f}s  {'survived' if f['survived'] else 'NOT survived'}" for i, f in enumerate(r["faults"], 1)]
    straight = f" (the straight run: {r['reference_wall_s']}s)" if r["reference_wall_s"] else ""
    return "\n".join([
        "chaos run", *rows,
        f"  faults      {r['faults_injected']} of {r['faults_requested']} injected, {r['faults_survived']} survived",
        f"  restarts    {r['restarts']} ({r['relaunches']} of them relaunches after a clean stop)",
        f"  steps lost  {r['steps_lost']} recomputed (of {r['train_steps']})",
        f"  wall time   {r['wall_s']}s{straight}",
        f"  weights     {'equal' if r['weights_equal'] else 'DIFFERENT'} ({r['tensors_compared']} tensors, torch.equal)"])
