"""The FLOP count that training logs and the profiler share, against a count by hand."""

import pytest

from cplm_dist.config import load_config
from cplm_dist.model.counting import matmul_parameters, parameter_count
from cplm_dist.training.throughput import PEAK_FLOPS, flops_per_token, peak_for_name


def test_flops_per_token_tiny_by_hand():
    cfg = load_config("tiny")  # L=2, D=128, 8 heads x 16, 4 kv heads, ffn 256, V=512, copy 1 x 32 gate
    per_layer = 128 * (8 + 2 * 4) * 16 + 128 * 128 + 3 * 128 * 256  # qkv + out + SwiGLU = 147,456
    n = 2 * per_layer + 512 * 128 + (2 * 128 * 32 + 128)  # + LM head + copy q, k, gate = 368,768
    assert matmul_parameters(cfg) == n == 368_768
    forward = 2 * n + 4 * 2 * 64 * 128 + 2 * 64 * 1 * 32  # + QK^T and AV (full T) + copy scores
    assert flops_per_token(cfg, 64) == 3 * forward == 2_421_504
    # copy off: no copy parameters, no copy scores
    off = load_config("tiny", ["copy.enabled=false"])
    assert flops_per_token(off, 64) == 3 * (2 * (2 * per_layer + 512 * 128) + 4 * 2 * 64 * 128)


def test_flops_per_token_of_qwen3_read_its_head_dim():
    """qwen3-0.6b: 16 heads x 128 = 2048 wide q beside hidden 1024, in the matrices and in QK^T, AV;
    the qk-norm weights multiply nothing."""
    cfg = load_config("qwen3-0.6b")  # L=28, D=1024, 16 heads x 128, 8 kv heads, ffn 3072, V=151936, copy 2 x 128 gate
    per_layer = 1024 * (16 + 2 * 8) * 128 + 16 * 128 * 1024 + 3 * 1024 * 3072  # qkv + out + SwiGLU = 15,728,640
    n = 28 * per_layer + 151936 * 1024 + (2 * 1024 * 2 * 128 + 1024)  # + LM head + copy q, k, gate
    assert matmul_parameters(cfg) == n == 596_509_696
    assert flops_per_token(cfg, 4096) == 3 * (2 * n + 4 * 28 * 4096 * 16 * 128 + 2 * 4096 * 2 * 128)


def test_six_n_dominates_at_scale_and_matches_the_parameter_count():
    cfg = load_config("cplm-1.7b")
    n = matmul_parameters(cfg)
    # every parameter but the norms is a matmul weight; tied embedding counts once as the LM head
    counts = parameter_count(cfg)
    norms = cfg.model.num_layers * 2 * cfg.model.hidden_size + cfg.model.hidden_size + 1  # + the gate bias
    assert n == counts["total"] - norms
    f = flops_per_token(cfg, 2048)
    assert 6 * n < f < 6 * n * 1.25  # attention adds ~13% at T = 2048


def test_the_peak_follows_the_precision_and_there_is_none_on_cpu():
    """Vendor datasheet figures (dense): H100 SXM 989 TFLOP/s bf16, 494.5 TF32; A100 312 / 156."""
    import torch

    from cplm_dist.training.throughput import device_peak_flops

    assert peak_for_name("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_for_name("NVIDIA H100 80GB HBM3", "fp32") == 494.5e12
    assert peak_for_name("NVIDIA A100-SXM4-80GB", "fp32") == 156e12
    assert device_peak_flops("bf16", torch.device("cpu")) is None  # no honest peak, so no MFU


@pytest.mark.parametrize("name,entry", [
    ("NVIDIA H200", "H200"), ("NVIDIA GH200 480GB", "GH200"), ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA L4", "L4"), ("NVIDIA L40", "L40"), ("NVIDIA L40S", "L40S"), ("NVIDIA GeForce RTX 4090", None),
])
def test_device_names_find_their_own_peak(name, entry):
    assert peak_for_name(name, "bf16") == (PEAK_FLOPS[entry]["bf16"] if entry else None)


def test_a_sparse_model_counts_every_expert_and_flops_on_the_active_ones():
    """model.moe: parameter_count holds all E experts, a token uses the router, top_k experts and the
    shared expert (active_parameters, N_matmul, so MFU); per device the experts split over ep; the
    memory estimator reads the same shapes."""
    from cplm_dist.model.counting import active_parameters, parameters_per_device, tensor_sizes_per_device
    from cplm_dist.profiling.memory import estimate

    sparse = ["model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.ffn_hidden_size=64",
              "model.moe.shared_ffn_hidden_size=128"]
    cfg = load_config("tiny", sparse + ["model.moe.first_dense_layers=1"])
    dense = 128 * (8 + 2 * 4) * 16 + 128 * 128  # qkv + out, both layers
    router, expert, shared = 8 * 128, 3 * 128 * 64, 3 * 128 * 128  # layer 1's router, one SwiGLU expert, the shared one
    layers = 2 * dense + 3 * 128 * 256 + router + 8 * expert + shared  # layer 0 keeps the dense MLP
    assert parameter_count(cfg)["layers"] == layers + 4 * 128  # + the four norms
    assert parameter_count(cfg)["total"] - active_parameters(cfg) == 6 * expert  # 6 of 8 experts idle a token
    n = 2 * dense + 3 * 128 * 256 + router + 2 * expert + shared + 512 * 128 + (2 * 128 * 32 + 128)
    assert matmul_parameters(cfg) == n
    assert flops_per_token(cfg, 64) == 3 * (2 * n + 4 * 2 * 64 * 128 + 2 * 64 * 1 * 32)
    at_ep2 = load_config("tiny", sparse + ["model.moe.first_dense_layers=1", "parallel.ep=2"])
    assert parameters_per_device(cfg, 1) - parameters_per_device(at_ep2, 1) == 4 * expert
    assert sum(tensor_sizes_per_device(at_ep2, 1)) == parameters_per_device(at_ep2, 1)
    for config in (cfg, load_config("tiny", sparse)):  # a sparse layer 0 too: its activations at the active width
        assert estimate(config, tp=1, dp=1, micro_batch=2, seq_len=64).total > 0
