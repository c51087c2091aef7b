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
FIELDS = ["tokens_per_s", "tokens_per_s_per_device", "step_time_s", "forward_s", "backward_s", "optimizer_s", "optimizer_share",
          "comm_tp_s", "comm_dp_s", "comm_cp_s", "comm_cp_mb", "comm_cp_calls", "cp", "comm_tp_calls", "comm_dp_calls", "tflops_per_device", "mfu", "peak_memory_gb",
          "step_memory_gb", "estimated_memory_gb", "estimate_error", "tp", "dp", "zero", "precision", "seq_len"]


def profile(args, nproc=1, timeout=300):
    cmd = [sys.executable, str(REPO / "tools/cplm_profile.py"), *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *cmd[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else "2"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


STEPS = ["--warmup", "1", "--steps", "2", "--breakdown-steps", "1", "train.micro_batch_size=2", "data.seq_length=64"]
QUICK = [*STEPS, "--accumulation", "1"]


def test_profile_one_rank_writes_json_csv_and_trace(tmp_path):
    out, table = tmp_path / "r.json", tmp_path / "p.csv"
    for label, batch in (("first", QUICK), ("second", [*STEPS, "train.global_batch_size=4"])):
        proc = profile(["--config", "tiny", *batch, "--json", str(out), "--csv", str(table), "--label", label,
                        "--trace", str(tmp_path / "trace.json")])
    result = json.loads(out.read_text())
    assert result["accumulation"] == 2  # without --accumulation: the config's global batch, as the run steps
    for field in FIELDS:
        assert field in result, field
    assert result["tokens_per_s"] > 0 and result["forward_s"] > 0 and result["backward_s"] > 0
    assert result["mfu"] is None  # no peak FLOP/s on CPU
    assert "tokens_per_s_per_device" in proc.stdout
    rows = list(csv.DictReader(open(table)))
    assert [r["label"] for r in rows] == ["first", "second"]
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2)])
def test_profile_two_ranks_times_the_right_communication(tmp_path, tp, ep):
    """tp 2: megatron's all-reduces under tp; dp 2: ZeRO-2's collectives under dp; a sparse model
    at ep 2: the dispatcher's token all-to-alls under ep (tools/bench_moe.py reads them)."""
    out = tmp_path / "r.json"
    sparse = ["model.moe.num_experts=4", f"parallel.ep={ep}"] if ep > 1 else []
    profile(["--config", "tiny", *QUICK, f"parallel.tp={tp}", "train.zero_stage=2", *sparse, "--json", str(out), "--csv", ""], nproc=2)
    r = json.loads(out.read_text())
    assert (r["tp"], r["dp"], r["world"], r["ep"]) == (tp, 2 // tp, 2, ep)
    if tp == 2:
        assert r["comm_tp_calls"] > 0 and r["comm_tp_mb"] > 0  # megatron's all-reduces
    else:
        assert r["comm_tp_calls"] == 0 and r["comm_dp_calls"] > 0 and r["comm_dp_mb"] > 0  # ZeRO-2's collectives
    if ep > 1:
        assert r["comm_ep_calls"] > 0 and r["comm_ep_mb"] > 0 and r["experts"] == 4
        assert r["active_parameters"] < r["parameters"]
        assert any(k.startswith("ep/all_to_all") for k in r["comm_by_collective"])
    else:
        assert r["comm_ep_calls"] == 0


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


def test_sweep_crosses_cp_with_pp():
    """--sweep cp=: parallel.cp points (launched on tp x cp x pp processes); cp x pp composes now."""
    from cplm_dist.profiling.sweep import parse_sweep, sweep_points

    valid, skipped = sweep_points("tiny", [], parse_sweep(["cp=1,2", "pp=1,2"]))
    assert [p for p, _, _ in valid] == [{"cp": "1", "pp": "1"}, {"cp": "1", "pp": "2"},
                                        {"cp": "2", "pp": "1"}, {"cp": "2", "pp": "2"}] and skipped == []
    assert (valid[3][2].parallel.cp, valid[3][2].parallel.pp) == (2, 2)


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
             "train.micro_batch_size=16", "data.seq_length=512", "--warmup", "1", "--steps", "2", "--accumulation", "1",
             "--breakdown-steps", "0", "--json", str(out), "--csv", ""])
    r = json.loads(out.read_text())
    assert 0 <= r["estimate_error"] < 0.25, r


# per backbone, what its tiny config changes: qwen3's heads of model.head_dim = 24, q 192 wide beside hidden 128
ARCH = {"llama": [], "gpt2": [], "qwen3": ["model.head_dim=24"]}


def _saved_bytes_worker(precision, arch):
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model
    from cplm_dist.model.positions import layer_rope

    dims = init_distributed(2 if precision.startswith("fp32-tp2") else 1)
    sp = precision.endswith("-sp")
    cfg = load_config("tiny", ["model.num_layers=1", f"parallel.tp={dims.tp_size}", "model.ffn_hidden_size=384",
                               f"parallel.sequence_parallel={str(sp).lower()}", f"model.arch={arch}", *ARCH[arch]])
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

    masks = model.core_attention.masks(None, 0, T, x.device)  # causal
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers[0](x, cos, sin, masks)
    return sum(storages.values()) / (B * T), dims.tp_size


@pytest.mark.parametrize("arch", sorted(ARCH))
@pytest.mark.parametrize("precision,act_bytes,world", [("fp32", 4, 1), ("bf16", 2, 1), ("fp32-tp2", 4, 2),
                                                       ("fp32-tp2-sp", 4, 2)])
def test_layer_activation_formula_equals_what_autograd_keeps(precision, act_bytes, world, arch):
    """Also under sequence parallelism, where the norms keep T/tp positions; every backbone (qwen3's
    qk-norm, grouped heads)."""
    measured, tp = run_ranks(_saved_bytes_worker, world, args=(precision, arch))[0]
    sp = str(precision.endswith("-sp")).lower()
    cfg = load_config("tiny", ["model.ffn_hidden_size=384", f"parallel.sequence_parallel={sp}", f"model.arch={arch}", *ARCH[arch]])
    # in bf16 each of the two norms also keeps an fp32 copy of its weight (and gpt2's of its bias), and
    # the qk-norm (qwen3) of its two head_dim weights
    per_layer_constant = (2 if arch == "gpt2" else 1) * 2 * 4 * cfg.model.hidden_size if act_bytes == 2 else 0
    per_layer_constant += 2 * 4 * cfg.model.head_dim if act_bytes == 2 and arch == "qwen3" else 0
    assert measured * 120 == layer_activation_bytes_per_token(cfg, tp, act_bytes) * 120 + per_layer_constant


# a sparse MLP's cases: (precision, overrides); softmax with the balancing loss, sigmoid with the expert bias and a
# shared expert in bf16, and neither balancing loss nor a shared expert
SPARSE_CASES = [("fp32", ["model.moe.top_k=2"]),
                ("bf16", ["model.moe.score=sigmoid", "model.moe.expert_bias=true", "model.moe.shared_ffn_hidden_size=96"]),
                ("fp32", ["model.moe.top_k=4", "model.moe.aux_loss_coeff=0", "model.moe.num_experts=16"])]


def _sparse_cfg(extra):
    return load_config("tiny", ["model.num_layers=1", "model.moe.num_experts=8", "model.moe.ffn_hidden_size=64",
                                "model.moe.expert_impl=sequential", *extra])


def _sparse_saved_bytes_worker():
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model

    init_distributed(1)
    out = []
    for precision, extra in SPARSE_CASES:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        model = build_model(_sparse_cfg(extra)).to(dtype).train()
        x = torch.randn(2, 32, 128, dtype=dtype, requires_grad=True)
        exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
        out.append(_storage_bytes(lambda: model.layers[0].mlp(x), exclude) / 64)
    return out


def test_sparse_mlp_formula_is_what_autograd_keeps():
    """A sparse MLP (megatron's MoE layer, one rank, dropless: tokens x top_k rows whatever the
    routing) keeps for backward what expert_cost.sparse_mlp_bytes_per_token says, per token, to
    0.5% (the expert counts, E int64 a layer, and in bf16 a few bytes of the shared expert's aside)."""
    from cplm_dist.profiling.expert_cost import sparse_mlp_bytes_per_token

    measured = run_ranks(_sparse_saved_bytes_worker, 1)[0]
    for (precision, extra), got in zip(SPARSE_CASES, measured):
        predicted = sparse_mlp_bytes_per_token(_sparse_cfg(extra), 1, 2 if precision == "bf16" else 4)
        assert abs(got / predicted - 1) < 0.005, (extra, got, predicted)


# (arch, precision, tp, sequence parallel, extra overrides) of one layer's saved bytes at cp = 2, in one 4-rank job
CP_LAYER_CASES = [("llama", "fp32", 1, False, []), ("llama", "bf16", 1, False, []), ("gpt2", "fp32", 1, False, []),
                  ("gpt2", "fp32", 1, False, ["model.num_kv_heads=8"]), ("llama", "fp32", 2, True, []),
                  ("qwen3", "fp32", 1, False, ARCH["qwen3"]), ("qwen3", "bf16", 1, False, ARCH["qwen3"]),
                  ("qwen3", "fp32", 2, True, ARCH["qwen3"] + ["model.num_kv_heads=8"])]
CP_SEQ, CP_BATCH = 48, 3


def _cp_config(arch, tp, sp, extra, layers=1):
    return load_config("tiny", [f"model.num_layers={layers}", f"parallel.tp={tp}", "parallel.cp=2", "model.ffn_hidden_size=384",
                                f"model.arch={arch}", f"parallel.sequence_parallel={str(sp).lower()}",
                                f"data.seq_length={CP_SEQ}", *extra])


def _storage_bytes(fn, exclude):
    """Bytes of the distinct storages autograd saves while fn() runs (those in `exclude` left out)."""
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def _cp_saved_bytes_worker():
    """At cp = 2 (4 ranks: cp 2 x dp 2, then tp 2 x cp 2 with sequence parallelism): the bytes one
    layer saves for backward per token of this rank, and a whole tiny model's forward."""
    from cplm_dist.distributed import init_distributed
    from cplm_dist.megatron_compat import parallel_state
    from cplm_dist.model import build_model
    from cplm_dist.model.parallel.context import ContextShard, context_inputs
    from cplm_dist.model.positions import layer_rope

    out, whole = {}, None
    for tp in (1, 2):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dims = init_distributed(tp, cp_size=2)
        shard = ContextShard(dims.cp_rank, 2, dims.cp_group)
        ids = torch.randint(0, 500, (CP_BATCH, CP_SEQ), generator=torch.Generator().manual_seed(0))
        for i, (arch, precision, case_tp, sp, extra) in enumerate(CP_LAYER_CASES):
            if case_tp != tp:
                continue
            cfg = _cp_config(arch, tp, sp, extra)
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            model = build_model(cfg).to(dtype)
            inputs = context_inputs(shard, shard.take(ids), None)
            local = CP_SEQ // 2
            x = torch.randn(*((local // tp, CP_BATCH) if sp else (CP_BATCH, local)), cfg.model.hidden_size, dtype=dtype,
                            requires_grad=True)
            cos, sin = layer_rope(cfg.model, local, 0, position_ids=inputs.positions)
            exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *(t for t in (cos, sin) if t is not None)]}
            masks = model.core_attention.masks(inputs.docs, 0, local, x.device)  # this rank's two chunks
            out[i] = _storage_bytes(lambda: model.layers[0](x, cos, sin, masks), exclude)
        if tp == 1:  # a whole forward, loss included: what the estimator's activations, logits and copy head keep
            cfg = _cp_config("llama", 1, False, ["model.vocab_size=4096", "train.precision=fp32"], layers=2)
            model = build_model(cfg)
            big = torch.randint(0, 4096, (8, 512), generator=torch.Generator().manual_seed(0))
            labels = torch.cat([big[:, 1:], torch.full_like(big[:, :1], -100)], 1)
            cfg.data.seq_length = 512
            whole = _storage_bytes(lambda: model(shard.take(big), shard.take(labels)),
                                   {p.untyped_storage().data_ptr() for p in model.parameters()})
    return out, whole


def test_context_parallel_activations_equal_what_autograd_keeps():
    """cp = 2: one layer's saved bytes equal layer_activation_bytes_per_token(cp=2) per token plus
    the gathers' reorderings (16 T) and CPU SDPA's float copies of the two chunks' masks (not
    estimated: CUDA runs block masks), for both backbones, GQA and MHA, fp32 and bf16 and tp 2 with
    sequence parallelism; a whole forward is within 15% of the estimate's activations + logits +
    the copy head's q, k, A, M, and falls about as 1/cp."""
    from cplm_dist.profiling.memory import CP_ORDER_BYTES

    measured, whole = run_ranks(_cp_saved_bytes_worker, 4, timeout=300)[0]
    for i, (arch, precision, tp, sp, extra) in enumerate(CP_LAYER_CASES):
        cfg = _cp_config(arch, tp, sp, extra)
        b = 2 if precision == "bf16" else 4
        tokens = CP_BATCH * CP_SEQ // 2
        c = CP_SEQ // 4  # the chunk: T / (2 cp)
        masks = b * (2 * 2 + 1) * c * c  # rows x keys of the two chunks, (cp rank r + 1) c and (2 cp - r) c keys
        norm_copies = (2 if arch == "gpt2" else 1) * 2 * 4 * cfg.model.hidden_size if b == 2 else 0
        norm_copies += 2 * 4 * cfg.model.head_dim if b == 2 and arch == "qwen3" else 0  # the qk-norm's two weights
        predicted = layer_activation_bytes_per_token(cfg, tp, b, cp=2) * tokens + CP_ORDER_BYTES * CP_SEQ
        assert measured[i] == predicted + masks + norm_copies, (CP_LAYER_CASES[i], measured[i], predicted)
    cfg = _cp_config("llama", 1, False, ["model.vocab_size=4096", "train.precision=fp32", "data.seq_length=512"], layers=2)
    e, flat = (estimate(cfg, tp=1, dp=2, micro_batch=8, seq_len=512, cp=cp) for cp in (2, 1))
    h, d, rows = cfg.copy.num_heads, cfg.copy.head_dim, 8 * 512 // 2
    copy_kept = 8 * 512 * 4 * h * d + rows * 4 * h * (d + 2)  # the gathered k; q, A, M of this rank's rows
    predicted = e.activations + e.logits + copy_kept
    assert abs(whole / predicted - 1) < 0.15, (whole, predicted)
    assert 0.4 < e.activations / flat.activations < 0.7 and e.logits == flat.logits / 2


def _forward_saved_bytes_worker():
    """Bytes autograd keeps from one whole forward (loss included) per rank at tp = 2, without and
    with sequence parallelism, parameters excluded; and the tp collectives the profiler's timer
    counts in a forward and backward."""
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model
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
    # smoke mode: the tiny config alone (ZeRO-1, Muon, copy overhead, chunked loss at ZeRO-2), in the script's order
    assert len(table) == 2 + 4 and table[2].startswith("| tiny-zero1 |") and "tiny-copy-overhead" in table[4], table
    assert table[3].startswith("| tiny-muon-zero1 |") and "| muon |" in table[3] and "| adamw |" in table[2]
    assert table[5].startswith("| tiny-chunked-loss |") and "| 2 | fp32 |" in table[5]
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
