"""A non-editable install works away from the repository: the shipped configs, launch scripts and
the copy head's flex GPU record travel as package data, and the console scripts run from an empty
directory (cplm-scaling --slurm included). The tests import the tools by their installed name only."""

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
    this interpreter's site-packages (a .pth line), so nothing is downloaded. The copy holds a
    flex GPU record (cplm_dist/model/flex_gpu_record.json) where the checkout has none yet: one
    for no real torch ("0.0"), which ships but leaves copy.impl=auto chunked."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    for part in ("cplm_dist", "configs", "launch", "tools", "pyproject.toml", "README.md"):
        (shutil.copytree if (REPO / part).is_dir() else shutil.copy)(REPO / part, src / part)
    record = src / "cplm_dist" / "model" / "flex_gpu_record.json"
    if not record.is_file():
        record.write_text('{"torch": "0.0", "device": "a stand-in written by tests/test_packaging.py"}\n')
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


def test_installed_package_carries_the_flex_gpu_record(installed, tmp_path):
    """A committed flex record (cplm_dist/model/flex_record.py) ships in a non-editable install
    (package data), where copy.impl=auto reads it."""
    code = "from cplm_dist.model.flex_record import RECORD; print(RECORD); print(RECORD.read_text(), end='')"
    proc = run(installed, tmp_path, "python", "-c", code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, text = proc.stdout.split("\n", 1)
    assert Path(where).parent.parent.parent.name == "site-packages", where
    assert '"torch"' in text, text


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


# --- what a cluster installs: the ranges, the extras, the pins -----------------------------------


def project() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def requirement_name(req: str) -> str:
    return req.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0].split("!")[0].strip().lower()


def pins(path: Path) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return dict(line.lower().split("==") for line in lines if line)


def test_pyproject_states_the_ranges_the_import_refuses_outside():
    from cplm_dist.megatron_compat import SUPPORTED

    deps = project()["dependencies"]
    for name, (low, high) in SUPPORTED.items():
        assert f"{name}>={low},<{high}" in deps, (name, [d for d in deps if d.startswith(name)])
    # and the tested pins lie inside them
    tested = pins(REPO / "tools/constraints.txt")
    from cplm_dist.megatron_compat import version_problem

    assert [version_problem(name, tested[name]) for name in SUPPORTED] == [None, None]


def test_every_requirement_is_pinned_and_the_cluster_install_leaves_torch_and_tests_out():
    """The cluster constraints are tools/constraints.txt less its torch line; every package the
    project names has a tested pin; [cluster] holds no test or evaluation package, [dev] holds
    every extra's."""
    tested, cluster = pins(REPO / "tools/constraints.txt"), pins(REPO / "tools/constraints-cluster.txt")
    assert "torch" in tested and cluster == {k: v for k, v in tested.items() if k != "torch"}, (
        "tools/constraints-cluster.txt must be tools/constraints.txt without its torch line")
    extras = project()["optional-dependencies"]
    named = {requirement_name(r) for r in project()["dependencies"] + sum(extras.values(), [])}
    assert named - set(tested) == set(), "pin these in tools/constraints.txt (and constraints-cluster.txt)"
    cluster_extra = {requirement_name(r) for r in extras["cluster"]}
    assert cluster_extra == {"mpi4py", "wandb", "tokenizers"}
    dev = {requirement_name(r) for r in extras["dev"]}
    assert {requirement_name(r) for name, reqs in extras.items() if name != "dev" for r in reqs} <= dev
    assert {"pytest", "lm-eval", "transformers"} <= dev


def test_a_version_outside_the_ranges_stops_the_import_with_one_line(tmp_path):
    """An installed DeepSpeed 0.18 (its metadata first on the path, as pip leaves it): importing
    the library's one megatron/DeepSpeed import ends with one line and exit 2, before megatron loads."""
    info = tmp_path / "deepspeed-0.18.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.18.3\n")
    env = {k: v for k, v in os.environ.items() if k != "CPLM_ALLOW_UNTESTED_VERSIONS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
    code = "import sys, cplm_dist.megatron_compat; print('megatron' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and not proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: deepspeed 0.18.3 is installed, but cplm_dist accepts deepspeed>=0.19,<0.20: "
                                  "pip install 'deepspeed>=0.19,<0.20'") and proc.stderr.count("\n") == 1, proc.stderr


def test_version_bounds_and_the_untested_escape(capsys):
    from cplm_dist.megatron_compat import check_versions, version_problem

    assert version_problem("deepspeed", "0.19.0") is None and version_problem("deepspeed", "0.19.8+cu124") is None
    assert version_problem("deepspeed", "0.20.0") and version_problem("deepspeed", "0.18.99")
    assert version_problem("megatron-core", "0.14.0") is None and version_problem("megatron-core", "0.16.1") is None
    assert version_problem("megatron-core", "0.17.0rc1") and version_problem("megatron-core", "0.13.2")
    assert check_versions({"deepspeed": "0.19.8", "megatron-core": "0.16.1"}, environ={}) == []
    passed = check_versions({"megatron-core": "0.19.2"}, environ={"CPLM_ALLOW_UNTESTED_VERSIONS": "1"})
    assert passed == ["megatron-core 0.19.2 is installed, but cplm_dist accepts megatron-core>=0.14,<0.17"]
    assert capsys.readouterr().err == f"warning: {passed[0]}; trying it anyway (CPLM_ALLOW_UNTESTED_VERSIONS=1)\n"
    try:
        check_versions({"megatron-core": "0.19.2"}, environ={})
    except SystemExit as e:
        assert e.code == 2 and capsys.readouterr().err.startswith("error: megatron-core 0.19.2 is installed")
    else:
        raise AssertionError("an untested megatron-core passed without CPLM_ALLOW_UNTESTED_VERSIONS=1")
