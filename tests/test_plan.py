"""The layout planner: its communication volumes equal what the profiler's collective timer
measures through DeepSpeed and megatron-core (tp = 2 x dp = 2, ZeRO 1, 2, 3, with and without
sequence parallelism and recomputation; pipeline stages at tp2 x pp2 and pp2 x dp2, per stage); its layouts fit and obey the batch arithmetic; the memory
estimator splits the model over pipeline stages as CPLMPipe does and counts 1F1B's micro-batches in
flight; the planner proposes pipeline parallelism where nothing fits without it and charges its
bubble; the CLI says when a size fits in no layout and writes a loadable run config, parallel.pp
included."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cplm_dist.config import load_config
from cplm_dist.model.counting import parameters_per_device, tensor_sizes_per_device
from cplm_dist.model.parallel.stages import layer_parameters, partition
from cplm_dist.profiling.communication import step_bytes, tp_bytes_per_micro_batch
from cplm_dist.profiling.memory import (Stage, bubble, estimate, layer_activation_bytes_per_token, pipeline_stages,
                                        stage_estimates, state_bytes_per_parameter)
from cplm_dist.profiling.planner import Cluster, layouts, pipeline_links, plan, predict, stage_flops_per_token
from cplm_dist.training.throughput import flops_per_token
from tests.spawn import run_ranks

REPO = Path(__file__).resolve().parent.parent
MICRO, SEQ, ACCUMULATION = 2, 64, 2
# (overrides, what they exercise); every case at tp = 2 x dp = 2, fp32, two micro-batches a step
CASES = [
    (["train.zero_stage=1"], "ZeRO-1: one gradient all-reduce a step, tp all-reduces"),
    (["train.zero_stage=2", "parallel.sequence_parallel=true", "train.activation_checkpointing=true"],
     "ZeRO-2 every micro-batch; sp's gathers and scatters, recomputed"),
    # wider so that the larger matrices pass ZeRO-3's persistence threshold (gathered every micro-batch)
    (["train.zero_stage=3", "train.activation_checkpointing=true", "model.hidden_size=256", "model.ffn_hidden_size=1024"],
     "ZeRO-3, persistent and gathered parameters; recomputed tp collectives"),
    (["train.zero_stage=1", "optim.name=muon", "optim.muon.split_qkv=true"],
     "Muon at ZeRO-1: the directions gathered over tp and over the dp partitions"),
]


def _config(overrides):
    return load_config("tiny", [*overrides, "parallel.tp=2", "train.precision=fp32", f"train.micro_batch_size={MICRO}",
                                f"data.seq_length={SEQ}", f"train.global_batch_size={MICRO * ACCUMULATION * 2}"])


def _measured_volumes_worker():
    from cplm_dist.distributed import default_device, init_distributed
    from cplm_dist.profiling.measure import measure
    from cplm_dist.training.step import build_train_step as build

    dims = init_distributed(2)
    device = default_device()
    out = []
    for overrides, _ in CASES:
        cfg = _config(overrides)
        step = build(cfg, dims, device)
        r = measure(step, cfg, dims, warmup=1, steps=1, breakdown_steps=1, seq_len=SEQ, device=device, baseline_bytes=0)
        out.append({k: v["mb"] * 1e6 for k, v in r["comm_by_collective"].items()})
    return out


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_measured_volumes_worker, 4, timeout=400)[0]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[1].split(":")[0].split(";")[0] for c in CASES])
def test_predicted_collective_bytes_equal_the_profilers(measured, case):
    """Every collective the planner predicts is within 10% of the bytes the timer measured, and
    nothing the timer measured (above 1% of the step's bytes) is missing from the prediction."""
    overrides, what = CASES[case]
    cfg = _config(overrides)
    t = cfg.train
    predicted = step_bytes(cfg, tp=2, dp=2, zero=t.zero_stage, micro_batch=MICRO, accumulation=ACCUMULATION, seq_len=SEQ,
                           precision="fp32", activation_checkpointing=t.activation_checkpointing,
                           sequence_parallel=cfg.parallel.sequence_parallel)
    got = measured[case]
    total = sum(got.values())
    for key, size in predicted.items():
        assert key in got, (what, key, got)
        assert abs(got[key] / size - 1) < 0.10, (what, key, got[key], size)
    missing = {k: v for k, v in got.items() if k not in predicted and v > 0.01 * total}
    assert not missing, (what, missing)
    for group in ("tp", "dp"):
        want = sum(v for k, v in predicted.items() if k.startswith(group))
        have = sum(v for k, v in got.items() if k.startswith(group))
        assert abs(have / want - 1) < 0.10, (what, group, have, want)


# pipeline layouts, four ranks each: (tp, pp, dp, overrides)
PP_CASES = [
    (2, 2, 1, ["train.zero_stage=1"], "tp2 x pp2 ZeRO-1: partitioned activations and gradients, tied embedding"),
    (2, 2, 1, ["train.zero_stage=1", "parallel.sequence_parallel=true", "train.activation_checkpointing=true"],
     "tp2 x pp2 with sp and recomputation: activations already sharded"),
    (1, 2, 2, ["train.zero_stage=0", "model.tie_embeddings=false"], "pp2 x dp2 ZeRO-0, untied: each stage's own dp volume"),
]


def _pp_config(tp, pp, dp, overrides):
    return load_config("tiny", [*overrides, f"parallel.tp={tp}", f"parallel.pp={pp}", "train.precision=fp32",
                                f"train.micro_batch_size={MICRO}", f"data.seq_length={SEQ}",
                                f"train.global_batch_size={MICRO * ACCUMULATION * dp}"])


# context-parallel layouts, four ranks each (the same job as PP_CASES): (tp, cp, dp, overrides)
CP_CASES = [
    (1, 2, 2, ["train.zero_stage=1"], "cp2 x dp2 ZeRO-1: K/V, copy keys and ids over cp, gradients over dp x cp"),
    (2, 2, 1, ["train.zero_stage=2", "parallel.sequence_parallel=true", "train.activation_checkpointing=true"],
     "tp2 x cp2 with sp, recomputed, ZeRO-2: the dp x cp group is the cp ranks"),
]


def _cp_config(tp, cp, dp, overrides):
    return load_config("tiny", [*overrides, f"parallel.tp={tp}", f"parallel.cp={cp}", "train.precision=fp32",
                                f"train.micro_batch_size={MICRO}", f"data.seq_length={SEQ}",
                                f"train.global_batch_size={MICRO * ACCUMULATION * dp}"])


def _measured_pipeline_volumes_worker():
    """Every rank's measured bytes by collective, and its stage, for each of PP_CASES, then (its
    cp rank, its bytes by collective, the profiler's comm_cp_mb) for each of CP_CASES (the
    parallel groups rebuilt between cases on the same process group)."""
    from cplm_dist.distributed import default_device, init_distributed
    from cplm_dist.megatron_compat import parallel_state
    from cplm_dist.profiling.measure import measure
    from cplm_dist.training.step import build_train_step as build

    out = []
    for tp, pp, dp, overrides in [c[:4] for c in PP_CASES]:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dims = init_distributed(tp, pp_size=pp)
        cfg = _pp_config(tp, pp, dp, overrides)
        step = build(cfg, dims, default_device())
        r = measure(step, cfg, dims, warmup=1, steps=1, breakdown_steps=1, seq_len=SEQ, device=default_device(),
                    baseline_bytes=0)
        out.append((dims.pp_rank, {k: v["mb"] * 1e6 for k, v in r["comm_by_collective"].items()}))
    for tp, cp, dp, overrides in [c[:4] for c in CP_CASES]:
        parallel_state.destroy_model_parallel()
        dims = init_distributed(tp, cp_size=cp)
        cfg = _cp_config(tp, cp, dp, overrides)
        step = build(cfg, dims, default_device())
        r = measure(step, cfg, dims, warmup=0, steps=1, breakdown_steps=1, seq_len=SEQ, device=default_device(),
                    baseline_bytes=0)
        out.append((dims.cp_rank, {k: v["mb"] * 1e6 for k, v in r["comm_by_collective"].items()}, r["comm_cp_mb"]))
    return out


@pytest.fixture(scope="module")
def measured_pipeline():
    return run_ranks(_measured_pipeline_volumes_worker, 4, timeout=400)


@pytest.mark.parametrize("case", range(len(PP_CASES)), ids=[c[4].split(":")[0] for c in PP_CASES])
def test_predicted_pipeline_bytes_equal_the_profilers(measured_pipeline, case):
    """Per stage (first and last), every predicted volume within 10% of the timer's: the
    point-to-point sends and receives, the gathers of partitioned tensors, the tied embedding's
    all-reduce, the stage's own tp and dp collectives; nothing sizeable unpredicted."""
    tp, pp, dp, overrides, what = PP_CASES[case]
    cfg = _pp_config(tp, pp, dp, overrides)
    t = cfg.train
    for rank in range(4):
        stage, got = measured_pipeline[rank][case]
        predicted = step_bytes(cfg, tp=tp, dp=dp, zero=t.zero_stage, micro_batch=MICRO, accumulation=ACCUMULATION,
                               seq_len=SEQ, precision="fp32", activation_checkpointing=t.activation_checkpointing,
                               sequence_parallel=cfg.parallel.sequence_parallel, pp=pp, stage=stage)
        assert {"pp/send", "pp/recv"} <= set(predicted), predicted
        for key, size in predicted.items():
            assert key in got, (what, rank, key, got)
            assert abs(got[key] / size - 1) < 0.10, (what, rank, key, got[key], size)
        total = sum(got.values())
        missing = {k: v for k, v in got.items() if k not in predicted and v > 0.01 * total}
        assert not missing, (what, rank, missing)


@pytest.mark.parametrize("case", range(len(CP_CASES)), ids=[c[4].split(":")[0] for c in CP_CASES])
def test_predicted_context_parallel_bytes_equal_the_profilers(measured_pipeline, case):
    """Every rank of a cp layout: the timer files the cp group's collectives under "cp" and the
    dp x cp group's under "dp"; each volume step_bytes(cp=) predicts (every layer's K and V
    gathered and scattered, recomputed; the copy head's keys; the ids; tp at T/cp tokens; dp's
    over dp x cp) within 10% of the measured, nothing sizeable unpredicted, comm_cp_mb their sum."""
    tp, cp, dp, overrides, what = CP_CASES[case]
    cfg = _cp_config(tp, cp, dp, overrides)
    t = cfg.train
    predicted = step_bytes(cfg, tp=tp, dp=dp, zero=t.zero_stage, micro_batch=MICRO, accumulation=ACCUMULATION, seq_len=SEQ,
                           precision="fp32", activation_checkpointing=t.activation_checkpointing,
                           sequence_parallel=cfg.parallel.sequence_parallel, cp=cp)
    assert {"cp/all_gather_into_tensor", "cp/reduce_scatter_tensor", "cp/all_gather", "dp/all_reduce"} <= set(predicted)
    for rank in range(4):
        _, got, cp_mb = measured_pipeline[rank][len(PP_CASES) + case]
        for key, size in predicted.items():
            assert key in got, (what, rank, key, got)
            assert abs(got[key] / size - 1) < 0.10, (what, rank, key, got[key], size)
        total = sum(got.values())
        missing = {k: v for k, v in got.items() if k not in predicted and v > 0.01 * total}
        assert not missing, (what, rank, missing)
        assert cp_mb * 1e6 == pytest.approx(sum(v for k, v in got.items() if k.startswith("cp/")))


def test_cp_bytes_by_part_and_what_the_copy_head_adds():
    """The cp volumes by part add up to step_bytes' "cp/"; the copy head adds its keys (8 N H_c d_c
    a micro-batch: gathered and scattered), recomputation adds one more K/V gather a layer, and
    tp's volumes at cp are those of T/cp tokens."""
    from cplm_dist.profiling.communication import cp_step_parts

    cfg = load_config("cplm-7b", ["train.precision=bf16"])
    layout = dict(tp=2, dp=4, zero=1, micro_batch=1, accumulation=4, seq_len=32768, precision="bf16",
                  activation_checkpointing=False, sequence_parallel=True)
    volumes = step_bytes(cfg, **layout, cp=4)
    parts = cp_step_parts(cfg, tp=2, cp=4, micro_batch=1, accumulation=4, seq_len=32768, precision="bf16",
                          activation_checkpointing=False)
    assert sum(parts.values()) == sum(v for k, v in volumes.items() if k.startswith("cp/"))
    N, m, c = 32768, cfg.model, cfg.copy
    assert parts["copy_head"] == 4 * 2 * 4 * N * c.num_heads * c.head_dim
    assert parts["attention"] == 4 * 2 * 2 * N * (m.num_kv_heads // 2) * m.head_dim * 2 * m.num_layers
    assert parts["ids"] == 4 * 8 * N and parts["copy_head"] < parts["attention"] / 50
    off = cp_step_parts(load_config("cplm-7b", ["copy.enabled=false"]), tp=2, cp=4, micro_batch=1, accumulation=4,
                        seq_len=32768, precision="bf16", activation_checkpointing=False)
    assert "copy_head" not in off and off["attention"] == parts["attention"]
    recomputed = cp_step_parts(cfg, tp=2, cp=4, micro_batch=1, accumulation=4, seq_len=32768, precision="bf16",
                               activation_checkpointing=True)
    assert recomputed["attention"] == parts["attention"] * 3 / 2
    flat = step_bytes(cfg, **{**layout, "seq_len": 32768 // 4}, cp=1)
    assert all(volumes[k] == v for k, v in flat.items() if k.startswith("tp/"))
    # gradients over dp x cp: dp 4 x cp 4 moves what dp 16 does, and dp 1 x cp 4 still reduces
    dp_cp = {k: v for k, v in volumes.items() if k.startswith("dp/")}
    assert dp_cp and dp_cp == {k: v for k, v in step_bytes(cfg, **{**layout, "dp": 16}, cp=1).items() if k.startswith("dp/")}
    assert "dp/all_reduce" in step_bytes(cfg, **{**layout, "dp": 1}, cp=4)


def test_tensor_sizes_add_up_to_the_parameters_a_device_holds():
    for name, overrides in (("tiny", []), ("cplm-1.7b", ["copy.mix=sentinel", "model.tie_embeddings=false"]),
                            ("cplm-70b", ["copy.mix=joint"])):
        cfg = load_config(name, overrides)
        for tp in (1, 2, 8):
            if cfg.model.num_kv_heads % tp == 0:
                assert sum(tensor_sizes_per_device(cfg, tp)) == parameters_per_device(cfg, tp), (name, tp)


def test_qwen3_plans_and_its_qk_norm_gradients_are_all_reduced_over_tp():
    """qwen3-0.6b plans (its heads of 128 in the FLOPs and the estimator); its qk-norm weights (2 x
    head_dim a layer, replicated, each rank normalising its own heads) are all-reduced over tp with
    or without sequence parallelism: the tp volume grows by exactly their bytes over llama's."""
    fits, _ = plan(load_config("qwen3-0.6b", ["train.precision=bf16"]), Cluster(gpus=8), seq_len=4096, global_batch=64)
    assert fits and all(p.tp * p.cp * p.pp * p.dp == 8 for p in fits)
    for sp in (False, True):
        llama, qwen3 = (tp_bytes_per_micro_batch(load_config("tiny", [f"model.arch={arch}", "model.head_dim=24"]), tp=2,
                                                 tokens=128, act_bytes=2, activation_checkpointing=False, sequence_parallel=sp)
                        for arch in ("llama", "qwen3"))
        assert qwen3["all_reduce"] - llama["all_reduce"] == 2 * (2 * 24) * 2, sp  # L x 2 hd x b
        assert {k: v for k, v in qwen3.items() if k != "all_reduce"} == {k: v for k, v in llama.items() if k != "all_reduce"}


def test_plans_fit_obey_the_batch_and_rank_fastest_first():
    cfg = load_config("cplm-1.7b", ["train.precision=bf16"])
    cluster = Cluster(gpus=16)
    fits, considered = plan(cfg, cluster, seq_len=2048, global_batch=256)
    assert 0 < len(fits) < considered
    for p in fits:
        assert p.memory_gib <= 0.9 * cluster.memory_gib
        assert p.micro_batch * p.accumulation * p.dp == 256 and p.tp * p.cp * p.pp * p.dp == 16
        assert 0 < p.mfu <= cluster.achievable + 1e-9  # communication and recomputation only cost
    fastest = min(p.step_s for p in fits)
    assert fits[0].step_s <= fastest * 1.02
    # 64 x 2048 tokens of a 1.7B model's activations on one GPU do not fit (cp 1: whole sequences); one sequence does
    assert not any(p.tp == 1 and p.cp == 1 and p.micro_batch == 64 and not p.activation_checkpointing for p in fits)
    assert any(p.tp == 1 and p.zero_stage == 1 and p.micro_batch == 1 for p in fits)


def test_the_model_responds_to_the_cluster_in_the_right_direction():
    cfg = load_config("cplm-7b", ["train.precision=bf16"])
    layout = dict(tp=2, zero=1, micro_batch=2, seq_len=4096, global_batch=512, activation_checkpointing=True)
    slow, fast = (predict(cfg, Cluster(gpus=64, inter_gbps=bw), sequence_parallel=False, **layout) for bw in (10.0, 100.0))
    assert fast.step_s < slow.step_s and fast.compute_s == slow.compute_s
    no_ckpt = {**layout, "activation_checkpointing": False}
    without, with_sp = (predict(cfg, Cluster(gpus=64), sequence_parallel=sp, **no_ckpt) for sp in (False, True))
    assert with_sp.memory_gib < without.memory_gib
    recomputed = predict(cfg, Cluster(gpus=64), sequence_parallel=False, **layout)
    assert without.compute_s < recomputed.compute_s < without.compute_s * 4 / 3


def test_cli_writes_a_run_config_and_says_when_no_layout_fits(tmp_path, capsys):
    from cplm_dist_tools.plan import main

    run = tmp_path / "cplm-7b.yaml"
    shutil.copy(REPO / "configs/runs/cplm-7b.yaml", run)
    assert main(["--config", str(run), "--gpus", "64", "--top", "3", "--write", str(run)]) == 0
    out = capsys.readouterr().out
    assert "| tp | cp | pp | dp | ZeRO |" in out and f"wrote {run}" in out
    text = run.read_text()
    assert text.startswith("# cplm-7b") and "# layout from tools/plan.py --gpus 64" in text  # comments kept
    assert "compile: true  # regional torch.compile" in text
    best = out.split("best: ")[1]
    cfg = load_config(str(run))
    assert f"tp={cfg.parallel.tp} " in best and f"ZeRO-{cfg.train.zero_stage} " in best
    assert f"micro {cfg.train.micro_batch_size} " in best and cfg.data.tokenizer == "data/tokenizer.model"

    assert main(["--config", "cplm-70b", "--gpus", "8", "--seq-len", "4096", "--global-batch", "64"]) == 1
    out = capsys.readouterr().out
    assert "even with pipeline parallelism (pp up to 8)" in out and "needs pipeline parallelism" not in out

    bad = subprocess.run([sys.executable, str(REPO / "tools/plan.py"), "--config", "cplm-7b", "--gpus", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--gpus 0" in bad.stderr


def test_pipeline_stages_are_cplmpipes_split_and_hold_its_parameters():
    """The estimator's stages are `partition(layer_parameters(cfg), pp)`; their parameters add up to
    the model's, the tied embedding counted on the first and the last stage."""
    for name in ("cplm-1.7b", "cplm-7b"):  # tied, untied
        cfg = load_config(name)
        L = cfg.model.num_layers
        assert pipeline_stages(cfg, 1) == [Stage(0, 1, L, True, True)]
        for pp in (2, 4):
            stages = pipeline_stages(cfg, pp, 1)
            bounds = partition(layer_parameters(cfg), pp)
            assert [s.layers for s in stages] == [min(b, L + 1) - max(a, 1) for a, b in zip(bounds, bounds[1:])]
            assert sum(s.layers for s in stages) == L and all(s.layers >= 1 for s in stages)
            assert [(s.first, s.last) for s in stages] == [(i == 0, i == pp - 1) for i in range(pp)]
            e = stage_estimates(cfg, tp=1, dp=1, micro_batch=1, seq_len=512, zero=0, precision="fp32", pp=pp,
                                accumulation=8)
            held = sum(x.parameters for x in e) / 4  # fp32: 4 bytes a parameter
            tied = cfg.model.vocab_size * cfg.model.hidden_size if cfg.model.tie_embeddings else 0
            assert abs(held - parameters_per_device(cfg, 1) - tied) < 1e-6 * held, (name, pp)


def test_estimator_at_pp_2_halves_the_parameters_and_holds_the_1f1b_micro_batches():
    cfg = load_config("cplm-7b", ["train.precision=bf16"])
    layout = dict(tp=2, dp=4, micro_batch=2, seq_len=2048, zero=1, activation_checkpointing=False)
    one = estimate(cfg, **layout)
    assert estimate(cfg, **layout, pp=1, accumulation=8).as_dict() == one.as_dict()  # pp = 1 as before
    assert one.parameters == parameters_per_device(cfg, 2) * state_bytes_per_parameter("bf16", 1, 4)[0]
    stages = stage_estimates(cfg, **layout, pp=2, accumulation=8)
    for s in stages:  # the parameters, their gradients and optimizer states roughly halve per stage
        for part in ("parameters", "gradients", "optimizer", "optimizer_transient"):
            assert 0.4 < getattr(s, part) / getattr(one, part) < 0.6, part
    assert estimate(cfg, **layout, pp=2, accumulation=8).total == max(s.total for s in stages)
    # the loss's logits and the copy head only on the last stage
    assert stages[0].logits == stages[0].copy_head == 0 and stages[1].logits == one.logits > 0
    assert stages[1].copy_head == one.copy_head > 0

    # 1F1B: stage s keeps min(pp - s, m) micro-batches of its own layers' activations
    b, D, tokens = 2, cfg.model.hidden_size, 2 * 2048
    per_layer = layer_activation_bytes_per_token(cfg, 2, b)
    rope = 2 * 4 * 2048 * cfg.model.head_dim
    for pp, m in ((2, 8), (4, 2), (4, 8), (4, 1)):
        stages = pipeline_stages(cfg, pp, 2)
        e = stage_estimates(cfg, **layout, pp=pp, accumulation=m)
        first, last = stages[0], stages[-1]
        # the first stage: its layers, its tp partition of the hidden states it sent and the ids and
        # labels, min(pp, m) times
        assert e[0].activations == pytest.approx(min(pp, m) * tokens * (first.layers * per_layer + b * D / 2 + 16) + rope,
                                                 rel=1e-12), (pp, m)
        final_norm = tokens * (8 * D + 4 + b * D)  # the received hidden states whole (no sequence parallelism)
        assert e[-1].activations == pytest.approx(tokens * (last.layers * per_layer + b * D + 16) + final_norm + rope,
                                                  rel=1e-12), (pp, m)
        if pp == 4:  # an interior stage: min(pp - 1, m) micro-batches, no vocabulary gradient
            assert e[1].activations == pytest.approx(
                min(3, m) * tokens * (stages[1].layers * per_layer + b * D + b * D / 2 + 16) + rope, rel=1e-12)
            assert e[1].backward_transient == tokens * per_layer < e[0].backward_transient
    # more micro-batches in flight than the pipeline holds cost nothing more
    assert stage_estimates(cfg, **layout, pp=4, accumulation=4)[0].activations == \
        stage_estimates(cfg, **layout, pp=4, accumulation=64)[0].activations
    # checkpointed: each in-flight micro-batch keeps its layers' inputs only
    ck = stage_estimates(cfg, **{**layout, "activation_checkpointing": True}, pp=4, accumulation=8)[0]
    assert ck.activations == pytest.approx(
        4 * tokens * (pipeline_stages(cfg, 4, 2)[0].layers * b * D + b * D / 2 + 16) + rope, rel=1e-12)


def test_stage_flops_add_up_and_the_pipeline_moves_step_bytes_volumes():
    """The stages' FLOPs add up to flops_per_token; a pipelined plan's p2p time is
    communication.step_bytes(pp=, stage=)'s sends and receives at the stage link's bandwidth."""
    for name, overrides in (("cplm-1.7b", []), ("cplm-7b", ["copy.mix=sentinel"])):
        cfg = load_config(name, overrides)
        for pp in (2, 4):
            total = sum(stage_flops_per_token(cfg, s, 1024)[0] for s in pipeline_stages(cfg, pp))
            assert abs(total / flops_per_token(cfg, 1024) - 1) < 1e-12
    cfg = load_config("cplm-7b", ["train.precision=bf16", "parallel.tp=2"])  # untied: no tied all-reduce
    p = predict(cfg, Cluster(gpus=32), tp=2, pp=4, zero=1, micro_batch=1, seq_len=4096, global_batch=64,
                activation_checkpointing=False, sequence_parallel=True)
    slowest = [step_bytes(cfg, tp=2, dp=4, zero=1, micro_batch=1, accumulation=16, seq_len=4096, precision="bf16",
                          activation_checkpointing=False, sequence_parallel=True, pp=4, stage=s) for s in range(4)]
    p2p = [(v["pp/send"] + v["pp/recv"]) / 40e9 for v in slowest]  # 32 GPUs: stage boundaries on the network
    assert any(p.pp_comm_s == pytest.approx(t) for t in p2p) and p.pp_comm_s > 0
    assert p.pp_comm_s >= 16 * 2 * (4096 * 4096 * 2 / 2) / 40e9  # a sequence shard each way, 16 micro-batches


def test_bubble_and_the_pipelined_step():
    assert bubble(1, 8) == 0 and bubble(4, 12) == 3 / 15 and bubble(8, 1) == 7 / 8
    cfg = load_config("cplm-70b", ["train.precision=bf16"])
    cluster = Cluster(gpus=512)
    layout = dict(tp=4, pp=4, zero=1, micro_batch=1, seq_len=4096, activation_checkpointing=False, sequence_parallel=True)
    few, many = (predict(cfg, cluster, global_batch=g, **layout) for g in (128, 1024))  # m = 4, 32
    assert (few.accumulation, many.accumulation) == (4, 32)
    assert few.bubble == 3 / 7 and many.bubble == 3 / 35
    for p in (few, many):  # untied: pp s is the p2p alone, and the slowest stage's slots carry it too
        assert p.pp == 4 and p.dp == 32 and p.pp_comm_s > 0 and p.exposed_dp_s == p.dp_comm_s > 0
        assert p.step_s == pytest.approx((p.compute_s + p.tp_comm_s + p.pp_comm_s) / (1 - p.bubble) + p.exposed_dp_s)
    assert few.mfu < many.mfu  # the bubble costs
    # consecutive stages are tp x dp ranks apart: in one node only when the whole job is
    assert pipeline_links(Cluster(gpus=8), tp=2, pp=2, dp=2) == (360.0, 360.0, 360.0, 360.0)
    assert pipeline_links(Cluster(gpus=16), tp=2, pp=2, dp=4) == (360.0, 40.0, 40.0, 360.0)
    # with cp the stages are tp x cp x dp ranks apart; a cp group its tp x cp consecutive ranks
    assert pipeline_links(Cluster(gpus=16), tp=2, pp=2, dp=2, cp=2) == (360.0, 40.0, 40.0, 360.0)
    assert pipeline_links(Cluster(gpus=32), tp=4, pp=2, dp=1, cp=4) == (40.0, 40.0, 40.0, 40.0)
    assert pipeline_links(Cluster(gpus=16), tp=8, pp=2, dp=1)[1] == 40.0
    assert pipeline_links(Cluster(gpus=32), tp=2, pp=2, dp=8)[0] == 40.0  # a stage's dp group spans two nodes


def _pipeline_only_cluster():
    """cplm-1.7b with the chunked loss (no ZeRO-3) on 8 single-GPU nodes (no tp) in 10 GiB: ZeRO-1/2
    over dp = 8 cannot hold the whole model's states and one micro-batch; split over stages it fits."""
    return Cluster(gpus=8, gpus_per_node=1, memory_gib=10.0)


def test_the_planner_proposes_pipeline_parallelism_where_nothing_fits_without_it():
    cfg = load_config("cplm-1.7b", ["train.precision=bf16", "loss.impl=chunked"])
    cluster = _pipeline_only_cluster()
    flat, _ = plan(cfg, cluster, seq_len=2048, global_batch=64, max_pp=1)
    assert flat == []
    fits, considered = plan(cfg, cluster, seq_len=2048, global_batch=64)
    assert fits and all(p.pp > 1 for p in fits)
    for p in fits:
        assert p.memory_gib <= 0.9 * cluster.memory_gib and p.tp * p.cp * p.pp * p.dp == 8
        assert p.micro_batch * p.accumulation * p.dp == 64 and p.zero_stage == 1  # bf16 pipelines take ZeRO-1 only
        one_f_one_b = (p.pp - 1) / (p.accumulation + p.pp - 1)
        if p.pp_schedule == "1f1b":
            assert p.bubble == one_f_one_b
        else:  # DualPipeV: where a rank's two stages and 2 x pp micro-batches fit, a smaller bubble
            assert p.pp_schedule == "dualpipev" and p.accumulation >= 2 * p.pp and p.bubble < one_f_one_b
        assert 0 < p.mfu <= cluster.achievable
    assert {p.pp_schedule for p in fits} == {"1f1b", "dualpipev"}
    fastest = min(p.step_s for p in fits)
    assert fits[0].step_s <= fastest * 1.02


def test_cli_writes_parallel_pp(tmp_path, capsys):
    from cplm_dist_tools.plan import main

    run = tmp_path / "cplm-1.7b.yaml"
    run.write_text((REPO / "configs/runs/cplm-1.7b.yaml").read_text() + "loss:\n  impl: chunked\n")
    assert load_config(str(run)).parallel.pp == 1
    common = ["--config", str(run), "--gpus", "8", "--gpus-per-node", "1", "--gpu-gb", "10", "--global-batch", "64"]
    assert main([*common, "--max-pp", "1"]) == 1
    assert "needs pipeline parallelism" in capsys.readouterr().out
    assert main([*common, "--top", "3", "--write", str(run)]) == 0
    out = capsys.readouterr().out
    assert "| tp | cp | pp | dp | ZeRO |" in out and "without pipeline parallelism" in out
    cfg = load_config(str(run))  # validates: pp > 1 with ZeRO-1
    best = out.split("best: ")[1]
    assert cfg.parallel.pp > 1 and f"pp={cfg.parallel.pp} " in best and f"ZeRO-{cfg.train.zero_stage} " in best
    assert cfg.train.global_batch_size == 64 and cfg.data.tokenizer == "data/tokenizer.model"
    header = run.read_text().splitlines()[1]
    schedule = "" if cfg.parallel.pp_schedule == "1f1b" else f" {cfg.parallel.pp_schedule}"
    assert f"(pp={cfg.parallel.pp}{schedule}, bubble" in header


def test_estimator_counts_the_full_fp32_accumulator_of_fp32_gradient_accumulation():
    """bf16 ZeRO-1 keeps 2 bytes of bf16 gradient and its 4/dp fp32 partition a parameter; with
    train.grad_accum_dtype=fp32 (DeepSpeed's BF16_Optimizer) the fp32 accumulator is whole."""
    assert state_bytes_per_parameter("bf16", 1, 4)[1] == 2 + 4 / 4
    assert state_bytes_per_parameter("bf16", 1, 4, "fp32")[1] == 2 + 4
    default = load_config("cplm-1.7b", ["train.precision=bf16"])
    fp32 = load_config("cplm-1.7b", ["train.precision=bf16", "train.grad_accum_dtype=fp32"])
    layout = dict(tp=1, dp=8, micro_batch=2, seq_len=2048, zero=1)
    extra = estimate(fp32, **layout).gradients - estimate(default, **layout).gradients
    assert extra == pytest.approx(parameters_per_device(default, 1) * 4 * (1 - 1 / 8))


def test_estimate_memory_refuses_zero_2_and_3_with_pipeline_stages(capsys):
    """DeepSpeed's pipeline engine trains with ZeRO 0-1: the estimator does not print a layout that
    training refuses (from --zero or from the config's zero_stage)."""
    from cplm_dist_tools.estimate_memory import main

    for argv, zero in ((["--config", "cplm-7b", "--tp", "2", "--pp", "2", "--dp", "4", "--zero", "3"], 3),
                       (["--config", "cplm-7b", "--pp", "2", "--dp", "4", "train.zero_stage=2"], 2)):
        assert main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"error: ZeRO-{zero} with --pp 2: DeepSpeed's pipeline engine trains with ZeRO 0-1 only (training refuses "
            "this layout); use --zero 1 or --pp 1")
    assert main(["--config", "cplm-7b", "--tp", "2", "--pp", "2", "--dp", "4", "--zero", "1"]) == 0


def _long(name, seq, overrides=()):
    return load_config(name, ["train.precision=bf16", f"model.max_seq_len={seq}", f"data.seq_length={seq}", *overrides])


def test_layouts_enumerate_cp_as_training_accepts_it():
    """cp: powers of two dividing gpus / tp, the sequence divisible by 2 x cp (x tp under sequence
    parallelism), with pipeline stages too; tp x cp x pp x dp the GPUs, the batch counting dp alone."""
    cfg = load_config("cplm-1.7b", ["train.precision=bf16"])
    seen = set()
    for tp, pp, zero, micro, ckpt, sp, cp in layouts(cfg, Cluster(gpus=16), seq_len=40, global_batch=64):
        dp = 16 // (tp * cp * pp)
        assert tp * cp * pp * dp == 16 and 64 % (micro * dp) == 0
        assert cp & (cp - 1) == 0 and 40 % (2 * cp) == 0
        assert not sp or 40 % (tp * (2 * cp if cp > 1 else 1)) == 0
        seen.add((tp, cp, sp, pp))
    assert {cp for _, cp, _, _ in seen} == {1, 2, 4} and (2, 2, True, 1) in seen and not any(s[:3] == (4, 2, True) for s in seen)
    assert (1, 2, False, 2) in seen and (2, 2, True, 4) in seen  # cp x pp (x tp)


def test_estimator_under_cp_shards_the_sequence_and_partitions_zero_over_dp_x_cp():
    cfg = _long("cplm-1.7b", 32768)
    kw = dict(tp=1, micro_batch=1, seq_len=32768, zero=1, accumulation=16)
    one, two = estimate(cfg, dp=8, cp=1, **kw), estimate(cfg, dp=4, cp=2, **kw)
    assert two.optimizer == one.optimizer and two.gradients == one.gradients  # ZeRO over dp 4 x cp 2 = dp 8
    assert two.parameters == one.parameters and two.logits == one.logits / 2
    assert 0.5 < two.activations / one.activations < 0.6  # halved, plus every layer's gathered K and V
    cp2 = load_config(str(REPO / "configs/runs/cplm-1.7b-32k.yaml"))
    assert cp2.parallel.cp == 2 and estimate(cp2, tp=1, dp=4, micro_batch=1, seq_len=32768).total == two.total  # cp from the config
    pipe, both = (estimate(cfg, tp=1, dp=d, micro_batch=1, seq_len=32768, cp=c, pp=2, accumulation=16) for d, c in ((4, 1), (2, 2)))
    assert both.parameters == pipe.parameters and both.optimizer == pipe.optimizer  # ZeRO over dp 2 x cp 2 = dp 4
    assert 0.5 < both.activations / pipe.activations < 0.6  # cp x pp: each stage's sequence halved too


def test_the_planner_proposes_context_parallelism_where_nothing_fits_without_it():
    """cplm-1.7b at 32k tokens on 8 single-GPU nodes (no tp) of 24 GiB: no layout at cp = 1 fits,
    pipelines included; at cp >= 2 they do, each a whole sequence over cp ranks."""
    cfg = _long("cplm-1.7b", 32768)
    cluster = Cluster(gpus=8, gpus_per_node=1, memory_gib=24.0)
    flat, _ = plan(cfg, cluster, seq_len=32768, global_batch=16, max_cp=1)
    assert flat == []
    fits, _ = plan(cfg, cluster, seq_len=32768, global_batch=16)
    assert fits and all(p.cp > 1 and p.tp * p.cp * p.pp * p.dp == 8 for p in fits)
    assert any(p.pp == 1 for p in fits) and any(p.pp > 1 for p in fits)  # cp alone, and cp x pp
    for p in fits:
        assert p.memory_gib <= 0.9 * 24 and p.micro_batch * p.accumulation * p.dp == 16 and p.cp_comm_s > 0
        if p.pp == 1:
            assert p.step_s == pytest.approx(p.compute_s + p.tp_comm_s + p.cp_comm_s + p.exposed_dp_s)
        else:  # the slowest stage's slots over the bubble, then the tied and dp x cp reductions
            assert p.step_s > (p.compute_s + p.tp_comm_s + p.cp_comm_s) / (1 - p.bubble) + p.exposed_dp_s


def test_long_context_plans_pick_cp(tmp_path, capsys):
    """cplm-1.7b at 32k on one node of 8 x 80 GB and cplm-7b at 128k on 64 GPUs: the fastest
    layouts are context parallel (at cp = 1, 7B needs recomputation), and --write sets parallel.cp,
    the layout configs/runs/cplm-1.7b-32k.yaml ships."""
    from cplm_dist_tools.plan import main

    shipped = REPO / "configs/runs/cplm-1.7b-32k.yaml"
    run = tmp_path / "run.yaml"
    run.write_text(shipped.read_text().replace("base: cplm-1.7b.yaml", f"base: {REPO / 'configs/runs/cplm-1.7b.yaml'}"))
    assert main(["--config", str(run), "--gpus", "8", "--top", "2", "--write", str(run)]) == 0
    out = capsys.readouterr().out
    assert "| tp | cp | pp | dp |" in out and "best: tp=1 cp=2 pp=1 dp=4 ZeRO-1" in out
    written, ours = load_config(str(run)), load_config(str(shipped))
    assert written.parallel == ours.parallel and written.train == ours.train and written.data.seq_length == 32768
    cfg = _long("cplm-7b", 131072)
    fits, _ = plan(cfg, Cluster(gpus=64), seq_len=131072, global_batch=32)
    flat, _ = plan(cfg, Cluster(gpus=64), seq_len=131072, global_batch=32, max_cp=1)
    best = fits[0]
    assert best.cp > 1 and best.tp * best.cp * best.dp == 64 and not best.activation_checkpointing
    assert all(p.activation_checkpointing for p in flat) and best.step_s < flat[0].step_s


def test_the_70b_long_context_config_is_the_planned_cp_x_pp_layout(tmp_path, capsys):
    """configs/runs/cplm-70b-32k.yaml is what tools/plan.py --write proposes for cplm-70b at 32k on
    512 GPUs: cp x pp under DualPipeV, ahead of the same layout under 1F1B by its bubble and of cp
    alone (tp 8 x cp 8, no stages, 1.8% slower); it fits 80 GiB."""
    from cplm_dist_tools.plan import main

    shipped = REPO / "configs/runs/cplm-70b-32k.yaml"
    run = tmp_path / "run.yaml"
    run.write_text(shipped.read_text().replace("base: cplm-70b.yaml", f"base: {REPO / 'configs/runs/cplm-70b.yaml'}"))
    assert main(["--config", str(run), "--gpus", "512", "--top", "3", "--write", str(run)]) == 0
    assert "best: tp=8 cp=4 pp=2 dp=8 ZeRO-1" in capsys.readouterr().out
    written, ours = load_config(str(run)), load_config(str(shipped))
    assert written.parallel == ours.parallel and written.train == ours.train
    p, t = ours.parallel, ours.train
    assert p.cp > 1 and p.pp > 1 and p.pp_schedule == "dualpipev"
    cluster = Cluster(gpus=512)
    common = dict(seq_len=ours.data.seq_length, global_batch=t.global_batch_size, sequence_parallel=True,
                  activation_checkpointing=False, zero=1, micro_batch=1)
    dual = predict(ours, cluster, tp=8, pp=2, cp=4, pp_schedule="dualpipev", **common)
    plain = predict(ours, cluster, tp=8, pp=2, cp=4, **common)
    alone = predict(ours, cluster, tp=8, pp=1, cp=8, **common)
    assert dual.memory_gib <= cluster.headroom * cluster.memory_gib
    assert dual.bubble == pytest.approx(bubble(2, 16, "dualpipev")) and plain.bubble == pytest.approx(bubble(2, 16))
    assert dual.bubble < plain.bubble and dual.step_s < plain.step_s and dual.step_s < alone.step_s


SPARSE = ["train.precision=bf16", "model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.ffn_hidden_size=64"]


def test_experts_cost_per_ep_rank_and_their_dispatch_crosses_the_ep_group():
    """A sparse tiny model: ep 2 halves the experts' parameters a rank holds (counting's), their
    ZeRO-1 optimizer states are partitioned over the expert-dp ranks (dp / ep) where the dense ones
    are over dp; the all-to-all moves 4 x tokens x top_k x D x b + 8 x tokens x top_k a sparse layer
    and micro-batch on "ep/" (twice the forward's under recomputation), the experts' gradients go
    over "edp/", and the MLP's own tp gathers are gone under sequence parallelism."""
    from cplm_dist.profiling.expert_cost import ExpertGroups, dispatcher_bytes_per_micro_batch, local_expert_elements

    one, two = (load_config("tiny", [*SPARSE, f"parallel.ep={ep}", "train.zero_stage=1"]) for ep in (1, 2))
    whole = pipeline_stages(one, 1, 1)[0]
    assert local_expert_elements(one, whole, 1) == 2 * local_expert_elements(two, whole, 1) == 2 * 8 * 3 * 128 * 64
    assert parameters_per_device(one, 1) - parameters_per_device(two, 1) == local_expert_elements(two, whole, 1)
    assert ExpertGroups.of(two, tp=1, cp=1, dp=4).expert_dp == 2
    e1, e2 = (estimate(c, tp=1, dp=4, micro_batch=2, seq_len=64, zero=1) for c in (one, two))
    experts = local_expert_elements(two, whole, 1)
    assert e1.optimizer - e2.optimizer == pytest.approx(12 * 2 * experts / 4 - 12 * experts / 2)
    tokens, D, k, b = 2 * 64, 128, 2, 2
    assert dispatcher_bytes_per_micro_batch(two, tp=1, tokens=tokens, act_bytes=b, sparse_layers=1,
                                            activation_checkpointing=False) == {"ep/all_to_all_single": 4 * tokens * k * D * b + 8 * tokens * k}
    layout = dict(tp=1, dp=4, zero=1, micro_batch=2, accumulation=3, seq_len=64, precision="bf16", sequence_parallel=False)
    plain, recomputed = (step_bytes(two, activation_checkpointing=ckpt, **layout) for ckpt in (False, True))
    forward = 2 * tokens * k * D * b + 4 * tokens * k
    assert recomputed["ep/all_to_all_single"] - plain["ep/all_to_all_single"] == 3 * 2 * forward  # 2 layers, 3 micro-batches
    assert plain["edp/all_reduce"] == plain["edp/all_gather_into_tensor"] == experts * b
    at_ep1 = step_bytes(one, activation_checkpointing=False, **layout)
    assert plain["dp/all_reduce"] == at_ep1["dp/all_reduce"]  # the dense part over dp, whatever ep
    assert at_ep1["edp/all_reduce"] == 2 * experts * b  # at ep 1 every expert, over as many expert-dp ranks
    sp = dict(activation_checkpointing=False, sequence_parallel=True)
    for_sparse, for_dense = (tp_bytes_per_micro_batch(c, tp=2, tokens=tokens, act_bytes=b, sparse_layers=n, **sp)
                             for c, n in ((two, 2), (load_config("tiny", ["train.precision=bf16"]), 0)))
    h = tokens * D * b
    assert for_dense["all_gather_into_tensor"] - for_sparse["all_gather_into_tensor"] == 2 * 3 * h
    assert for_dense["reduce_scatter_tensor"] - for_sparse["reduce_scatter_tensor"] == 2 * 2 * h


def test_the_planner_enumerates_ep_by_the_configs_rules_and_keeps_it_in_a_node(capsys):
    """Sparse tiny on 16 GPUs (8 a node), no stages: every fitting layout's ep divides the experts,
    ep x expert_tp divides the ranks, ZeRO 1-2 at ep > 1, sequence parallel at tp > 1; layouts at
    ep > 1 are considered and ep inside a node ranks first among ties; the CLI prints ep and
    refuses an --ep that cannot exist with one line (exit 2)."""
    from cplm_dist_tools.plan import main

    cfg = load_config("tiny", SPARSE)
    fits, considered = plan(cfg, Cluster(gpus=16), seq_len=256, global_batch=64, max_pp=1)
    assert fits and {p.ep for p in fits} >= {1, 2, 4, 8}
    for p in fits:
        assert 8 % p.ep == 0 and (p.tp * p.cp * p.dp) % (p.ep * p.expert_tp) == 0 and p.expert_tp in (1, p.tp)
        assert p.ep == 1 or p.zero_stage in (1, 2)
        assert p.tp == 1 or p.sequence_parallel
    assert fits[0].ep * fits[0].expert_tp <= 8
    assert main(["--config", "tiny", *SPARSE, "--gpus", "16", "--max-pp", "1", "--ep", "4", "--global-batch", "64",
                 "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "| tp | cp | pp | dp | ep | expert tp | ZeRO |" in out and " ep=4 " in out.split("best: ")[1]
    for ep, message in ((3, "--ep 3 does not divide model.moe.num_experts=8"), (8, "--ep 8 does not divide --gpus 4")):
        assert main(["--config", "tiny", *SPARSE, "--gpus", "4", "--ep", str(ep)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert main(["--config", "tiny", *SPARSE, "--gpus", "4", "parallel.ep=3"]) == 2  # the config's own rule, at load
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.ep=3 does not divide model.moe.num_experts=8" in err[0], err


def test_the_30b_a3b_run_config_is_the_planned_layout():
    """configs/runs/qwen3-30b-a3b.yaml is what tools/plan.py --write proposed for it on 64 H100s
    (8 nodes; docs/moe.md): ep 8 inside a node (expert_tp 1), tp 2 with sequence parallelism, pp 2
    under DualPipeV, ZeRO-1; it fits 80 GiB and is predicted as its header says; the same layout
    with ep across nodes (16) is slower, and nothing at ep 1 fits (all 128 experts on a rank)."""
    import re

    ours = load_config(REPO / "configs/runs/qwen3-30b-a3b.yaml")
    p, t = ours.parallel, ours.train
    assert (p.tp, p.pp, p.ep, p.expert_tp, p.pp_schedule, t.zero_stage) == (2, 2, 8, 1, "dualpipev", 1)
    cluster = Cluster(gpus=64)
    common = dict(seq_len=ours.data.seq_length, global_batch=t.global_batch_size, sequence_parallel=True, zero=1,
                  activation_checkpointing=False, micro_batch=t.micro_batch_size, tp=2, pp=2, pp_schedule="dualpipev")
    chosen = predict(ours, cluster, ep=8, expert_tp=1, **common)
    header = (REPO / "configs/runs/qwen3-30b-a3b.yaml").read_text().splitlines()[1]
    assert f"predicted {chosen.step_s:.3g} s a step" in header and f"{chosen.memory_gib:.1f} GiB a GPU" in header, header
    assert chosen.memory_gib <= cluster.headroom * cluster.memory_gib
    assert predict(ours, cluster, ep=16, expert_tp=1, **common).step_s > chosen.step_s
    assert predict(ours, cluster, ep=1, expert_tp=1, **common).memory_gib > cluster.memory_gib
    assert re.search(r"MFU \d+\.\d%", header)
