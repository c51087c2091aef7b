"""A long run surviving its job chain (docs/reliability.md): the Slurm scripts count planned and
crash requeues apart; a reshape's conversion waits outside the collective timeout and within its
own; checkpoints kept by keep_every and before a WSD decay; the async-save memory check reads the
job's cgroup; tools/chaos.py's weight comparison reads a pipeline checkpoint's layer files."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from cplm_dist.checkpoint.host_memory import available_memory
from cplm_dist.checkpoint.pruning import decay_start, tags_to_delete
from cplm_dist.checkpoint.safe_io import same_weights
from cplm_dist.config import load_config
from tests.spawn import run_ranks
from tests.test_train import argv, losses, train

REPO = Path(__file__).resolve().parent.parent
GiB = 1 << 30

# --- Slurm: planned and crash requeues counted apart ------------------------------------------------

FAKE_SRUN = """#!/bin/bash
if [ "$FAKE_RC" = wait ]; then
  trap 'echo saved >> "$FAKE/ranks.log"; exit 0' USR1 TERM
  echo $$ > "$FAKE/srun.pid"  # after the trap: the test signals once this file is there
  for _ in $(seq 600); do sleep 0.05; done  # a bound: never outlives the test
  exit 9
fi
echo $$ > "$FAKE/srun.pid"
exit "$FAKE_RC"
"""


def _job(tmp_path: Path, script: str, restart: int, rc: str, max_requeues: int = 2):
    """One start of the batch script as Slurm runs it, with stand-ins for Slurm's srun (exits `rc`,
    or waits for a signal: "wait") and scontrol (records its arguments). (exit code, output, scontrol calls)."""
    fake = tmp_path / "fake"
    (fake / "bin").mkdir(parents=True, exist_ok=True)
    (fake / "bin" / "srun").write_text(FAKE_SRUN)
    (fake / "bin" / "scontrol").write_text('#!/bin/bash\necho "$*" >> "$FAKE/scontrol.log"\n')
    for tool in ("srun", "scontrol"):
        (fake / "bin" / tool).chmod(0o755)
    (fake / "scontrol.log").unlink(missing_ok=True)
    (fake / "srun.pid").unlink(missing_ok=True)
    (tmp_path / "submit").mkdir(exist_ok=True)
    env = {"PATH": f"{fake / 'bin'}:/usr/bin:/bin", "FAKE": str(fake), "FAKE_RC": rc, "CPLM_ROOT": str(REPO),
           "PYTHON": "/bin/false", "SLURM_SUBMIT_DIR": str(tmp_path / "submit"), "SLURM_JOB_ID": "77",
           "SLURM_RESTART_COUNT": str(restart), "SLURM_JOB_NODELIST": "node1", "SLURM_NTASKS": "1",
           "SLURM_JOB_NUM_NODES": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
           "CPLM_MAX_REQUEUES": str(max_requeues)}
    proc = subprocess.Popen(["bash", str(REPO / "launch" / script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if rc == "wait":  # the time limit's warning, once the ranks run
        deadline = time.monotonic() + 60
        while not (fake / "srun.pid").is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
    output, _ = proc.communicate(timeout=60)
    calls = (fake / "scontrol.log").read_text().splitlines() if (fake / "scontrol.log").is_file() else []
    return proc.returncode, output, calls


@pytest.mark.parametrize("script", ["slurm.sbatch", "slurm-torchrun.sbatch"])
def test_time_limit_requeues_leave_the_crash_budget_whole(tmp_path, script):
    """A job with CPLM_MAX_REQUEUES=2 requeued three times at its time limit (restarts 0-2, the
    ranks save on the signal) still has both crash requeues (restarts 3 and 4); the third crash,
    and any usage error, ends it. Counting every restart, as before, would have refused the first crash."""
    for restart in range(3):
        code, output, calls = _job(tmp_path, script, restart, "wait")
        assert code == 0 and calls == ["requeue 77"], output
        assert "SIGUSR1 received: ranks save a checkpoint" in output
    assert (tmp_path / "fake" / "ranks.log").read_text().count("saved") == 3
    log = (tmp_path / "submit" / ".cplm-requeues" / "job-77").read_text().splitlines()
    assert [line.split()[:3] for line in log] == [["planned", str(r), "SIGUSR1"] for r in range(3)]
    code, output, calls = _job(tmp_path, script, 3, "2")  # a usage error: never requeued
    assert code == 2 and calls == [], output
    for restart, rc, nth in ((3, "1", 1), (4, "4", 2)):
        code, output, calls = _job(tmp_path, script, restart, rc)
        assert code == 0 and calls == ["requeue 77"], output
        assert f"(restart {nth} of at most 2) after a crash; 3 planned requeues" in output, output
    code, output, calls = _job(tmp_path, script, 5, "137")
    assert code == 137 and calls == [], output
    assert "not requeued, the job's 2 crash requeues reached CPLM_MAX_REQUEUES=2 (3 planned" in output, output


def test_a_requeue_nothing_recorded_counts_as_a_crash(tmp_path):
    """Slurm's own requeue (a node failure) and a requeue log that cannot be written: the restarts
    nothing recorded as planned count against the crash budget, the bound of old."""
    code, output, calls = _job(tmp_path, "slurm.sbatch", 2, "1")  # restarts 0 and 1 were never recorded
    assert code == 1 and calls == [] and "2 crash requeues reached CPLM_MAX_REQUEUES=2" in output, output
    (tmp_path / "submit").mkdir(exist_ok=True)
    (tmp_path / "submit" / ".cplm-requeues").write_text("a file where the log's directory should be")
    code, output, calls = _job(tmp_path, "slurm.sbatch", 0, "wait")
    assert code == 0 and calls == ["requeue 77"] and "cannot write the requeue log" in output, output
    code, output, calls = _job(tmp_path, "slurm.sbatch", 1, "1", max_requeues=1)
    assert code == 1 and calls == [], output


# --- the reshape conversion: its own timeout, not the collective one ------------------------------


def test_a_reshape_longer_than_the_collective_timeout_waits_within_its_own(small_data, tmp_path):
    """One rank saves at step 2; two ranks continue at tp=2 with --reshape while rank 0's
    conversion is slowed by 9 s (the test-only fault-injection hook) under a collective timeout of
    6 s: the other rank waits on the marker file, not in a collective, and the run trains on."""
    common = ("train.global_batch_size=4", "train.micro_batch_size=4")
    assert train(1, argv(small_data, tmp_path / "saved", *common, "train.train_steps=2")) == [0]
    source = tmp_path / "saved" / "checkpoints" / "step-00000002"
    args = argv(small_data, tmp_path / "tp2", *common, "parallel.tp=2", "train.train_steps=3",
                "train.collective_timeout_minutes=0.1") + ["--resume", str(source), "--reshape"]
    assert train(2, args, env={"CPLM_FAULT_SLOW_RESHAPE_S": "9"}) == [0, 0]
    assert sorted(losses(tmp_path / "tp2")) == [3]
    assert not [p.name for p in (tmp_path / "tp2").iterdir() if p.name.startswith(".reshape")]


def _late_conversion(marker):
    from cplm_dist.checkpoint.rank_zero_work import rank_zero_does
    from cplm_dist.distributed import init_distributed
    from cplm_dist.errors import CheckpointError

    dims = init_distributed(1)
    try:
        rank_zero_does(lambda: time.sleep(4), marker, dims.rank, dims.world_size, 0.02, "converting step-00000002")
    except CheckpointError as e:
        return str(e)
    return None


def test_a_conversion_longer_than_its_own_timeout_is_one_line_on_every_rank(tmp_path):
    """rank 0's work takes 4 s against train.reshape_timeout_minutes=0.02 (1.2 s): the waiting rank
    gives up at its bound, rank 0 when its work ends, both with the same line."""
    first, other = run_ranks(_late_conversion, 2, args=(tmp_path / "marker",))
    assert first == other == ("converting step-00000002 took longer than train.reshape_timeout_minutes=0.02 on rank 0: "
                              "raise train.reshape_timeout_minutes (the conversion reads and writes the whole "
                              "checkpoint with its optimizer states) and resume again")


# --- pruning -----------------------------------------------------------------------------------------


def test_pruning_keeps_the_last_n_every_kth_and_the_one_before_a_wsd_decay():
    tags = [f"step-{s:08d}" for s in (100, 200, 300, 400, 500, 600)]
    steps = lambda ts: [int(t[5:]) for t in ts]  # noqa: E731
    assert steps(tags_to_delete(tags, tags[-1], keep_last=2)) == [100, 200, 300, 400]
    assert steps(tags_to_delete(tags, tags[-1], keep_last=1, keep_every=200)) == [100, 300, 500]
    assert steps(tags_to_delete(tags, tags[-1], keep_last=1, before_decay=450)) == [100, 200, 300, 500]
    assert steps(tags_to_delete(tags[:3], tags[2], keep_last=1, before_decay=450)) == [100, 200]  # before it: the newest
    wsd = load_config("tiny", ["optim.schedule=wsd", "train.train_steps=1000", "optim.decay_fraction=0.2"])
    assert decay_start(wsd) == 800 and decay_start(load_config("tiny", ["optim.schedule=cosine"])) is None


def test_a_run_keeps_every_kth_checkpoint_and_the_last_before_its_decay(small_data, tmp_path):
    """6 steps saved every step with keep_last=1, keep_every=4 and a WSD decay from step 3 on."""
    out = tmp_path / "run"
    args = argv(small_data, out, "train.train_steps=6", "train.save_interval=1", "train.keep_last=1",
                "train.keep_every=4", "optim.schedule=wsd", "optim.decay_fraction=0.5")
    assert train(1, args) == [0]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == [
        "step-00000003", "step-00000004", "step-00000006"]


# --- the async save's memory: the job's cgroup --------------------------------------------------


def _write(root: Path, files: dict) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_available_memory_is_the_least_room_under_any_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {200 * GiB // 1024} kB\nMemAvailable: {100 * GiB // 1024} kB\n")
    v2 = tmp_path / "v2"
    _write(v2, {"cgroup.controllers": "cpu memory", "memory.max": "max",
                "job_1/memory.max": str(8 * GiB), "job_1/memory.current": str(6 * GiB),
                "job_1/memory.stat": f"anon {5 * GiB}\ninactive_file {GiB}\n",
                "job_1/step_0/memory.max": "max", "job_1/step_0/memory.current": str(6 * GiB)})
    (tmp_path / "self").write_text("0::/job_1/step_0\n")
    assert available_memory(meminfo, v2, tmp_path / "self") == 3 * GiB  # the job's 8 GiB - 6 GiB + cache
    _write(v2, {"job_1/step_0/memory.max": str(int(2.5 * GiB)), "job_1/step_0/memory.current": str(GiB)})
    assert available_memory(meminfo, v2, tmp_path / "self") == int(1.5 * GiB)  # the step's own, lower
    (tmp_path / "self").write_text("0::/elsewhere\n")  # a namespaced view: our cgroup is the root we see
    assert available_memory(meminfo, v2, tmp_path / "self") == 100 * GiB
    v1 = tmp_path / "v1"
    _write(v1, {"memory/memory.limit_in_bytes": "9223372036854771712",
                "memory/slurm/job_2/memory.limit_in_bytes": str(4 * GiB),
                "memory/slurm/job_2/memory.usage_in_bytes": str(GiB),
                "memory/slurm/job_2/memory.stat": "total_inactive_file 0\n"})
    (tmp_path / "self").write_text("5:cpu,cpuacct:/slurm/job_2\n4:memory:/slurm/job_2\n0::/\n")  # hybrid: v1 decides
    assert available_memory(meminfo, v1, tmp_path / "self") == 3 * GiB
    assert available_memory(meminfo, tmp_path / "none", tmp_path / "self") == 100 * GiB  # no cgroup: the node's
    assert available_memory(tmp_path / "no-meminfo", tmp_path / "none", tmp_path / "none") is None


# --- tools/chaos.py's judge: pipeline checkpoints ---------------------------------------------------


def test_same_weights_compares_a_pipeline_checkpoint_by_its_layer_files(tmp_path):
    """DeepSpeed's pipeline save: model-states files whose "module" is None, the weights in
    layer_*-model_*-model_states.pt. Equal copies are equal (3 tensors); one bit changed is not;
    without a pipeline, the "module" is compared as before."""
    torch.manual_seed(0)
    layers = {"layer_00-model_00-model_states.pt": {"embedding.weight": torch.randn(4, 3)},
              "layer_01-model_00-model_states.pt": {"w": torch.randn(3, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}}
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        torch.save({"module": None, "lr_scheduler": {}}, tmp_path / name / "mp_rank_00_model_states.pt")
        for file, state in layers.items():
            torch.save({k: v.clone() for k, v in state.items()}, tmp_path / name / file)
    changed = torch.load(tmp_path / "c" / "layer_01-model_00-model_states.pt")
    changed["w"].view(torch.int32)[1, 1] ^= 1
    torch.save(changed, tmp_path / "c" / "layer_01-model_00-model_states.pt")
    assert same_weights(tmp_path / "a", tmp_path / "b") == (True, 3)
    assert same_weights(tmp_path / "a", tmp_path / "c") == (False, 3)
    os.remove(tmp_path / "b" / "layer_01-model_00-model_states.pt")
    assert same_weights(tmp_path / "a", tmp_path / "b") == (False, 0)
    for name in ("d", "e"):  # no pipeline: the weights are the model-states files' "module"
        (tmp_path / name).mkdir()
        torch.save({"module": {k: v.clone() for state in layers.values() for k, v in state.items()}},
                   tmp_path / name / "mp_rank_00_model_states.pt")
    assert same_weights(tmp_path / "d", tmp_path / "e") == (True, 3)
