"""optim.name=muon: one step equals the published algorithm (a reference written here, fp32
Newton-Schulz); training at tp 2 (ZeRO-1), tp 2 + sp (ZeRO-2), dp 2 (ZeRO-1) and pp 2 follows one
process for 10 steps; a resume is exact and --reshape tp 2 -> tp 1 carries the momentum; the
layouts Muon cannot make exact are one line."""

import math

import pytest
import torch

from cplm_dist.config import ConfigError, load_config

# --- one step against the published algorithm ----------------------------------------------------


def _reference_muon(weight, grads, lr, momentum, decay, scale=0.2, steps=5):
    """Keller Jordan's Muon (quintic Newton-Schulz, a, b, c = 3.4445, -4.7750, 2.0315, on the wide
    orientation after dividing by the Frobenius norm + 1e-7) with Nesterov momentum in the form
    B = mu B + G, U = G + mu B, Moonlight's update scale 0.2 sqrt(max(A, B)) and decoupled decay."""
    w, buf = weight.clone().double(), torch.zeros_like(weight, dtype=torch.float64)
    for g in grads:
        g = g.double()
        buf = momentum * buf + g
        u = g + momentum * buf
        x = u.T if u.shape[0] > u.shape[1] else u
        x = x / (torch.linalg.matrix_norm(x) + 1e-7)
        for _ in range(steps):
            a_mat = x @ x.T
            x = 3.4445 * x + (-4.7750 * a_mat + 2.0315 * a_mat @ a_mat) @ x
        o = x.T if u.shape[0] > u.shape[1] else x
        w = w * (1 - lr * decay) - lr * scale * math.sqrt(max(u.shape)) * o
    return w.float()


@pytest.mark.parametrize("shape", [(48, 32), (32, 48)], ids=["tall", "wide"])
def test_a_muon_step_equals_the_published_algorithm(shape):
    from cplm_dist.model.parallel.sharding import REPLICATED
    from cplm_dist.train.muon import Matrix, Orthogonaliser
    from cplm_dist.train.optim import GuardedMuon

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(*shape))
    weight._cplm_matrix = Matrix("layers.0.mlp.fc1.weight", REPLICATED)
    want = _reference_muon(weight.detach(), [torch.randn(*shape) for _ in range(3)], lr=0.02, momentum=0.95, decay=0.1)
    torch.manual_seed(0)
    torch.randn(*shape)
    opt = GuardedMuon([{"params": [weight], "orthogonal": True, "momentum": 0.95, "nesterov": True, "weight_decay": 0.1}],
                      Orthogonaliser(None, ns_dtype=torch.float32), lr=0.02)
    for _ in range(3):
        weight.grad = torch.randn(*shape)
        opt.step()
    assert (weight.detach() - want).abs().max().item() < 1e-6
    assert set(opt.state[weight]) == {"momentum_buffer", "step"}  # one buffer where AdamW keeps two
    assert opt.state[weight]["step"].item() == 3


def test_the_qkv_row_sets_are_the_attentions_queries_keys_and_values():
    from cplm_dist.train.muon import qkv_row_sets

    heads, kv, hd = 6, 2, 4
    rows = torch.arange((heads + 2 * kv) * hd)
    view = rows.view(kv, heads // kv + 2, hd)  # the attention's own split (cplm_dist.model.attention)
    q, k, v = qkv_row_sets(heads, kv, hd)
    assert torch.equal(q, view[:, : heads // kv].reshape(-1)) and torch.equal(k, view[:, -2].reshape(-1))
    assert torch.equal(v, view[:, -1].reshape(-1))


def test_layouts_muon_cannot_make_exact_are_one_line():
    for overrides, match in (
        (["train.zero_stage=3"], r"^optim.name=muon with train.zero_stage=3: .* use train.zero_stage <= 2"),
        (["train.precision=bf16", "train.zero_stage=0"], r"^optim.name=muon with train.precision=bf16 at train.zero_stage=0"),
        (["train.precision=bf16", "train.zero_stage=1", "train.grad_accum_dtype=fp32"], r"BF16_Optimizer"),
        (["optim.muon.momentum=1.0"], r"^optim.muon.momentum=1.0 must be within \[0, 1\)"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config("tiny", ["optim.name=muon", *overrides])
    load_config("tiny", ["optim.name=adamw", "train.zero_stage=3"])  # AdamW keeps every stage


def _groups_worker(overrides):
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model
    from cplm_dist.train.optim import parameter_groups

    init_distributed(1)
    cfg = load_config("tiny", overrides)
    model = build_model(cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in parameter_groups(model, cfg)}
    groups["decayed"] = sorted(n for n, p in model.named_parameters() if getattr(p, "_cplm_decay", False))
    return groups


def test_muon_takes_the_layers_matrices_and_adamw_the_rest():
    from tests.spawn import run_ranks

    plain = run_ranks(_groups_worker, 1, args=(["optim.name=muon", "copy.mix=gate"],))[0]
    assert plain["muon"] and all(n.startswith("layers.") and n.endswith("weight") and "norm" not in n for n in plain["muon"])
    # one AdamW group on every pipeline stage; its matrices decayed, the embedding, norms and biases not
    assert set(plain) == {"muon", "adamw", "decayed"} and {"copy_head.q.weight", "embedding.weight"} <= set(plain["adamw"])
    assert "copy_head.q.weight" in plain["decayed"] and "embedding.weight" not in plain["decayed"]
    with_copy = run_ranks(_groups_worker, 1, args=(["optim.name=muon", "optim.muon.copy_head=true"],))[0]
    assert {"copy_head.q.weight", "copy_head.k.weight"} <= set(with_copy["muon"])


# --- training: every layout follows one process ---------------------------------------------------

STEPS = 10


def _args(small_data, out, *extra):
    from tests.test_train import argv

    return argv(small_data, out, "optim.name=muon", "optim.muon.lr=0.01", "model.num_layers=4",
                f"train.train_steps={STEPS}", "train.global_batch_size=4", "optim.clip_grad=1.0",
                "train.save_interval=5", "optim.muon.split_qkv=true", *extra)


@pytest.fixture(scope="module")
def muon_runs(small_data, tmp_path_factory):
    """One process at ZeRO-0 (the reference) and tp 2 at ZeRO-1, each saving at steps 5 and 10."""
    from tests.test_train import train

    root = tmp_path_factory.mktemp("muon")
    assert train(1, _args(small_data, root / "one", "train.micro_batch_size=4", "train.zero_stage=0")) == [0]
    assert train(2, _args(small_data, root / "tp2", "train.micro_batch_size=4", "train.zero_stage=1",
                          "parallel.tp=2")) == [0, 0]
    return root


def _follows(got_dir, want_dir, tolerance, keys=("loss",)):
    from cplm_dist.train.run_log import read_metrics

    got, want = (read_metrics(d / "logs" / "metrics.jsonl") for d in (got_dir, want_dir))
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        for key in keys:
            assert abs(got[step][key] - want[step][key]) < tolerance, (step, key, got[step][key], want[step][key])


def test_muon_at_tp2_follows_one_process_and_differs_from_adamw(small_data, muon_runs, tmp_path):
    """The logged gradient norm is the raw gradient's (clipping at 1.0 exercised) at both layouts."""
    from tests.test_train import losses, train

    _follows(muon_runs / "tp2", muon_runs / "one", 1e-4, keys=("loss", "lm_loss", "grad_norm"))
    adamw = tmp_path / "adamw"
    assert train(1, _args(small_data, adamw, "train.micro_batch_size=4", "train.zero_stage=0", "optim.name=adamw",
                          "train.train_steps=3")) == [0]
    assert abs(losses(adamw)[3] - losses(muon_runs / "one")[3]) > 1e-3  # Muon is not AdamW under another name


@pytest.mark.parametrize("world,extra", [
    (2, ("parallel.tp=2", "parallel.sequence_parallel=true", "train.zero_stage=2", "train.micro_batch_size=4")),
    (2, ("train.zero_stage=1", "train.micro_batch_size=2")),
    (2, ("parallel.pp=2", "train.zero_stage=1", "train.micro_batch_size=1")),
], ids=["tp2-sp-zero2", "dp2-zero1", "pp2-zero1"])
def test_muon_layouts_follow_one_process(small_data, muon_runs, tmp_path, world, extra):
    from tests.test_train import train

    out = tmp_path / "run"
    assert train(world, _args(small_data, out, *extra)) == [0] * world
    _follows(out, muon_runs / "one", 1e-4)


def test_a_resumed_muon_run_equals_the_straight_one(small_data, muon_runs, tmp_path):
    from tests.test_train import losses, train

    out = tmp_path / "resumed"
    source = muon_runs / "tp2" / "checkpoints" / "step-00000005"
    assert train(2, _args(small_data, out, "train.micro_batch_size=4", "train.zero_stage=1", "parallel.tp=2",
                          "--resume", str(source))) == [0, 0]
    got, want = losses(out), losses(muon_runs / "tp2")
    assert sorted(got) == list(range(6, STEPS + 1))
    for step in got:
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])


@pytest.mark.parametrize("world,extra", [
    (1, ("train.micro_batch_size=4", "train.zero_stage=0")),
    (2, ("train.micro_batch_size=2", "train.zero_stage=1")),
], ids=["tp1-zero0", "dp2-zero1"])
def test_reshape_from_tp2_carries_the_momentum(small_data, muon_runs, tmp_path, world, extra):
    """ZeRO-1 at tp 2 -> ZeRO-0 at tp 1 (our loader reads momentum_buffer) and -> dp 2 ZeRO-1
    (DeepSpeed's loader into the flat partitions): within 1e-5 of the straight run; with the
    momentum dropped the continuation leaves it at once (seen: 6e-3 at step 7)."""
    from tests.test_train import losses, train

    out = tmp_path / "reshaped"
    source = muon_runs / "tp2" / "checkpoints" / "step-00000005"
    assert train(world, _args(small_data, out, *extra, "--resume", str(source), "--reshape")) == [0] * world
    got, want = losses(out), losses(muon_runs / "tp2")
    assert sorted(got) == list(range(6, STEPS + 1))
    for step in got:
        assert abs(got[step] - want[step]) <= 1e-5, (step, got[step], want[step])
