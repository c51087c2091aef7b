"""A chaos run: one training under automatic restart with K random faults, compared bit for bit
with a straight run of the same config (docs/reliability.md, "Unattended runs").

    python tools/chaos.py --faults 20 --seed 0 -- --config configs/quickstart.yaml train.out_dir=runs/chaos \
        train.train_steps=200 train.save_interval=10 train.collective_timeout_minutes=0.2 ...

The run goes through `launch/torchrun.sh --max-restarts R` (each elastic restart resumes) inside a
loop that relaunches it after a clean stop before train.train_steps (a SIGTERM'd rank makes all
save and exit 0, as at a Slurm preemption) until the latest checkpoint holds the last step. The
seeded faults come one at a time, each a random number of steps (and part of one) after the run
recovered from the last: kill (SIGKILL of a random rank), term (SIGTERM), save-kill (SIGKILL while
a step-* directory without complete.json is written), hang (SIGSTOP: the others exit 4 after
train.collective_timeout_minutes, torchrun kills it and restarts all).

Then every tensor of the final mp_rank_*_model_states.pt "module" is compared (torch.equal) with
the straight run's (run first into <out_dir>-reference, or --reference DIR); a table and a JSON
report (<out_dir>/chaos/report.json) give the faults injected and survived, the steps lost (the
"resume" records' recomputed steps, plus those of a restart before any checkpoint), restarts and
wall time; each launch's output is in <out_dir>/chaos/launch-N.log. Exit 0 only when every fault
was injected and survived and the weights are equal, 1 otherwise, 2 for bad arguments (one line).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cplm_dist.errors import UsageError

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = REPO / "launch" / "torchrun.sh"
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "save-kill": signal.SIGKILL, "hang": signal.SIGSTOP}
SAME = ("model", "copy", "loss", "data", "optim", "parallel", "seed")  # what a --reference run must share
SAME_TRAIN = ("precision", "zero_stage", "global_batch_size", "micro_batch_size", "train_steps")


class Refused(UsageError):
    """A bad argument: one line, exit 2."""


def refuse(message: str):
    raise Refused(message)


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


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.error = refuse  # one line, not argparse's usage and message
    p.add_argument("--faults", type=int, default=4, help="how many faults to inject (default 4)")
    p.add_argument("--kinds", default=",".join(SIGNALS), help=f"comma-separated, of {','.join(SIGNALS)} (default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--max-restarts", type=int, help="torchrun's restarts per launch (default: --faults)")
    p.add_argument("--reference", help="a finished straight run of the same config (default: run one)")
    p.add_argument("--report", help="the JSON report (default <out_dir>/chaos/report.json)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the chaos run (default 3600)")
    p.add_argument("train", nargs=argparse.REMAINDER, help="-- then the training arguments")
    args = p.parse_args(argv)
    args.train = args.train[1:] if args.train[:1] == ["--"] else args.train
    args.kinds = [k for k in args.kinds.split(",") if k]
    if args.faults < 0 or args.nproc_per_node < 1 or (args.max_restarts or 0) < 0 or args.timeout <= 0:
        refuse("--faults and --max-restarts must be >= 0, --nproc-per-node >= 1, --timeout > 0")
    if not args.kinds or set(args.kinds) - set(SIGNALS):
        refuse(f"--kinds {','.join(args.kinds)!r}: give a comma-separated list of {', '.join(SIGNALS)}")
    if not args.train or any(a == "--resume" or a.startswith("--resume=") for a in args.train):
        refuse("give the training arguments after -- (a --config and overrides; no --resume: the tool resumes)")
    args.max_restarts = args.faults if args.max_restarts is None else args.max_restarts
    return args


def config_of(args: argparse.Namespace):
    """The run's config (cplm-train's other options are left to it: importing it takes seconds)."""
    from cplm_dist.config.cli import config_parser, load_from_args

    parser = config_parser("")
    parser.error = lambda message: refuse(f"training arguments: {message}")
    cfg = load_from_args(parser.parse_known_intermixed_args(args.train)[0])
    if "hang" in args.kinds and args.faults and cfg.train.collective_timeout_minutes > 2:
        refuse(f"hang faults wait train.collective_timeout_minutes={cfg.train.collective_timeout_minutes} each: "
               "set it small (e.g. 0.2) or leave hang out of --kinds")
    return cfg


def check_fresh(out: Path, what: str) -> None:
    if out.exists() and any(out.iterdir()):
        refuse(f"{what} {out} already exists: remove it (a chaos run starts fresh)"
               + (", or pass it as --reference" if what == "the reference" else ""))


def final_checkpoint(run: Path, steps: int) -> Path | None:
    """The step directory of the run's latest complete checkpoint when it holds `steps`, else None."""
    from cplm_dist.checkpoint.manifest import latest_tag, read_manifest

    root = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    tag = latest_tag(root) if root.is_dir() else None
    return root / tag if tag is not None and read_manifest(root / tag).step >= steps else None


def check_reference(ref: Path, cfg) -> Path:
    from cplm_dist.checkpoint.manifest import read_manifest
    from cplm_dist.config import to_dict

    step_dir = final_checkpoint(ref, cfg.train.train_steps)
    if step_dir is None:
        refuse(f"--reference {ref}: no complete checkpoint at train.train_steps={cfg.train.train_steps}")
    theirs, ours = read_manifest(step_dir).config, to_dict(cfg)
    differ = [k for k in SAME if theirs.get(k) != ours[k]] + [
        f"train.{k}" for k in SAME_TRAIN if theirs["train"].get(k) != ours["train"][k]]
    if differ:
        refuse(f"--reference {ref} was trained with another config ({', '.join(differ)})")
    return step_dir


def launch(args, out: Path, log: Path, restarts: int, resume: bool = True) -> subprocess.Popen:
    cmd = [str(TORCHRUN), "--nproc-per-node", str(args.nproc_per_node), "--max-restarts", str(restarts), "--",
           *args.train, f"train.out_dir={out}", *(["--resume", "auto"] if resume else [])]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


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

    def __init__(self, args, out: Path, steps: int, seed: int):
        self.args, self.out, self.steps, self.rng = args, out, steps, random.Random(seed)
        kinds = (args.kinds * (args.faults // len(args.kinds) + 1))[: args.faults]  # every kind asked for
        self.rng.shuffle(kinds)
        gap = max(1, steps // (args.faults + 1))
        self.faults = [Fault(k, self.rng.randint(1, gap), self.rng.random()) for k in kinds]
        self.done: list[Fault] = []
        self.metrics, self.offset = out / "logs" / "metrics.jsonl", 0
        self.armed, self.seen, self.last_step, self.step_s = True, 0, 0, 0.0
        self.launches = self.restarts = self.lost_fresh = 0
        self.start = time.monotonic()

    def run(self) -> bool:
        """Launch until the run is finished; False when a launch failed or time ran out."""
        while final_checkpoint(self.out, self.steps) is None:
            if self.launches > self.args.faults + 1:
                return say(f"relaunched {self.launches} times without finishing")
            self.launches += 1
            log = self.out / "chaos" / f"launch-{self.launches}.log"
            rc = self.supervise(launch(self.args, self.out, log, self.args.max_restarts))
            if rc != 0:
                return say(f"launch {self.launches} ended with exit {rc} (its output: {log})")
            if final_checkpoint(self.out, self.steps) is None:
                say(f"launch {self.launches} stopped cleanly before step {self.steps}: relaunching")
        self.recovered(restart=False)
        return True

    def supervise(self, proc: subprocess.Popen) -> int:
        try:
            while proc.poll() is None:
                if time.monotonic() - self.start > self.args.timeout:
                    return say(f"--timeout {self.args.timeout:.0f}s reached") or -1
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


def same_weights(a: Path, b: Path) -> tuple[bool, int]:
    """(every tensor of every mp_rank_*_model_states.pt "module" equal, how many were compared)."""
    import torch

    from cplm_dist.checkpoint.safe_io import safe_load

    names = sorted(p.name for p in a.glob("mp_rank_*_model_states.pt"))
    if not names or names != sorted(p.name for p in b.glob("mp_rank_*_model_states.pt")):
        return False, 0
    equal, count = True, 0
    for name in names:
        x, y = safe_load(a / name)["module"], safe_load(b / name)["module"]
        tensors = [k for k, v in x.items() if isinstance(v, torch.Tensor)]
        count += len(tensors)
        equal &= x.keys() == y.keys() and all(
            isinstance(y[k], torch.Tensor) and x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in tensors)
    return bool(equal), count


def straight_run(args, ref: Path, steps: int) -> tuple[Path, float]:
    say(f"straight run into {ref}")
    start = time.monotonic()
    proc = launch(args, ref, ref / "chaos-reference.log", 0, resume=False)
    if proc.wait() != 0 or final_checkpoint(ref, steps) is None:
        say(f"the straight run failed (exit {proc.returncode}; its output: {ref}/chaos-reference.log)")
        raise SystemExit(1)
    return final_checkpoint(ref, steps), time.monotonic() - start


def report(args, chaos: Chaos, finished: bool, weights: tuple[bool, int], wall: float, ref_wall) -> dict:
    from cplm_dist.train.run_log import lost_steps

    injected, survived = len(chaos.done), sum(f.survived for f in chaos.done)
    return {"ok": finished and weights[0] and injected == args.faults and survived == injected,
            "faults_requested": args.faults, "faults_injected": injected, "faults_survived": survived,
            "steps_lost": lost_steps(chaos.metrics) + chaos.lost_fresh, "restarts": chaos.restarts,
            "relaunches": chaos.launches - 1, "wall_s": round(wall, 1), "reference_wall_s": ref_wall,
            "weights_equal": weights[0], "tensors_compared": weights[1], "finished": finished, "seed": args.seed,
            "ranks": args.nproc_per_node, "train_steps": chaos.steps, "faults": [asdict(f) for f in chaos.done],
            "command": ["tools/chaos.py", *args.argv]}


def table(r: dict) -> str:
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


def prepare(argv: list[str]):
    """(arguments, config, run dir, the reference's final step dir or None): checked, or Refused."""
    args = parse(argv)
    args.argv = argv
    cfg = config_of(args)
    out = Path(cfg.train.out_dir)
    check_fresh(out, "train.out_dir")
    args.ref = Path(args.reference) if args.reference else out.with_name(out.name + "-reference")
    if not args.reference:
        check_fresh(args.ref, "the reference")
    return args, cfg, out, check_reference(args.ref, cfg) if args.reference else None


def main(argv=None) -> int:
    try:
        args, cfg, out, ref_dir = prepare(sys.argv[1:] if argv is None else argv)
    except UsageError as e:  # a bad argument or config: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    steps, ref_wall = cfg.train.train_steps, None
    if ref_dir is None:
        ref_dir, ref_wall = straight_run(args, args.ref, steps)
    chaos, start = Chaos(args, out, steps, args.seed), time.monotonic()
    finished = chaos.run()
    wall = time.monotonic() - start
    weights = same_weights(final_checkpoint(out, steps), ref_dir) if finished else (False, 0)
    r = report(args, chaos, finished, weights, wall, None if ref_wall is None else round(ref_wall, 1))
    path = Path(args.report) if args.report else out / "chaos" / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=1) + "\n")
    print(table(r) + f"\n  report      {path}")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
