"""Profiler, sweep, memory estimator, copy-overhead and peer modes run on CPU (1 and 2 ranks)
and report every field; the activation formula equals what autograd keeps. No timed assertions:
figures go to benchmark outputs, not to pass/fail."""

import csv
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from cplm_dist.config import load_config
from cplm_dist.errors import UsageError
from cplm_dist.profiling.memory import estimate, largest_micro_batch, layer_activation_bytes_per_token
from tests.spawn import run_ranks

REPO = Path(__file__).resolve().parent.parent
FIELDS = ["tokens_per_s", "tokens_per_s_per_device", "step_time_s", "forward_s", "backward_s", "optimizer_s",
          "comm_tp_s", "comm_dp_s", "comm_tp_calls", "comm_dp_calls", "tflops_per_device", "mfu", "peak_memory_gb",
          "step_memory_gb", "estimated_memory_gb", "estimate_error", "tp", "dp", "zero", "precision", "seq_len"]


def profile(args, nproc=1, timeout=300):
    cmd = [sys.executable, str(REPO / "tools/cplm_profile.py"), *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *cmd[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else "2"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


QUICK = ["--warmup", "1", "--steps", "2", "--breakdown-steps", "1", "train.micro_batch_size=2", "data.seq_length=64"]


def test_profile_one_rank_writes_json_csv_and_trace(tmp_path):
    out, table = tmp_path / "r.json", tmp_path / "p.csv"
    for label in ("first", "second"):
        proc = profile(["--config", "tiny", *QUICK, "--json", str(out), "--csv", str(table), "--label", label,
                        "--trace", str(tmp_path / "trace.json")])
    result = json.loads(out.read_text())
    for field in FIELDS:
        assert field in result, field
    assert result["tokens_per_s"] > 0 and result["forward_s"] > 0 and result["backward_s"] > 0
    assert result["mfu"] is None  # no peak FLOP/s on CPU
    assert "tokens_per_s_per_device" in proc.stdout
    rows = list(csv.DictReader(open(table)))
    assert [r["label"] for r in rows] == ["first", "second"]
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


@pytest.mark.parametrize("tp", [1, 2])
def test_profile_two_ranks_times_the_right_communication(tmp_path, tp):
    out = tmp_path / "r.json"
    profile(["--config", "tiny", *QUICK, f"parallel.tp={tp}", "train.zero_stage=2", "--json", str(out), "--csv", ""], nproc=2)
    r = json.loads(out.read_text())
    assert (r["tp"], r["dp"], r["world"]) == (tp, 2 // tp, 2)
    if tp == 2:
        assert r["comm_tp_calls"] > 0 and r["comm_tp_mb"] > 0  # megatron's all-reduces
    else:
        assert r["comm_tp_calls"] == 0 and r["comm_dp_calls"] > 0 and r["comm_dp_mb"] > 0  # ZeRO-2's collectives


def test_sweep_skips_points_the_config_refuses_and_refuses_a_grid_of_none():
    """A grid crossing pp with ZeRO holds points training refuses (ZeRO-2 at pp = 2): those are
    skipped with their one-line reason, the others kept; a grid with no valid point is refused."""
    from cplm_dist.profiling.sweep import parse_sweep, sweep_points

    valid, skipped = sweep_points("tiny", [], parse_sweep(["pp=1,2", "zero=1,2"]))
    assert [p for p, _, _ in valid] == [{"pp": "1", "zero": "1"}, {"pp": "1", "zero": "2"}, {"pp": "2", "zero": "1"}]
    assert [(p, r.split(":")[0]) for p, r in skipped] == [({"pp": "2", "zero": "2"}, "train.zero_stage=2 with parallel.pp=2")]
    assert valid[2][2].parallel.pp == 2 and valid[1][2].train.zero_stage == 2
    with pytest.raises(UsageError, match=r"^no valid sweep point: \{'pp': '2', 'zero': '2'\}: train\.zero_stage=2 with parallel\.pp=2"):
        sweep_points("tiny", [], parse_sweep(["pp=2", "zero=2,3"]))


def test_sweep_writes_csv_and_plots(tmp_path):
    # two variables but two points (each point is a fresh launch): both overrides must reach the
    # runs (zero varies; copy=false turns off the tiny config's default gate/next)
    proc = profile(["--config", "tiny", *QUICK, "--sweep", "zero=0,1", "copy=false", "--out-dir", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert [(r["sweep_zero"], r["sweep_copy"]) for r in rows] == [("0", "false"), ("1", "false")]
    assert [(r["zero"], r["copy"]) for r in rows] == [("0", "off"), ("1", "off")]
    for var in ("zero", "copy"):
        png = tmp_path / f"sweep_{var}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "sweep: 2 points" in proc.stdout


def test_peer_reports_ratios(tmp_path):
    """--copy-overhead's ratios are checked on the gpu_check smoke run's tiny-copy-overhead.json."""
    pytest.importorskip("transformers", reason="--peer needs the bench extra (transformers)")
    out = tmp_path / "peer.json"
    profile(["--config", "tiny", *QUICK, "--peer", "--rounds", "1", "--json", str(out), "--csv", ""])
    r = json.loads(out.read_text())
    assert r["hf_llama_tokens_per_s"] > 0 and r["speedup_copy_off_vs_hf"] > 0 and "hf_llama_memory_gb" in r


def test_estimate_bounds_the_measured_step_memory_on_cpu(tmp_path):
    """The activation-dominated quickstart shape (states are small): the estimate must not fall
    below the measured step memory (the peak resident set above the pre-model baseline, the
    kernel's high-water mark) and may exceed it by less than 25%. It sums phases that do not all
    coexist (the loss's softmax buffer is freed before the layers' backward, whose gradients it
    also counts), so it is an upper bound here: measured +14.8% on an AVX-512 Xeon and +17.2% on
    an AVX2 EPYC (the resident set, unlike the estimate, depends on the CPU's kernels and glibc);
    on an H200 at 1.7B, +3.3-3.8% of the eager peak (docs/performance.md)."""
    out = tmp_path / "m.json"
    profile(["--config", "tiny", "model.vocab_size=4096", "train.precision=fp32", "train.zero_stage=0",
             "train.micro_batch_size=16", "data.seq_length=512", "--warmup", "1", "--steps", "2",
             "--breakdown-steps", "0", "--json", str(out), "--csv", ""])
    r = json.loads(out.read_text())
    assert 0 <= r["estimate_error"] < 0.25, r


def _saved_bytes_worker(precision, arch):
    from cplm_dist.model import build_model
    from cplm_dist.model.rotary import layer_rope
    from cplm_dist.parallel import init_distributed

    dims = init_distributed(2 if precision.startswith("fp32-tp2") else 1)
    sp = precision.endswith("-sp")
    cfg = load_config("tiny", ["model.num_layers=1", f"parallel.tp={dims.tp_size}", "model.ffn_hidden_size=384",
                               f"parallel.sequence_parallel={str(sp).lower()}", f"model.arch={arch}"])
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = build_model(cfg).to(dtype)
    B, T = 3, 40
    shape = (T // dims.tp_size, B) if sp else (B, T)  # sequence parallel: this rank's positions, sequence first
    x = torch.randn(*shape, cfg.model.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = layer_rope(cfg.model, T)  # gpt2: None, None
    exclude = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *(t for t in (cos, sin) if t is not None)]}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers[0](x, cos, sin)
    return sum(storages.values()) / (B * T), dims.tp_size


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("precision,act_bytes,world", [("fp32", 4, 1), ("bf16", 2, 1), ("fp32-tp2", 4, 2),
                                                       ("fp32-tp2-sp", 4, 2)])
def test_layer_activation_formula_equals_what_autograd_keeps(precision, act_bytes, world, arch):
    """Also under sequence parallelism, where the norms keep T/tp positions; both backbones."""
    measured, tp = run_ranks(_saved_bytes_worker, world, args=(precision, arch))[0]
    sp = str(precision.endswith("-sp")).lower()
    cfg = load_config("tiny", ["model.ffn_hidden_size=384", f"parallel.sequence_parallel={sp}", f"model.arch={arch}"])
    # in bf16 each of the two norms also keeps an fp32 copy of its weight (and gpt2's of its bias)
    per_layer_constant = (2 if arch == "gpt2" else 1) * 2 * 4 * cfg.model.hidden_size if act_bytes == 2 else 0
    assert measured * 120 == layer_activation_bytes_per_token(cfg, tp, act_bytes) * 120 + per_layer_constant


def _forward_saved_bytes_worker():
    """Bytes autograd keeps from one whole forward (loss included) per rank at tp = 2, without and
    with sequence parallelism, parameters excluded; and the tp collectives the profiler's timer
    counts in a forward and backward."""
    from cplm_dist.model import build_model
    from cplm_dist.parallel import init_distributed
    from cplm_dist.profiling.measure import CommTimer

    dims = init_distributed(2)
    saved, tp_calls = {}, {}
    for sp in (False, True):
        cfg = load_config("tiny", ["parallel.tp=2", f"parallel.sequence_parallel={str(sp).lower()}", "model.vocab_size=4096"])
        model = build_model(cfg)
        exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in exclude:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(0, cfg.model.vocab_size, (8, 512), generator=torch.Generator().manual_seed(0))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids)
        saved[sp] = sum(storages.values())
        with CommTimer(dims, torch.device("cpu")) as timer:
            model(ids[:1, :64]).nll.sum().backward()
        tp_calls[sp] = timer.calls["tp"]
    return saved, tp_calls


def test_sequence_parallel_divides_the_sequence_sharded_activations_as_estimated():
    """tp = 2 (the shape of docs/parallelism.md's memory row, micro 8): what one forward keeps for
    backward falls by the norms' share (half of it moves to the other rank), and the estimator's
    activations + loss buffer + copy-head q, k, A, M land within 15% of the measured bytes, with
    and without sequence parallelism, and so does the saving."""
    saved, tp_calls = run_ranks(_forward_saved_bytes_worker, 2)[0]
    # each layer's two all-reduces become all-gather + reduce-scatter pairs (megatron-core calls them
    # through its own names): the profiler's timer must see them
    assert tp_calls[True] >= tp_calls[False] + 2 * load_config("tiny").model.num_layers, tp_calls
    predicted = {}
    for sp in (False, True):
        cfg = load_config("tiny", ["parallel.tp=2", f"parallel.sequence_parallel={str(sp).lower()}", "model.vocab_size=4096",
                                   "train.precision=fp32"])
        e = estimate(cfg, tp=2, dp=1, micro_batch=8, seq_len=512)
        c, rows = cfg.copy, 8 * 512 // (2 if sp else 1)
        copy_kept = 8 * 512 * 4 * c.num_heads * c.head_dim + rows * 4 * c.num_heads * (c.head_dim + 2)  # k; q, A, M
        predicted[sp] = e.activations + e.logits + copy_kept
        assert abs(saved[sp] / predicted[sp] - 1) < 0.15, (sp, saved[sp], predicted[sp])
    assert saved[True] < saved[False]
    measured_saving, predicted_saving = saved[False] - saved[True], predicted[False] - predicted[True]
    assert abs(measured_saving / predicted_saving - 1) < 0.15, (measured_saving, predicted_saving)


def test_estimator_arithmetic_and_cli():
    cfg = load_config("cplm-1.7b", ["train.precision=bf16"])
    e0 = estimate(cfg, tp=1, dp=8, micro_batch=4, seq_len=2048, zero=0)
    e1 = estimate(cfg, tp=1, dp=8, micro_batch=4, seq_len=2048, zero=1)
    e3 = estimate(cfg, tp=1, dp=8, micro_batch=4, seq_len=2048, zero=3)
    n = 1_713_475_585
    assert e0.parameters == pytest.approx(2 * n, rel=1e-3) and e0.optimizer == pytest.approx(12 * n, rel=1e-3)
    assert e1.optimizer == pytest.approx(e0.optimizer / 8) and e3.parameters == pytest.approx(e0.parameters / 8)
    ckpt = estimate(cfg, tp=1, dp=8, micro_batch=4, seq_len=2048, activation_checkpointing=True)
    assert ckpt.activations < e1.activations / 10
    assert largest_micro_batch(cfg, 80 * 1024**3, tp=1, dp=8, seq_len=2048, activation_checkpointing=True) > \
        largest_micro_batch(cfg, 80 * 1024**3, tp=1, dp=8, seq_len=2048, activation_checkpointing=False) >= 1
    proc = subprocess.run([sys.executable, str(REPO / "tools/estimate_memory.py"), "--config", "cplm-1.7b", "--dp", "16",
                           "--micro-batch", "8", "--seq-len", "2048"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for key in ("parameters", "gradients", "optimizer", "activations", "logits", "copy_head", "total", "largest micro-batch"):
        assert key in proc.stdout, key


def test_gpu_check_script_runs_end_to_end_in_smoke_mode(tmp_path, trained):
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_SMOKE": "1", "PYTHON": sys.executable, "OMP_NUM_THREADS": "2",
           "GPU_CHECK_EVAL_CHECKPOINT": str(trained)}
    proc = subprocess.run(["bash", str(REPO / "tools/gpu_check.sh")], capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert (tmp_path / "failures.txt").read_text() == ""
    table = (tmp_path / "table.md").read_text().splitlines()
    # smoke mode: the tiny config alone (ZeRO-1, copy overhead, chunked loss at ZeRO-2), in the script's order
    assert len(table) == 2 + 3 and table[2].startswith("| tiny-zero1 |") and "tiny-copy-overhead" in table[3], table
    assert table[4].startswith("| tiny-chunked-loss |") and "| 2 | fp32 |" in table[4]
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
        assert {"tiny-zero1.json", "tiny-copy-overhead.json", "tiny-chunked-loss.json", "profile.csv"} <= names
        copy = json.load(tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("tiny-copy-overhead.json"))))
    # --copy-overhead: copy on against copy off, measured and estimated
    assert copy["mode"] == "copy-overhead" and copy["step_time_ratio"] > 0 and "memory_difference_gb" in copy
    assert copy["estimated_memory_difference_gb"] > 0
    assert len([p for p in tmp_path.iterdir()]) <= 8  # the device returns at most 8 files
    decode_rows = (tmp_path / "decode.md").read_text().splitlines()
    assert len(decode_rows) == 3 and decode_rows[2].startswith("| 1 | 16 | 4 |"), decode_rows
    # lm-eval ran on the checkpoint (evaluate and generate run on the GPU only: test_evaluation.py
    # runs those commands here); the adapter's requests/s at batch 1 and 2
    log = (tmp_path / "log.txt").read_text()
    for step in ("== lm-eval (", "== lm-eval requests/s"):
        assert step in log, step
    assert "cplm_kv_mc" in log and "exact_match" in log
    bench = (tmp_path / "lm_eval.md").read_text().splitlines()
    assert len(bench) == 6 and bench[0].startswith("batch   1  loglikelihood") and "req/s" in bench[-1], bench


def test_copy_head_bench_reports_both_paths_their_agreement_and_the_estimate(tmp_path):
    """tools/bench_copy_head.py: dense and chunked points, each in its own process; the chunked
    path agrees with the dense one, and the estimator's copy-head term is near the measured peak."""
    out = tmp_path / "copy.json"
    bench = [sys.executable, str(REPO / "tools/bench_copy_head.py"), "--seq-lens", "1024", "--chunk", "128"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([*bench, "--repeat", "2", "--json", str(out), "--check", "1e-4"], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["seq_len"], r["impl"]) for r in rows] == [(1024, "dense"), (1024, "chunked")]
    assert rows[0]["max_abs_diff_lse"] is None  # dense is the reference
    assert rows[1]["max_abs_diff_lse"] < 1e-4 and rows[1]["max_rel_diff_grad"] < 1e-4, rows[1]
    for r in rows:
        assert r["seconds"] > 0 and r["peak_mb"] > 0
        assert 0.7 < r["estimated_mb"] / r["peak_mb"] < 1.5, r
    assert "| 1024 | chunked (128) |" in proc.stdout
    flex = subprocess.run([*bench, "--impls", "chunked", "flex", "--device", "cpu"], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)
    assert flex.returncode == 2 and flex.stderr.strip().endswith("--impls flex needs a CUDA --device: FlexAttention has no CPU backward"), flex.stderr
