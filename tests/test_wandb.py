"""Weights & Biases, offline (WANDB_MODE=offline: the run's files, no server): the offline run
holds our metrics, a resume keeps the run's id and its history goes on after the resumed step;
a W&B that cannot start is one line, exit 2, on every rank."""

import json
import struct
from pathlib import Path

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


def _train_reporting(args):
    """(exit code, the error lines this rank printed)."""
    import contextlib
    import io

    from cplm_dist.train.driver import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    return code, [line for line in err.getvalue().splitlines() if line.startswith("error:")]


def test_a_wandb_that_cannot_start_is_one_line_on_every_rank(small_data, tmp_path):
    out = tmp_path / "run"
    env = _offline_env(tmp_path, WANDB_MODE="online")  # online without a login (and no server to reach)
    results = run_ranks(_train_reporting, 2, args=(argv(small_data, out, "train.train_steps=2", "train.wandb=true"),),
                        env=env, timeout=300)
    assert [code for code, _ in results] == [2, 2]
    (line,), (other,) = (lines for _, lines in results)
    assert line == other and line.startswith("error: train.wandb=true: W&B did not start (") and "WANDB_MODE=offline" in line
    assert not (out / "logs" / "wandb_run.json").exists()  # no id kept for a run that never started
