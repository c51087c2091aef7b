"""Weights & Biases, offline (WANDB_MODE=offline: the run's files, no server): the offline run
holds our metrics, a resume keeps the run's id and its history goes on after the resumed step;
a W&B that cannot start, or fails later, is one warning line and the run goes on."""

import json
import struct
from pathlib import Path

import pytest

from cplm_dist.training.run_log import read_metrics
from tests.spawn import run_ranks
from tests.test_train import argv, train


def _offline_env(tmp_path: Path, **extra) -> dict:
    """W&B kept inside tmp_path: its settings, no login, and any server address unreachable."""
    (tmp_path / "wandb-config").mkdir(exist_ok=True)
    return {"WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_API_KEY": "",
            "NETRC": str(tmp_path / "no-netrc"), "WANDB_BASE_URL": "http://127.0.0.1:9", **extra}


def _records(path: Path):
    """The protobuf records of an offline run's .wandb file (a LevelDB-style log: 32 KiB blocks,
    each record in chunks behind a 7-byte header; the file opens with W&B's own 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def _history(run_dir: Path) -> tuple[str, dict[int, dict]]:
    """(run id, step -> {key: value}) of one offline run directory."""
    (file,) = run_dir.glob("run-*.wandb")
    run_id, rows = None, {}
    for r in _records(file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run_id = r.run.run_id
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            rows[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}  # W&B's own: _step, _runtime ...
    return run_id, rows


def test_an_offline_run_holds_our_metrics_and_keeps_its_id_across_a_resume(small_data, tmp_path):
    out, env = tmp_path / "run", _offline_env(tmp_path)
    first = argv(small_data, out, "train.train_steps=6", "train.exit_at_step=3", "train.wandb=true",
                 "train.wandb_project=cplm-test")
    assert train(1, first, env=env) == [0]
    assert train(1, [*first, "--resume", "auto"], env=env) == [0]
    saved = json.loads((out / "logs" / "wandb_run.json").read_text())
    runs = sorted((out / "logs" / "wandb").glob("offline-run-*"))  # one a start, in start order
    assert len(runs) == 2 and all(r.name.endswith(f"-{saved['id']}") for r in runs)
    histories = [_history(r) for r in runs]
    assert [run_id for run_id, _ in histories] == [saved["id"]] * 2
    assert [sorted(rows) for _, rows in histories] == [[1, 2, 3], [3, 4, 5, 6]]  # the resume record at step 3, then on
    assert histories[1][1][3] == {"resume/reached": 3, "resume/recomputed": 0}
    ours = read_metrics(out / "logs" / "metrics.jsonl")
    logged = {**histories[0][1], **{s: r for s, r in histories[1][1].items() if s > 3}}
    assert {s: r["train/loss"] for s, r in logged.items()} == {s: r["loss"] for s, r in ours.items()}
    assert logged[6]["valid/loss"] == read_metrics(out / "logs" / "metrics.jsonl", "valid")[6]["loss"]


FAKE_WANDB = """
import os


class Settings:
    def __init__(self, **_):
        pass


class _Run:
    id, project, entity = "fake0001", "cplm-test", None

    def log(self, values, step=None):
        raise ConnectionError("fake outage: upload to api.wandb.ai refused")

    def finish(self, exit_code=0):
        pass


def init(**kwargs):
    with open(os.environ["FAKE_WANDB_CALLS"], "a") as f:
        f.write(repr(sorted((k, v) for k, v in kwargs.items() if k in ("group", "tags"))) + "\\n")
    if os.environ["FAKE_WANDB_FAILS"] == "init":
        raise RuntimeError("fake outage: api.wandb.ai unreachable\\nsecond line of the traceback text")
    return _Run()
"""


def _train_with_fake_wandb(fake_dir, args):
    """(exit code, the warning lines this rank printed) of a run whose `wandb` is the fake one in fake_dir
    (an outside service that fails, not our code)."""
    import contextlib
    import io
    import sys

    sys.path.insert(0, str(fake_dir))
    sys.modules.pop("wandb", None)
    from cplm_dist.train.driver import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    return code, [line for line in err.getvalue().splitlines() if line.startswith("warning:")]


@pytest.mark.parametrize("fails", ["init", "log"])
def test_a_failing_wandb_is_one_warning_and_the_run_finishes(small_data, tmp_path, fails):
    """W&B (a fake package that raises) failing to start, or at each upload: one warning line, the
    run trains to its end, metrics.jsonl holds every step; group and tags reach wandb.init."""
    fake = tmp_path / "fake"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    out, calls = tmp_path / "run", tmp_path / "calls"
    env = {"FAKE_WANDB_FAILS": fails, "FAKE_WANDB_CALLS": str(calls)}
    args = argv(small_data, out, "train.train_steps=3", "train.wandb=true", "train.wandb_group=ladder-a",
                "train.wandb_tags=[copy, 135m]")
    ((code, warnings),) = run_ranks(_train_with_fake_wandb, 1, args=(fake, args), env=env)
    assert code == 0 and len(warnings) == 1, warnings
    assert calls.read_text() == "[('group', 'ladder-a'), ('tags', ['copy', '135m'])]\n"
    what = "W&B did not start (fake outage: api.wandb.ai unreachable)" if fails == "init" else \
        "W&B failed (ConnectionError: fake outage: upload to api.wandb.ai refused)"
    assert what in warnings[0] and "training goes on without" in warnings[0], warnings
    assert sorted(read_metrics(out / "logs" / "metrics.jsonl")) == [1, 2, 3]
