"""The layout planner: its communication volumes equal what the profiler's collective timer
measures through DeepSpeed and megatron-core (tp = 2 x dp = 2, ZeRO 1, 2, 3, with and without
sequence parallelism and recomputation); its layouts fit and obey the batch arithmetic; the CLI
says when a size needs pipeline parallelism and writes a loadable run config."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cplm_dist.config import load_config
from cplm_dist.model.counting import parameters_per_device, tensor_sizes_per_device
from cplm_dist.profiling.communication import step_bytes
from cplm_dist.profiling.planner import Cluster, plan, predict
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
]


def _config(overrides):
    return load_config("tiny", [*overrides, "parallel.tp=2", "train.precision=fp32", f"train.micro_batch_size={MICRO}",
                                f"data.seq_length={SEQ}", f"train.global_batch_size={MICRO * ACCUMULATION * 2}"])


def _measured_volumes_worker():
    from cplm_dist.parallel import default_device, init_distributed
    from cplm_dist.profiling.measure import measure
    from cplm_dist_tools.cplm_profile import build

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


def test_tensor_sizes_add_up_to_the_parameters_a_device_holds():
    for name, overrides in (("tiny", []), ("cplm-1.7b", ["copy.mix=sentinel", "model.tie_embeddings=false"]),
                            ("cplm-70b", ["copy.mix=joint"])):
        cfg = load_config(name, overrides)
        for tp in (1, 2, 8):
            if cfg.model.num_kv_heads % tp == 0:
                assert sum(tensor_sizes_per_device(cfg, tp)) == parameters_per_device(cfg, tp), (name, tp)


def test_plans_fit_obey_the_batch_and_rank_fastest_first():
    cfg = load_config("cplm-1.7b", ["train.precision=bf16"])
    cluster = Cluster(gpus=16)
    fits, considered = plan(cfg, cluster, seq_len=2048, global_batch=256)
    assert 0 < len(fits) < considered
    for p in fits:
        assert p.memory_gib <= 0.9 * cluster.memory_gib
        assert p.micro_batch * p.accumulation * p.dp == 256 and p.tp * p.dp == 16
        assert 0 < p.mfu <= cluster.achievable + 1e-9  # communication and recomputation only cost
    fastest = min(p.step_s for p in fits)
    assert fits[0].step_s <= fastest * 1.02
    # 64 x 2048 tokens of a 1.7B model's activations on one GPU do not fit; one sequence does
    assert not any(p.tp == 1 and p.micro_batch == 64 and not p.activation_checkpointing for p in fits)
    assert any(p.tp == 1 and p.zero == 1 and p.micro_batch == 1 for p in fits)


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


def test_cli_writes_a_run_config_and_says_when_pipeline_parallelism_is_needed(tmp_path, capsys):
    from cplm_dist_tools.plan import main

    run = tmp_path / "cplm-7b.yaml"
    shutil.copy(REPO / "configs/runs/cplm-7b.yaml", run)
    assert main(["--config", str(run), "--gpus", "64", "--top", "3", "--write", str(run)]) == 0
    out = capsys.readouterr().out
    assert "| tp | dp | ZeRO |" in out and f"wrote {run}" in out
    text = run.read_text()
    assert text.startswith("# cplm-7b") and "# layout from tools/plan.py --gpus 64" in text  # comments kept
    assert "compile: true  # regional torch.compile" in text
    best = out.split("best: ")[1]
    cfg = load_config(str(run))
    assert f"tp={cfg.parallel.tp} " in best and f"ZeRO-{cfg.train.zero_stage} " in best
    assert f"micro {cfg.train.micro_batch_size} " in best and cfg.data.tokenizer == "data/tokenizer.model"

    assert main(["--config", "cplm-70b", "--gpus", "8", "--seq-len", "4096", "--global-batch", "64"]) == 1
    assert "needs pipeline parallelism" in capsys.readouterr().out

    bad = subprocess.run([sys.executable, str(REPO / "tools/plan.py"), "--config", "cplm-7b", "--gpus", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--gpus 0" in bad.stderr
