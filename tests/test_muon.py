"""optim.name=muon: one step equals the published algorithm (a reference written here, fp32
Newton-Schulz); training at tp 2 (ZeRO-1), tp 2 + sp (ZeRO-2), dp 2 (ZeRO-1), pp 2 and cp 2
(ZeRO-1 over the dp x cp partitions) follows one process for 10 steps; a resume is exact and
--reshape carries the momentum; the layouts Muon cannot make exact are one line; the estimator,
the FLOP count and the planner price it; the non-finite guard covers it."""

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
    from cplm_dist.training.muon import Matrix, Orthogonaliser
    from cplm_dist.training.optim import GuardedMuon

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
    from cplm_dist.training.muon import qkv_row_sets

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
    from cplm_dist.training.optim import parameter_groups

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
    from cplm_dist.training.run_log import read_metrics

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
    (2, ("parallel.cp=2", "train.zero_stage=1", "train.micro_batch_size=4")),
], ids=["tp2-sp-zero2", "dp2-zero1", "pp2-zero1", "cp2-zero1"])
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


# --- the memory estimator -------------------------------------------------------------------------


def _state_bytes_worker(overrides):
    """Bytes of the optimizer's moment and momentum tensors after a real training step (on the
    modules' parameters at ZeRO-0, DeepSpeed's flat partitions at ZeRO-1), and the estimator's
    optimizer bytes for the layout."""
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model
    from cplm_dist.profiling.memory import estimate
    from cplm_dist.training.engine import build_engine
    from cplm_dist.training.step import TrainStep

    cfg = load_config("tiny", ["train.precision=fp32", "data.seq_length=64", "train.global_batch_size=4", "train.micro_batch_size=2", *overrides])
    dims = init_distributed(cfg.parallel.tp)
    torch.manual_seed(0)
    engine, optimizer, scheduler = build_engine(build_model(cfg), cfg, dims)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 2, 64))
    labels = torch.cat([ids[..., 1:], torch.full((2, 2, 1), -100)], dim=-1)
    TrainStep(engine, optimizer, scheduler, dims, cfg)(iter([{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]))
    held = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.numel() > 1)  # the step counters are scalars
    return held, estimate(cfg, tp=dims.tp_size, dp=dims.dp_size, micro_batch=2, seq_len=cfg.data.seq_length).optimizer


@pytest.mark.parametrize("world,overrides", [
    (1, ["train.zero_stage=0"]), (2, ["train.zero_stage=0", "parallel.tp=2"]), (2, ["train.zero_stage=1"]),
], ids=["one", "tp2-zero0", "dp2-zero1"])
def test_the_estimators_optimizer_bytes_are_what_a_muon_step_holds(world, overrides):
    """One fp32 momentum buffer for the layers' matrices, AdamW's two moments for the rest: the
    estimate equals the held state (ZeRO-1's flat partitions pad to alignment: 0.1%), and is
    below AdamW's by the momentum AdamW would add."""
    from tests.spawn import run_ranks

    for held, estimated in run_ranks(_state_bytes_worker, world, args=(["optim.name=muon", *overrides],)):
        assert abs(held / estimated - 1) < 1e-3, (held, estimated)
    adamw = run_ranks(_state_bytes_worker, world, args=(overrides,))[0]
    assert abs(adamw[0] / adamw[1] - 1) < 1e-3 and adamw[1] > estimated * 1.3, (adamw, estimated)


# --- FLOPs and the planner --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(48, 80), (80, 48)], ids=["wide", "tall"])
def test_newton_schulz_flops_are_torchs_count_of_the_iteration(shape):
    from torch.utils.flop_counter import FlopCounterMode

    from cplm_dist.profiling.muon_cost import newton_schulz_flops
    from cplm_dist.training.muon import newton_schulz

    with FlopCounterMode(display=False) as counter:
        newton_schulz(torch.randn(*shape), steps=3)
    assert counter.get_total_flops() == newton_schulz_flops(shape, 3)


def _step_flops_worker(overrides):
    """torch's FLOP count of a real Muon step (ZeRO-0, one rank: every matrix) and muon_step_cost's."""
    from torch.utils.flop_counter import FlopCounterMode

    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model
    from cplm_dist.model.parallel.stages import pipeline_stages
    from cplm_dist.profiling.muon_cost import muon_step_cost
    from cplm_dist.training.optim import build_optimizer

    init_distributed(1)
    cfg = load_config("tiny", ["optim.name=muon", *overrides])
    model = build_model(cfg)
    optimizer = build_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    with FlopCounterMode(display=False) as counter:
        optimizer.step()
    predicted, volumes = muon_step_cost(cfg, pipeline_stages(cfg, 1, 1)[0], tp=1, partitions=1, zero=0)
    return counter.get_total_flops(), predicted, volumes


@pytest.mark.parametrize("overrides", [["optim.muon.split_qkv=true"], ["optim.muon.copy_head=true", "model.num_kv_heads=2"]],
                         ids=["split-qkv", "copy-head-gqa"])
def test_the_step_flops_the_planner_counts_are_a_real_steps(overrides):
    from tests.spawn import run_ranks

    counted, predicted, volumes = run_ranks(_step_flops_worker, 1, args=(overrides,))[0]
    assert counted == predicted > 0 and volumes == {}


def test_the_planner_prices_muon_and_proposes_only_layouts_it_runs():
    from cplm_dist.profiling.planner import Cluster, plan

    cluster = Cluster(gpus=16)
    kw = dict(seq_len=2048, global_batch=256)
    adamw, _ = plan(load_config("cplm-360m", ["train.precision=bf16"]), cluster, **kw)
    muon, _ = plan(load_config("cplm-360m", ["train.precision=bf16", "optim.name=muon"]), cluster, **kw)
    assert muon and all(p.optimizer_s > 0 and p.zero_stage in (1, 2) for p in muon)  # bf16: ZeRO-0 and ZeRO-3 refused
    assert all(p.optimizer_s == 0 for p in adamw) and any(p.zero_stage in (0, 3) for p in adamw)
    same = {(p.tp, p.pp, p.cp, p.zero_stage, p.micro_batch, p.activation_checkpointing, p.sequence_parallel, p.pp_schedule): p
            for p in adamw}
    for p in muon:
        twin = same[(p.tp, p.pp, p.cp, p.zero_stage, p.micro_batch, p.activation_checkpointing, p.sequence_parallel, p.pp_schedule)]
        assert p.step_s > twin.step_s  # Newton-Schulz and its gathers


# --- the non-finite guard ---------------------------------------------------------------------------


@pytest.mark.parametrize("zero", [0, 1])
def test_a_nonfinite_muon_step_is_skipped_leaving_the_weights(small_data, tmp_path, zero):
    """One guard decision for both halves (ours at ZeRO-0, on DeepSpeed's partitions at ZeRO-1):
    the skipped step's weights are the step before's, and training goes on."""
    from cplm_dist.training.run_log import read_metrics
    from tests.test_train import argv, train

    out = tmp_path / "nan"
    assert train(1, argv(small_data, out, "optim.name=muon", "train.train_steps=4", f"train.zero_stage={zero}",
                         "train.inject_nonfinite_at=[3]", "train.save_interval=1", "train.keep_last=4")) == [0]
    log = read_metrics(out / "logs" / "metrics.jsonl")
    assert log[2]["skipped_steps"] == 0 and log[3]["skipped_steps"] == 1 and log[4]["loss"] == log[4]["loss"]
    before, skipped, after = (torch.load(out / "checkpoints" / f"step-0000000{s}" / "mp_rank_00_model_states.pt",
                                         weights_only=False)["module"] for s in (2, 3, 4))
    weights = [k for k, v in before.items() if isinstance(v, torch.Tensor) and "layers." in k and v.ndim == 2]
    assert weights and all(torch.equal(before[k], skipped[k]) for k in weights)
    assert not all(torch.equal(skipped[k], after[k]) for k in weights)
