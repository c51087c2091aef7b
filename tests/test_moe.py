"""The sparse MLP (cplm_dist.model.moe: megatron-core's MoE layer inside our layer) against a
dense per-token reference, and sparse runs at every layout equal to one process (gloo, CPU).

The reference routes each token alone: the router's logits x W^T, its scores (softmax or sigmoid
plus the expert bias for the choice), the top-k, their weights (renormalised where the config
says), and the weighted sum of the chosen experts' SwiGLU outputs, plus the shared expert (scaled
by its gate). Outputs and every gradient are compared."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cplm_dist.config import load_config
from cplm_dist.distributed import destroy_distributed, init_distributed
from tests.spawn import run_ranks
from tests.test_train import REPO, argv, losses, train

LAYER_CASES = {
    "alltoall": [],
    "allgather": ["model.moe.dispatcher=allgather"],
    "shared-gated": ["model.moe.shared_ffn_hidden_size=48", "model.moe.shared_gate=true"],
    "sigmoid-bias": ["model.moe.score=sigmoid", "model.moe.expert_bias=true"],
    "pre-softmax": ["model.moe.normalize=false"],
    "capacity": ["model.moe.capacity_factor=0.5"],
    "grouped-gemm": ["model.moe.expert_impl=grouped"],  # the GPU path (torch's grouped mm), equal on CPU
    "grouped-allgather-shared": ["model.moe.expert_impl=grouped", "model.moe.dispatcher=allgather",
                                 "model.moe.shared_ffn_hidden_size=48"],
}


def _swiglu(x, fc1, fc2):
    gate, up = (x @ fc1.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ fc2.t()


def reference(mlp, x: torch.Tensor, cfg) -> torch.Tensor:
    """The sparse MLP token by token, from its own parameters (x: (N, D)). Without capacity."""
    e = cfg.model.moe
    logits = x @ mlp.router.weight.t()
    if e.score == "softmax":
        if e.normalize:
            top, index = logits.topk(e.top_k, dim=-1)
            weights = top.softmax(-1)
        else:
            weights, index = logits.softmax(-1).topk(e.top_k, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        choice = scores + (mlp.router.expert_bias if e.expert_bias else 0)
        index = choice.topk(e.top_k, dim=-1).indices
        picked = scores.gather(1, index)
        weights = picked / picked.sum(-1, keepdim=True)
    experts = mlp.experts.local_experts
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(e.top_k):
            ex = experts[int(index[n, k])]
            out[n] += weights[n, k] * _swiglu(x[n], ex.linear_fc1.weight, ex.linear_fc2.weight)
    if mlp.shared_experts is not None:
        s = mlp.shared_experts
        shared = _swiglu(x, s.linear_fc1.weight, s.linear_fc2.weight)
        if e.shared_gate:
            shared = shared * torch.sigmoid(x @ s.gate_weight.t())
        out = out + shared
    return out


@pytest.fixture(scope="module")
def one_rank():
    init_distributed(1)
    yield
    destroy_distributed()


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_the_sparse_layer_equals_a_dense_per_token_reference(one_rank, case):
    from cplm_dist.model.cplm import build_model

    cfg = load_config(REPO / "configs/quickstart.yaml", ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=4",
                                                        "model.num_kv_heads=2", "model.ffn_hidden_size=24",
                                                        "model.moe.num_experts=4", "model.moe.aux_loss_coeff=0",
                                                        *LAYER_CASES[case]])
    mlp = build_model(cfg).layers[0].mlp.eval()
    if cfg.model.moe.expert_bias:  # a bias that changes the choice, not the weights
        mlp.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    torch.manual_seed(0)
    x = torch.randn(3, 5, 32, requires_grad=True)
    y = mlp(x)
    x_ref = x.detach().clone().requires_grad_(True)
    if cfg.model.moe.capacity_factor is not None:
        # capacity 0.5: each expert keeps at most half its even share; a dropped assignment adds nothing
        assert y.abs().sum(-1).min() < reference(mlp, x_ref.reshape(-1, 32), cfg).abs().sum(-1).min() + 1e-6
        return
    # megatron's layer works in [T, B, D]: the same tokens in another order
    expected = reference(mlp, x_ref.transpose(0, 1).reshape(-1, 32), cfg).reshape(5, 3, 32).transpose(0, 1)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(y)
    params = [p for p in mlp.parameters()]
    got = torch.autograd.grad(y, [x, *params], grad)
    want = torch.autograd.grad(expected, [x_ref, *params], grad, allow_unused=True)
    for name, g, w in zip(["input", *[n for n, _ in mlp.named_parameters()]], got, want):
        torch.testing.assert_close(g, w if w is not None else torch.zeros_like(g), atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("overrides, line", [
    (["parallel.ep=2"], "parallel.ep=2 splits experts, and this model has none"),
    (["model.moe.num_experts=6", "parallel.ep=4"], "parallel.ep=4 does not divide model.moe.num_experts=6: choose ep from [1, 2, 3, 6]"),
    (["model.moe.num_experts=4", "model.moe.top_k=5"], "model.moe.top_k=5 must lie in [1, model.moe.num_experts=4]"),
    (["model.moe.num_experts=4", "parallel.tp=2"], "needs parallel.sequence_parallel=true"),
    (["model.moe.num_experts=4", "parallel.ep=2", "train.zero_stage=3"], "parallel.ep > 1 with train.zero_stage=3"),
    (["model.moe.num_experts=4", "parallel.ep=2", "train.zero_stage=0"], "parallel.ep > 1 with train.zero_stage=0"),
    (["model.moe.num_experts=4", "model.moe.expert_bias=true"], "routes on sigmoid scores plus the bias"),
    (["model.moe.num_experts=4", "model.moe.first_dense_layers=4"], "leaves no sparse layer"),
    (["model.moe.num_experts=4", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.expert_tp=3"],
     "parallel.expert_tp=3 must be 1 or parallel.tp=2"),
])
def test_a_sparse_config_that_cannot_run_is_one_line(overrides, line):
    from cplm_dist.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_config(REPO / "configs/quickstart.yaml", overrides)
    assert line in str(caught.value) and "\n" not in str(caught.value)


def test_an_expert_layout_that_does_not_fit_the_world_is_one_line():
    from cplm_dist.config.sparse import check_expert_world
    from cplm_dist.errors import ConfigError

    cfg = load_config(REPO / "configs/quickstart.yaml", ["model.moe.num_experts=8", "parallel.ep=4", "train.zero_stage=1"])
    check_expert_world(cfg, 4)
    with pytest.raises(ConfigError, match=r"parallel.ep=4 x expert_tp=1 does not divide the 2 ranks .* choose ep from \[1, 2\]"):
        check_expert_world(cfg, 2)


# --- sparse runs at every layout equal one process ------------------------------------------------

SPARSE = ("model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.aux_loss=sequence", "model.moe.aux_loss_coeff=0.01",
          "train.global_batch_size=4", "train.micro_batch_size=2", "optim.clip_grad=0.05", "train.precision=fp32")


@pytest.fixture(scope="module")
def one_process(small_data, tmp_path_factory):
    """The straight sparse run every layout is compared with: one process, 10 steps."""
    out = tmp_path_factory.mktemp("moe-one") / "run"
    assert train(1, argv(small_data, out, *SPARSE, "train.train_steps=10")) == [0]
    return losses(out)


@pytest.mark.parametrize("layout", [
    ("parallel.ep=2", "train.zero_stage=1"),
    ("parallel.ep=2", "train.zero_stage=2"),
    ("parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.expert_tp=1", "train.zero_stage=1"),
], ids=["ep2-dp2-zero1", "ep2-dp2-zero2", "ep2-tp2-sp-zero1"])
def test_a_sparse_run_at_ep2_equals_one_process(small_data, tmp_path, one_process, layout):
    assert train(2, argv(small_data, tmp_path / "run", *SPARSE, "train.train_steps=10", *layout)) == [0, 0]
    got = losses(tmp_path / "run")
    assert sorted(got) == sorted(one_process)
    for step in one_process:
        assert got[step] == pytest.approx(one_process[step], abs=1e-4), step
