"""The sparse MLP (cplm_dist.model.moe: megatron-core's MoE layer inside our layer) against a
dense per-token reference, and sparse runs at every layout equal to one process (gloo, CPU).

The reference routes each token alone: the router's logits x W^T, its scores (softmax or sigmoid
plus the expert bias for the choice), the top-k, their weights (renormalised where the config
says), and the weighted sum of the chosen experts' SwiGLU outputs, plus the shared expert (scaled
by its gate). Outputs and every gradient are compared.

The layouts (docs/moe.md, Expert parallelism) are compared with one shared one-process run, loss and
gradient norm at each of 10 steps: six 2-rank layouts, ep x pp at 4 ranks, and the batch cut
differently with activation checkpointing; bad expert layouts exit 2 with one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cplm_dist.config import load_config
from cplm_dist.distributed import destroy_distributed, init_distributed
from cplm_dist.training.run_log import read_metrics
from tests.test_train import REPO, argv, run_cli, train

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
    """A one-rank process group in this test process. Joining publishes MASTER_ADDR/MASTER_PORT,
    RANK and WORLD_SIZE in os.environ (for DeepSpeed): they are put back afterwards, or every later
    subprocess of this worker would try to host its store on this group's port."""
    saved = dict(os.environ)
    init_distributed(1)
    yield
    destroy_distributed()
    os.environ.clear()
    os.environ.update(saved)


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


def test_a_training_forward_counts_its_tokens_once_recomputed_or_not(one_rank):
    """The routed-token counts (megatron's, for the expert bias and the global auxiliary loss; ours,
    for the logs) grow once per training forward: not in evaluation nor under no_grad, and not again
    when activation checkpointing recomputes the layer in backward (cplm_dist.model.moe_recompute),
    where the global auxiliary loss's gradient is also the one its forward computed (2 micro-batches:
    its running average over them)."""
    from cplm_dist.model.cplm import build_model
    from cplm_dist.model.moe import sparse_layers

    cfg = load_config(REPO / "configs/quickstart.yaml", ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
                                                        "model.num_kv_heads=2", "model.ffn_hidden_size=24",
                                                        "model.vocab_size=512", "model.moe.num_experts=4",
                                                        "model.moe.score=sigmoid", "model.moe.expert_bias=true",
                                                        "model.moe.aux_loss=global"])
    torch.manual_seed(0)
    model = build_model(cfg)
    layers = sparse_layers(model)
    micro_batches = [torch.randint(0, 512, (2, 16)) for _ in range(2)]

    def counters():
        return [t.clone() for layer in layers for t in layer._counters()]

    def step(recompute: bool):
        for layer in model.layers:
            layer.recompute = recompute
        model.zero_grad()
        for ids in micro_batches:
            model(ids).nll.sum().backward()
        found = counters(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        for layer in layers:
            for t in layer._counters():
                t.zero_()
            layer.reset_replay()
        return found

    model.eval()
    with torch.no_grad():
        model(micro_batches[0])
    model.train()
    with torch.no_grad():
        model(micro_batches[0])
    assert all(not t.any() for t in counters()), "evaluation and no_grad forwards count nothing"
    (plain, plain_grads), (recomputed, recomputed_grads) = step(False), step(True)
    assert float(plain[0].sum()) == 2 * 2 * 16 * 2  # megatron's: micro-batches x tokens x top-k
    assert float(plain[3].sum()) == 2 * 2 * 16 * 2  # our own load figure counts them too
    for a, b in zip(plain, recomputed):
        torch.testing.assert_close(a, b)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(recomputed_grads[name], grad, msg=name)


# --- sparse runs at every layout equal one process ------------------------------------------------

SPARSE = ("model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.aux_loss=sequence", "model.moe.aux_loss_coeff=0.01",
          "model.moe.score=sigmoid", "model.moe.expert_bias=true", "train.global_batch_size=4", "train.micro_batch_size=2",
          "optim.clip_grad=0.05", "train.precision=fp32", "train.train_steps=10")
TP_SP = ("parallel.tp=2", "parallel.sequence_parallel=true")


def trajectory(out_dir) -> dict[int, tuple[float, float]]:
    """step -> (loss, gradient norm before clipping) from a run's metrics."""
    return {s: (r["loss"], r["grad_norm"]) for s, r in read_metrics(Path(out_dir) / "logs" / "metrics.jsonl").items()}


@pytest.fixture(scope="module")
def one_process(small_data, tmp_path_factory):
    """The straight sparse run every layout is compared with: one process, 10 steps, micro-batch 2
    x accumulation 2, the per-sequence auxiliary loss and the expert bias on, clipping every step."""
    out = tmp_path_factory.mktemp("moe-one") / "run"
    assert train(1, argv(small_data, out, *SPARSE)) == [0]
    return trajectory(out)


def assert_follows(got: dict, want: dict) -> None:
    """Loss and gradient norm (the one clipping used: each expert counted once) at every step, 1e-4."""
    assert sorted(got) == sorted(want)
    for step, (loss, norm) in want.items():
        assert got[step][0] == pytest.approx(loss, abs=1e-4), ("loss", step)
        assert got[step][1] == pytest.approx(norm, abs=1e-4, rel=1e-5), ("grad_norm", step)


LAYOUTS = {  # 2 ranks each; what each adds
    "dp2-zero0": ("train.zero_stage=0",),  # the engine's all-reduce path, our norm and clipping (ep > 1 at ZeRO-0 is refused)
    "ep2-dp2-zero2": ("parallel.ep=2", "train.zero_stage=2"),
    "ep2-tp2-etp1-zero1": ("parallel.ep=2", *TP_SP, "parallel.expert_tp=1", "train.zero_stage=1"),  # ep over the tp ranks
    "ep2-tp2-etp1-zero2": ("parallel.ep=2", *TP_SP, "parallel.expert_tp=1", "train.zero_stage=2"),
    "tp2-etp2-zero1": (*TP_SP, "parallel.expert_tp=2", "train.zero_stage=1"),  # experts split over tp (uneven gathers)
    "ep2-cp2-zero1": ("parallel.ep=2", "parallel.cp=2", "train.zero_stage=1"),  # ep carved out of cp
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_sparse_run_at_ep2_equals_one_process(small_data, tmp_path, one_process, layout):
    assert train(2, argv(small_data, tmp_path / "run", *SPARSE, *LAYOUTS[layout])) == [0, 0]
    assert_follows(trajectory(tmp_path / "run"), one_process)


def test_a_sparse_pipeline_at_ep2_equals_one_process(small_data, tmp_path, one_process):
    """ep 2 x pp 2 (1F1B, dp 2 a stage: 4 ranks): the layer indices a stage builds, the auxiliary
    loss's gradient through DeepSpeed's pipeline engine and each stage's expert bias."""
    layout = ("parallel.ep=2", "parallel.pp=2", "train.zero_stage=1", "train.micro_batch_size=1")
    assert train(4, argv(small_data, tmp_path / "run", *SPARSE, *layout)) == [0] * 4
    assert_follows(trajectory(tmp_path / "run"), one_process)


def test_one_micro_batch_of_4_equals_two_of_2_recomputed(small_data, tmp_path, one_process):
    """The same batch cut into 1 micro-batch of 4 instead of 2 of 2 trains alike: the per-sequence
    auxiliary loss is invariant to the cut (micro_batch and global are not: docs/moe.md), the expert
    bias moves once a step from the step's counts, and activation checkpointing counts nothing twice."""
    layout = ("train.micro_batch_size=4", "train.activation_checkpointing=true")
    assert train(1, argv(small_data, tmp_path / "run", *SPARSE, *layout)) == [0]
    assert_follows(trajectory(tmp_path / "run"), one_process)


@pytest.mark.parametrize("extra, world, expected", [
    (("parallel.ep=2", "train.zero_stage=3"), None,
     "error: parallel.ep > 1 with train.zero_stage=3: ZeRO-3 would partition each expert over ranks that do not hold "
     "it; use train.zero_stage=1 or 2 (experts reduced over the expert-data-parallel group)"),
    (("parallel.ep=3",), None, "error: parallel.ep=3 does not divide model.moe.num_experts=4: choose ep from [1, 2, 4]"),
    (("parallel.ep=4", "train.zero_stage=1"), "2", "error: parallel.ep=4 x expert_tp=1 does not divide the 2 ranks of a pipeline stage "
     "(tp x cp x dp): choose ep from [1, 2]"),
], ids=["zero3", "ep-experts", "ep-world"])
def test_an_expert_layout_that_cannot_work_is_one_line_exit_2(small_data, tmp_path, extra, world, expected):
    env = {"RANK": "0", "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"} if world else None
    proc = run_cli(argv(small_data, tmp_path / "run", *SPARSE, *extra), env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith(("error", "Traceback"))] == [expected]
    assert not (tmp_path / "run").exists()
