"""The checkpoint format across versions: manifests of format 1 (every variant it had: without
layout.pp, without cwd, without the tokenizer files) upgrade to format 2 as they are read; a
format this code does not know, or a malformed manifest, is one line; and checkpoints written by
the code of the last commit before format 2 (b9e05fe, taken from the repository's history) at
ZeRO-0, ZeRO-1 and pp = 2 evaluate with their own validation loss and resume exactly where that
code's own run went on."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cplm_dist.checkpoint import FORMAT, CheckpointError, load_checkpoint_config, read_manifest
from tests.spawn import run_ranks
from tests.test_train import _valid_loss_of_checkpoint, argv, losses, train

REPO = Path(__file__).resolve().parent.parent
FORMAT_1_COMMIT = "b9e05fe"  # the last commit that wrote format 1


def manifest_1(tmp_path, name: str, **changes) -> Path:
    """A step directory with a format-1 complete.json (`changes`: keys replaced, None: key removed)."""
    step = tmp_path / name / "checkpoints" / "step-00000003"
    step.mkdir(parents=True)
    data = {"format": 1, "step": 3, "time": 1.0, "layout": {"tp": 2, "pp": 1, "dp": 1, "zero_stage": 1}, "cwd": "/runs/here",
            "consumed_samples": 48, "consumed_tokens": 3072, "config": {"data": {"tokenizer_backend": "sentencepiece"}},
            "versions": {"cplm_dist": "0.1.0"},
            "files": {"mp_rank_00_model_states.pt": {"bytes": 1, "sha256": "0"}, "tokenizer.model": {"bytes": 1, "sha256": "1"}}}
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    (step / "complete.json").write_text(json.dumps(data))
    return step


def test_format_1_manifests_upgrade_to_format_2(tmp_path):
    full = read_manifest(manifest_1(tmp_path, "full"))
    assert (full.step, full.layout.tp, full.layout.pp, full.cwd, full.consumed_samples) == (3, 2, 1, "/runs/here", 48)
    assert full.tokenizer_files == ("tokenizer.model",)  # it travelled, listed among the files
    assert full.to_json()["format"] == FORMAT == 2
    # before pipeline stages: no layout.pp
    assert read_manifest(manifest_1(tmp_path, "no-pp", layout={"tp": 1, "dp": 2, "zero_stage": 0})).layout.pp == 1
    # before the directory training ran in was recorded
    assert read_manifest(manifest_1(tmp_path, "no-cwd", cwd=None)).cwd is None
    # before the tokenizer travelled with the checkpoint
    old = manifest_1(tmp_path, "no-tokenizer", files={"mp_rank_00_model_states.pt": {"bytes": 1, "sha256": "0"}})
    assert read_manifest(old).tokenizer_files == ()
    # the oldest: no format key at all, and none of the three
    oldest = read_manifest(manifest_1(tmp_path, "oldest", format=None, cwd=None, layout={"tp": 1, "dp": 1, "zero_stage": 0},
                                      files={}))
    assert (oldest.layout.pp, oldest.cwd, oldest.tokenizer_files) == (1, None, ())
    # what evaluation reads: the upgraded manifest as plain data, its location added
    _, info = load_checkpoint_config(tmp_path / "no-pp")
    assert info["format"] == 2 and info["layout"] == {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 0}
    assert info["tag"] == "step-00000003" and info["root"] == tmp_path / "no-pp" / "checkpoints"


def test_unknown_or_malformed_manifests_are_one_line(tmp_path):
    future = manifest_1(tmp_path, "future", format=3)
    with pytest.raises(CheckpointError, match=r"has checkpoint format 3; this cplm_dist reads formats 1 and 2: use the "
                                              r"cplm_dist version that wrote it"):
        read_manifest(future)
    for name, change in (("layout", {"layout": {"tp": "two"}}), ("layout-list", {"layout": [2, 1]}), ("files", {"files": []}),
                         ("config", {"config": "llama"}), ("step", {"step": None})):
        with pytest.raises(CheckpointError) as e:
            read_manifest(manifest_1(tmp_path, name, **change))
        assert "\n" not in str(e.value) and ("malformed" in str(e.value) or "lacks ['step']" in str(e.value)), str(e.value)


# --- checkpoints the previous format's code wrote ---------------------------------------------------

STEPS = 4
LAYOUTS = {"zero0": (1, ["train.zero_stage=0"]), "zero1": (1, ["train.zero_stage=1"]),
           "pp2": (2, ["parallel.pp=2", "train.zero_stage=1", "train.micro_batch_size=4"])}


def _old_args(small_data, out, extra):
    return argv(small_data, out, f"train.train_steps={STEPS}", "train.save_interval=2", f"train.eval_interval={STEPS}",
                "train.global_batch_size=8", "train.micro_batch_size=8", "train.tensorboard=false", *extra)


@pytest.fixture(scope="module")
def format_1_runs(small_data, tmp_path_factory):
    """{layout: run directory} of 4-step runs (checkpoints at 2 and 4) by the code of FORMAT_1_COMMIT,
    extracted from git history and run as it is, the three launches side by side."""
    root = tmp_path_factory.mktemp("format1")
    code = root / "code"
    code.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", FORMAT_1_COMMIT, "cplm_dist"], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"commit {FORMAT_1_COMMIT} is not in this clone's history (a shallow clone?)")
    subprocess.run(["tar", "-x", "-C", str(code)], input=archive.stdout, check=True)
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}  # its cplm_dist, not ours
    procs = {}
    for name, (nproc, extra) in LAYOUTS.items():
        run = root / name
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
        args = _old_args(small_data, run, extra) + [f"data.cache_dir={root / name}-index-cache"]  # side by side: a cache each
        procs[name] = (run, subprocess.Popen([sys.executable, *launch, "-m", "cplm_dist.train", *args], env=env, cwd=root,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for name, (run, proc) in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
        manifest = json.loads((run / "checkpoints" / "step-00000002" / "complete.json").read_text())
        assert manifest["format"] == 1 and "tokenizer_files" not in manifest, name
    return {name: run for name, (run, _) in procs.items()}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_format_1_checkpoint_evaluates_and_resumes(small_data, format_1_runs, tmp_path, layout):
    """Evaluation loads its step 4 (a pipeline checkpoint as a whole model) with the validation
    loss the old code logged; a resume from its step 2 into a new out_dir gives steps 3 and 4
    the losses the old code's own run had (1e-6)."""
    old = format_1_runs[layout]
    nproc, extra = LAYOUTS[layout]
    step4 = old / "checkpoints" / f"step-{STEPS:08d}"
    saved_layout, loss, evaluated = run_ranks(_valid_loss_of_checkpoint, 1, args=(step4, _old_args(small_data, old, extra)))[0]
    assert saved_layout["pp"] == (2 if layout == "pp2" else 1)
    assert evaluated["loss"] == loss  # evaluate.py's perplexity reads an old checkpoint as training's validation does
    logged = json.loads([line for line in (old / "logs" / "metrics.jsonl").read_text().splitlines()
                         if '"valid"' in line][-1])["loss"]
    assert loss == pytest.approx(logged, abs=1e-5)
    new = tmp_path / "resumed"
    args = _old_args(small_data, new, extra) + ["--resume", str(old / "checkpoints" / "step-00000002")]
    assert train(nproc, args) == [0] * nproc
    got, want = losses(new), losses(old)
    assert sorted(got) == [3, 4]
    for step in got:
        assert abs(got[step] - want[step]) <= 1e-6, (layout, step, got[step], want[step])
    assert read_manifest(new / "checkpoints" / f"step-{STEPS:08d}").to_json()["format"] == 2
