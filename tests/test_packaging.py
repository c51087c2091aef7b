"""A non-editable install works away from the repository: the shipped configs and launch scripts
travel as package data, and the console scripts run from an empty directory (cplm-scaling --slurm
included). The tests import the tools by their installed name only."""

import ast
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv holding a wheel-style install of a copy of the project; its dependencies come from
    this interpreter's site-packages (a .pth line), so nothing is downloaded."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    for part in ("cplm_dist", "configs", "launch", "tools", "pyproject.toml", "README.md"):
        (shutil.copytree if (REPO / part).is_dir() else shutil.copy)(REPO / part, src / part)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", str(src)], check=True, capture_output=True)
    return venv


def run(venv: Path, cwd: Path, *cmd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    return subprocess.run([str(venv / "bin" / cmd[0]), *cmd[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_installed_package_finds_its_configs_from_anywhere(installed, tmp_path):
    where = run(installed, tmp_path, "python", "-c", "import cplm_dist.config as c; print(c.CONFIG_DIR)")
    assert Path(where.stdout.strip()).parent.parent.name == "site-packages", where.stdout + where.stderr
    proc = run(installed, tmp_path, "cplm-train", "--config", "cplm-1.7b", "--print-config")
    assert proc.returncode == 0, proc.stderr
    assert "name: cplm-1.7b" in proc.stdout and "hidden_size: 2048" in proc.stdout


def test_installed_profiler_runs_from_an_empty_directory(installed, tmp_path):
    proc = run(installed, tmp_path, "cplm-profile", "--config", "tiny", "--warmup", "0", "--steps", "1",
               "--breakdown-steps", "1", "--csv", "", "train.micro_batch_size=1", "data.seq_length=32")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tokens_per_s" in proc.stdout


def test_installed_scaling_driver_submits_through_the_installed_scripts(installed, tmp_path):
    """cplm-scaling --slurm from an empty directory, with submit.sh's --dry-run: the installed
    submit.sh checks the point (preflight, by the installed interpreter) and prints the sbatch of
    the installed slurm.sbatch; the evaluation module it names is the installed one."""
    site = next((installed / "lib").glob("python*/site-packages"))
    proc = run(installed, tmp_path, "cplm-scaling", "--base-config", "tiny", "--sizes", "2e5", "--head-dim", "32",
               "--variants", "gate", "--out", "ladder", "--slurm", "--gpus-per-node 0 --time 00:05:00 --dry-run")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    submitted = [line for line in proc.stdout.splitlines() if line.startswith("dry run: gate-")]
    assert len(submitted) == 1 and " would be submitted as: sbatch " in submitted[0], proc.stdout
    script = Path(next(w for w in shlex.split(submitted[0]) if w.endswith(".sbatch")))
    assert script == site / "cplm_dist" / "launch" / "slurm.sbatch" and script.is_file()
    assert "train.out_dir=ladder/points/gate-" in submitted[0]  # relative paths: the driver's directory
    assert "layout: 1 processes = tp 1 x pp 1 x dp 1" in (tmp_path / "ladder" / "scaling.log").read_text()
    evaluate = shlex.split(proc.stdout.split("each point is evaluated with ")[1].split(" once trained")[0])
    assert evaluate == [str(installed / "bin" / "python"), "-m", "cplm_dist_tools.evaluate"]
    found = run(installed, tmp_path, "python", "-c", f"import importlib.util as u; print(u.find_spec('{evaluate[2]}').origin)")
    assert Path(found.stdout.strip()) == site / "cplm_dist_tools" / "evaluate.py", found.stderr


def imports(paths) -> list[tuple[str, str]]:
    """('file:line', module) of every absolute import in `paths`, function-level ones included."""
    found = []
    for path in sorted(paths):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(f"{path.name}:{node.lineno}", a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.append((f"{path.name}:{node.lineno}", node.module or ""))
    return found


def test_tests_import_the_tools_by_their_installed_name():
    """tools/ is the package cplm_dist_tools (what the console scripts import); a test importing
    `tools.x` as well would load a second copy of the module, with its own globals."""
    assert [(at, m) for at, m in imports((REPO / "tests").glob("*.py")) if m == "tools" or m.startswith("tools.")] == []


def test_tools_share_code_through_the_library_only():
    """A tool parses arguments and calls the library: what two tools need lives in cplm_dist, not
    in one tool that the other imports."""
    assert [(at, m) for at, m in imports((REPO / "tools").glob("*.py")) if m.split(".")[0] in ("tools", "cplm_dist_tools")] == []
