"""Faults injected the way they happen to users: damaged checkpoints, a lost `latest`, a changed
config on resume, a dataset too small for its split, signals during start-up, a hung rank. Each
gives one line (exit 2 for user errors), a bounded exit, or a warned fallback, and no complete
checkpoint is changed. docs/reliability.md lists them with these tests."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.spawn import run_ranks
from tests.test_train import argv, losses, run_cli, snapshot, train

REPO = Path(__file__).resolve().parent.parent
STATES = "mp_rank_00_model_states.pt"


@pytest.fixture(scope="module")
def base_run(small_data, tmp_path_factory):
    """4 steps, complete checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("faults") / "base"
    assert train(1, argv(small_data, out, "train.train_steps=4", "train.save_interval=2", "train.keep_last=5")) == [0]
    return out


def copy_of(base_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    return out


def resume_args(small_data, out, *extra):
    return argv(small_data, out, "train.train_steps=5", "train.save_interval=2", "train.keep_last=5", *extra) + [
        "--resume", "auto"]


@pytest.mark.parametrize("damage", ["flipped byte", "malformed manifest"])
def test_a_damaged_checkpoint_is_skipped_for_the_newest_intact_one(small_data, base_run, tmp_path, damage):
    """(A truncated or missing file fails the size check before the hash: tests/test_evaluation.py.)"""
    out = copy_of(base_run, tmp_path)
    step4 = out / "checkpoints" / "step-00000004"
    if damage == "flipped byte":
        data = bytearray((step4 / STATES).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (step4 / STATES).write_bytes(bytes(data))
        extra = ()
    else:
        (step4 / "complete.json").write_text("{ not json")
        # and what a resume may change: the schedule, the intervals
        extra = ("optim.lr=1e-3", "optim.min_lr=1e-5", "train.log_interval=2", "train.eval_interval=100")
    intact = snapshot(out / "checkpoints" / "step-00000002")
    proc = run_cli(resume_args(small_data, out, *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"skipping {'checkpoint ' if damage != 'malformed manifest' else ''}{step4}" in proc.stderr
    assert "resuming step-00000002" in proc.stdout
    again, first = losses(out), losses(base_run)
    if not extra:  # resumed from step 2: steps 3 and 4 are trained again and equal the first run's
        for step in (3, 4):
            assert again[step] == pytest.approx(first[step], abs=1e-6)
    assert max(again) == 5
    assert snapshot(out / "checkpoints" / "step-00000002") == intact


def test_evaluation_refuses_a_damaged_checkpoint_with_one_line(base_run, tmp_path):
    out = copy_of(base_run, tmp_path)
    step4 = out / "checkpoints" / "step-00000004"
    data = bytearray((step4 / STATES).read_bytes())
    data[-100] ^= 0x01
    (step4 / STATES).write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, str(REPO / "tools/generate.py"), "--checkpoint", str(step4), "--prompt", "x"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {step4}: ['{STATES}'] missing or damaged (sizes or sha256 differ from its complete.json): "
        "use an earlier step (--checkpoint <run>/checkpoints/step-*)")


@pytest.mark.parametrize("override,field", [("copy.paste=self", "copy.paste"), ("model.hidden_size=64", "model.hidden_size"),
                                            ("data.seq_length=32", "data.seq_length")])
def test_a_resume_with_another_model_or_data_is_refused(small_data, base_run, tmp_path, override, field):
    out = copy_of(base_run, tmp_path)
    before = snapshot(out)
    proc = run_cli(resume_args(small_data, out, override))
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint {out / 'checkpoints' / 'step-00000004'} was trained with another config ({field} ")
    assert snapshot(out) == before


def test_a_dataset_too_small_for_its_split_stops_at_once_with_one_line(small_data, tmp_path):
    from cplm_dist.data.indexed_data import write_indexed_dataset
    from cplm_dist.data.tokenizer import load_tokenizer

    prefix = tmp_path / "three"
    write_indexed_dataset(iter(["a tiny document", "another one", "and a third"]), load_tokenizer(small_data.tokenizer),
                          str(prefix), progress=False)
    out = tmp_path / "run"
    args = argv(small_data, out, f"data.blend=[{{path: {prefix}}}]", "data.split='98,2,0'", "train.train_steps=2")
    start = time.monotonic()
    proc = run_cli(args)
    assert time.monotonic() - start < 120, "must not spin"
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"error: dataset {prefix}: data.split='98,2,0' gives its train split 3 of its 3 documents (")
    assert not out.exists()


def test_a_signal_during_start_up_ends_the_process_at_once(small_data, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", "import sys; from cplm_dist.train.driver import main; sys.exit(main(sys.argv[1:]))",
           *argv(small_data, out, "train.train_steps=50")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    for line in proc.stdout:
        if line.startswith("start-up: building the model"):
            break
    proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    _, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - start < 30
    assert proc.returncode == 0, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == (
        "stopped by signal 15 while building the model and the DeepSpeed engine: nothing to save; continue with --resume auto")
    assert not (out / "checkpoints").exists()


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["hung", "killed"])
def test_a_hung_or_dead_rank_ends_the_job_with_one_line(small_data, tmp_path, fault):
    """Rank 1 is stopped (SIGSTOP, as a hung process) or killed once training runs: rank 0 gives
    up (at once, or after train.collective_timeout_minutes) with one line naming the phase."""
    from cplm_dist.distributed import free_port

    out = tmp_path / "run"
    args = argv(small_data, out, "train.train_steps=200", "train.collective_timeout_minutes=0.2",
                "train.global_batch_size=8", "train.micro_batch_size=4")
    port = free_port()
    ranks = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = [sys.executable, "-c", "import sys; from cplm_dist.train.driver import main; sys.exit(main(sys.argv[1:]))", *args]
        ranks.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env))
    try:
        for line in ranks[0].stdout:
            if line.startswith("step") and "loss" in line:  # training runs
                break
        ranks[1].send_signal(fault)
        stopped = time.monotonic()
        _, stderr = ranks[0].communicate(timeout=120)
        assert time.monotonic() - stopped < 90
        assert ranks[0].returncode == 4, stderr[-3000:]
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("error: rank 0 lost contact with another rank while training (")
        assert last.endswith("a rank died or hung longer than train.collective_timeout_minutes=0.2: "
                             "the job stops; continue with --resume auto")
        if fault == signal.SIGSTOP:  # its heartbeat stopped: the survivor names it and what it did
            assert re.search(r"; rank 1 went quiet \d+s ago while training \(step \d+\); ", last), last
    finally:
        for p in ranks:
            p.kill()
            p.communicate()


def test_the_non_finite_guard_checks_the_parameters_too():
    """The guard saves its "last good state" only when parameters_finite says so (an update can
    break parameters whose gradients were finite); ZeRO-3 partitions are checked the same way."""
    import torch

    from cplm_dist.training.optim import parameters_finite

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    assert parameters_finite(model)
    with torch.no_grad():
        model[1].bias[0] = float("inf")
    assert not parameters_finite(model)
    model[1].bias.ds_tensor = torch.zeros(1)  # as ZeRO-3 keeps a rank's partition
    model[1].bias.data = torch.empty(0)
    assert parameters_finite(model)


def _limit_file_size():
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_save_says_why_in_one_line_and_keeps_the_previous_checkpoint(small_data, base_run, tmp_path, async_save):
    """A disk that refuses the checkpoint (here: a 1 MiB file-size limit, as a full disk would):
    one line with the operating system's reason, the partial directory removed, `latest` kept;
    with train.async_save the background thread's failure is the same line when the run waits for it."""
    out = copy_of(base_run, tmp_path)
    before = snapshot(out / "checkpoints")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    extra = ("train.tensorboard=false", f"train.async_save={str(async_save).lower()}")
    proc = subprocess.run([sys.executable, "-m", "cplm_dist.train", *resume_args(small_data, out, *extra)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO, preexec_fn=_limit_file_size)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: saving {out / 'checkpoints' / 'step-00000005'}{' in the background' if async_save else ''}"
                           " failed on rank 0: File too large (")
    assert last.endswith("removed it, the latest checkpoint stays step-00000004: free space or fix train.out_dir, "
                         "then continue with --resume auto")
    assert snapshot(out / "checkpoints") == before


def test_asynchronous_saving_beyond_the_host_memory_is_refused_at_start_up(monkeypatch):
    """train.async_save keeps a host copy of each rank's checkpoint part until it is written: a node
    whose memory cannot hold its ranks' copies is refused with one line (train.py checks it with the
    out_dir, before the process group, the model or any file)."""
    from cplm_dist.checkpoint import check_async_save, checkpoint_bytes
    from cplm_dist.config import load_config
    from cplm_dist.errors import UsageError

    cfg = load_config("tiny", ["train.async_save=true"])
    check_async_save(cfg, 1)  # a tiny model's copy fits
    big = load_config("runs/cplm-70b", ["train.async_save=true"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(UsageError) as e:
        check_async_save(big, 16)  # 8 of 16 ranks here: half of a 70B checkpoint
    assert re.fullmatch(rf"train\.async_save=true: the host copy of a checkpoint takes about {checkpoint_bytes(big) / 2e9:.1f} "
                        r"GB on this node \(8 of 16 ranks\) but [\d.]+ GB of memory is available to this job \(its cgroup "
                        r"limit, e\.g\. Slurm's --mem, or the node's free memory\): set "
                        r"train\.async_save=false, or spread the job over more nodes", str(e.value))
    check_async_save(load_config("runs/cplm-70b", []), 16)  # synchronous saves need no copy


class _Payload:
    """What a crafted file would carry: unpickling it runs code (here: creates a marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def craft(step_dir: Path, marker: Path) -> None:
    """Replace the model states by a pickle that runs code, with a manifest that matches it (an
    attacker writes both)."""
    import hashlib
    import json

    import torch

    torch.save({"module": _Payload(marker)}, step_dir / STATES)
    manifest = json.loads((step_dir / "complete.json").read_text())
    data = (step_dir / STATES).read_bytes()
    manifest["files"][STATES] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step_dir / "complete.json").write_text(json.dumps(manifest))


def test_a_crafted_checkpoint_runs_no_code_in_evaluation_or_resume(small_data, base_run, tmp_path):
    out = copy_of(base_run, tmp_path)
    step4, marker = out / "checkpoints" / "step-00000004", tmp_path / "pwned"
    craft(step4, marker)
    proc = subprocess.run([sys.executable, str(REPO / "tools/generate.py"), "--checkpoint", str(step4), "--prompt", "x"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2 and not marker.exists()
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {step4 / STATES} holds something a checkpoint of "
                                                           "cplm-train never does (")
    proc = run_cli(resume_args(small_data, out))
    assert proc.returncode == 2 and not marker.exists(), proc.stderr[-3000:]
    assert "it was not written by cplm-train and is not loaded (it could run code)" in proc.stderr.strip().splitlines()[-1]


def test_an_index_cache_holding_pickles_is_refused(small_data, tmp_path):
    """A cache directory shipped beside a dataset: megatron would numpy.load(allow_pickle=True) it."""
    import numpy as np

    from cplm_dist.config import load_config

    args = argv(small_data, tmp_path / "run", f"data.cache_dir={tmp_path / 'cache'}")
    cfg = load_config(args[1], args[2:])
    run_ranks(_build, 1, args=(cfg, (16, 0, 0)))  # the run's own cache is accepted
    cache = next((tmp_path / "cache").iterdir())
    target = next(cache.glob("*.npy"))
    np.save(target, np.array([_Payload(tmp_path / "pwned")], dtype=object), allow_pickle=True)
    with pytest.raises(RuntimeError, match=r"DataError: index cache .* is not an integer array \(object\)"):
        run_ranks(_build, 1, args=(cfg, (16, 0, 0)))
    assert not (tmp_path / "pwned").exists()


def _build(cfg, samples):
    from cplm_dist.data.gpt_data import build_datasets
    from cplm_dist.distributed import init_distributed

    init_distributed(1)
    return len(build_datasets(cfg, samples).train)


def test_an_out_dir_that_cannot_hold_a_run_is_refused_before_training(small_data, tmp_path):
    """Found at start-up, not at the first save: here an out_dir below a regular file (a
    read-only or full filesystem is refused the same way, by os.access and the free space)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = run_cli(argv(small_data, blocker / "run", "train.train_steps=2"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: train.out_dir={blocker / 'run'}: {blocker} is not a directory: choose another train.out_dir")
    assert blocker.read_text() == "not a directory"
