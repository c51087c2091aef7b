"""A non-editable install works away from the repository: the shipped configs travel as package
data, and the console scripts run from an empty directory."""

import os
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
    for part in ("cplm_dist", "configs", "tools", "pyproject.toml", "README.md"):
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
