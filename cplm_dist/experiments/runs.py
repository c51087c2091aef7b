"""Many training runs from one driver (tools/ablate.py, tools/scaling.py): the copy variants
they compare, one subprocess per command with its output in a log, and whether a run is done.

A run is finished when its checkpoints' `latest` names its last step; a driver that is stopped
and started again skips finished runs and continues the others with `--resume auto`.

A driver starts everything through what is installed, never through a checkout's paths: training
and the evaluation tools as `python -m MODULE` (after the --launcher prefix), the launch/ scripts
from `launch_script` (inside the package in a wheel, beside it in a checkout).
"""

from __future__ import annotations

import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from cplm_dist.checkpoint.manifest import latest_tag, tag_for
from cplm_dist.data.quickstart import build_quickstart_data
from cplm_dist.errors import UsageError
from cplm_dist.model.mixes import MIXES

VARIANTS = {"off": ["copy.enabled=false"], **{name: [f"copy.mix={name}"] for name in MIXES}}  # copy off, then each mix
COPY_TASKS = ("induction", "mqar", "spamlang")
_PACKAGE_DIR = Path(__file__).resolve().parent.parent


def launch_script(name: str) -> Path:
    """launch/<name> of this installation: a wheel ships launch/ inside the package
    (cplm_dist/launch, as configs/), a checkout (or an editable install) has it beside cplm_dist/."""
    for directory in (_PACKAGE_DIR / "launch", _PACKAGE_DIR.parent / "launch"):
        if (directory / name).is_file():
            return directory / name
    raise UsageError(f"launch/{name} is neither in {_PACKAGE_DIR} nor beside it: reinstall cplm_dist")


def script_env() -> dict[str, str]:
    """The environment a launch script runs with: this interpreter as PYTHON unless one is set
    (env.sh would look for a .venv beside the scripts, which an installed package has not)."""
    return {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}


def interpreter(launcher: str) -> list[str]:
    """The prefix of a driver's commands: the --launcher words (e.g. 'torchrun --nproc-per-node 8',
    which takes `-m module` as python does), else this interpreter."""
    return shlex.split(launcher) or [sys.executable]


def run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    """Run `cmd` (in `cwd`, default this directory), appending its output to `log`; a failure is
    one line naming the log."""
    with open(log, "a") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise UsageError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}); see {log}: {' | '.join(tail)}")


def finished(run_dir: Path, steps: int) -> bool:
    """The run's newest complete checkpoint is its last step."""
    root = run_dir / "checkpoints"
    return root.is_dir() and latest_tag(root) == tag_for(steps)


def mean_score(rows: list[dict]) -> float:
    """A task's mean accuracy (or exact match) over its settings in an eval.json."""
    key = "exact_match" if rows and "exact_match" in rows[0] else "accuracy"
    return statistics.mean(r[key] for r in rows) if rows else float("nan")


def ensure_quickstart_data(cfg, log: Path) -> None:
    """Build the quickstart corpus (cplm_dist.data.quickstart, its output appended to `log`) when
    `cfg` reads it and it is missing."""
    if "data/quickstart" in (cfg.data.tokenizer or "") and not Path(cfg.data.tokenizer).exists():
        print("building the quickstart data ...", flush=True)
        with open(log, "a") as f:
            build_quickstart_data(Path(cfg.data.tokenizer).parent, log=lambda line: print(line, file=f, flush=True))
