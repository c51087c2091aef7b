"""The dry run (tools/dry_run.py, cplm_dist.profiling.dry_run) held to real ranks: at tp 1 and 2,
ZeRO 0-3, pp 2 and sequence parallelism, every rank's parameters and the model's collective bytes
equal a real 2-rank gloo job's exactly, the traced peak equals the real trace's, and the dry run's
whole peak (traced + DeepSpeed's modelled states and buckets) is within 10% of a real DeepSpeed
step's peak of live tensors (measured the same way, MemTracker). A real-shape dry run (cplm-1.7b
at tp 2) agrees with the estimator and the communication model; a sparse layout (ep 2) traces the
real ranks' parameters, its all-to-all the real one's lower bound (balanced routing), the
estimator within 10%; bad layouts (an ep that does not fit too) are one line and exit 2, one that
does not fit exit 1; the planner confirms its choice with --dry-run."""

import json
from pathlib import Path

import pytest
import torch

from cplm_dist.config import load_config
from cplm_dist.model.counting import parameter_count, replicated_parameters
from cplm_dist.profiling.communication import step_bytes
from cplm_dist.profiling.dry_run import dry_run
from cplm_dist.profiling.roofline import DEVICES
from tests.spawn import run_ranks

REPO = Path(__file__).resolve().parent.parent
ON_CPU = ["train.overlap_comm=false"]  # what DeepSpeed does on CPU, so that the dry run models the same buckets
LAYOUTS = {
    "tp2-zero1": ["parallel.tp=2", "train.zero_stage=1", "train.global_batch_size=4", "train.micro_batch_size=2"],
    "dp2-zero0": ["train.zero_stage=0", "train.global_batch_size=8", "train.micro_batch_size=2"],
    "dp2-zero3": ["train.zero_stage=3", "train.global_batch_size=4", "train.micro_batch_size=2"],
    "pp2": ["parallel.pp=2", "train.zero_stage=1", "train.global_batch_size=4", "train.micro_batch_size=1"],
    "tp2-sp-zero2": ["parallel.tp=2", "parallel.sequence_parallel=true", "train.zero_stage=2", "train.global_batch_size=4",
                     "train.micro_batch_size=2"],
    # Muon: one momentum buffer for the matrices, the direction gathered over the partitions at the step
    "dp2-muon-zero1": ["optim.name=muon", "train.zero_stage=1", "train.global_batch_size=4", "train.micro_batch_size=2"],
    # a sparse model: 4 experts over ep 2 (2 a rank), their states over the expert-dp ranks, the all-to-all on "ep/"
    "ep2-zero1": ["model.moe.num_experts=4", "model.moe.expert_impl=sequential", "parallel.ep=2", "train.zero_stage=1",
                  "train.global_batch_size=4", "train.micro_batch_size=2"],
}


def _config(name):
    return load_config("tiny", [*ON_CPU, *LAYOUTS[name]])


def _real_worker(names):
    from cplm_dist.distributed import init_distributed
    from cplm_dist.megatron_compat import parallel_state
    from cplm_dist.profiling.dry_run import layout_of
    from cplm_dist.profiling.real_trace import real_roles

    out = {}
    for name in names:
        cfg = _config(name)
        layout = layout_of(cfg, 2)
        dims = init_distributed(layout.tp, pp_size=layout.pp, ep_size=cfg.parallel.ep, expert_tp_size=cfg.parallel.expert_tp)
        out[name] = real_roles(cfg, dims, layout, torch.device("cpu"))
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def real():
    return run_ranks(_real_worker, world_size=2, args=(list(LAYOUTS),), timeout=420)[0]


@pytest.fixture(scope="module")
def dry():
    return {name: dry_run(_config(name), gpus=2, device=DEVICES["h200"]) for name in LAYOUTS}


def _pairs(dry, real, name):
    """(the dry run's role, a real rank holding it) for both real ranks (dp replicas share a role)."""
    roles = {(role.tp_rank, role.pp_stage): role for role in dry[name].roles}
    assert len(real[name]) == 2 and {(r["tp_rank"], r["pp_stage"]) for r in real[name]} == set(roles)
    return [(roles[(r["tp_rank"], r["pp_stage"])], r) for r in real[name]]


@pytest.mark.parametrize("name", LAYOUTS)
def test_parameters_and_collectives_equal_the_real_ranks(dry, real, name):
    for role, rank in _pairs(dry, real, name):
        assert role.trace.parameters == rank["parameters"]
        real_bytes = dict(rank["collectives"])
        if name.startswith("ep"):  # a real router's tokens: the all-to-all's buffer is the larger of what a rank sends
            # (tokens x top_k, always) and receives, so the balanced trace is its lower bound; the counts' gather
            # over tp x ep ("other") is bookkeeping the fake rank's drop-and-pad path skips
            traced, measured = role.trace.collectives["ep/all_to_all_single"], real_bytes.pop("ep/all_to_all_single")
            assert traced <= measured < 1.5 * traced
            real_bytes = {k: v for k, v in real_bytes.items() if not k.startswith("other/")}
            traced_rest = {k: v for k, v in {**role.trace.collectives, **role.trace.boundary}.items() if not k.startswith("ep/")}
            assert traced_rest == pytest.approx(real_bytes, rel=1e-9)
            continue
        assert {**role.trace.collectives, **role.trace.boundary} == pytest.approx(rank["collectives"], rel=1e-9)
    if name.startswith("tp2"):  # the tp group's traffic is there to compare
        assert any(k.startswith("tp/") for k in rank["collectives"])


@pytest.mark.parametrize("name", LAYOUTS)
def test_peak_within_10_percent_of_the_real_step(dry, real, name):
    for role, rank in _pairs(dry, real, name):
        assert role.trace.peak_bytes == pytest.approx(rank["peak_bytes"], rel=0.10)  # the same schedule, real tensors
        # the whole step: DeepSpeed's engine, optimizer states and buckets included (modelled in the dry run)
        assert role.peak_bytes == pytest.approx(rank["step_peak_bytes"], rel=0.10), (role.modelled, rank["step_by_kind"])
        if name.startswith("ep"):  # a sparse step: the estimator (experts' states over expert-dp) within 10% too
            assert abs(role.error) < 0.10, role.error


def test_a_qwen3_layout_dry_runs_as_counting_and_the_communication_model_say():
    """qwen3 at tp 2 (heads of model.head_dim = 24, q 192 wide beside hidden 128): both tp ranks
    hold the parameters counting says, and trace the tp collectives the communication model
    predicts, the qk-norm gradients' all-reduces included (the real ranks are the layouts above's)."""
    cfg = load_config("tiny", [*ON_CPU, "model.arch=qwen3", "model.head_dim=24", "parallel.tp=2", "train.zero_stage=1",
                               "train.global_batch_size=4", "train.micro_batch_size=2"])
    result = dry_run(cfg, gpus=2, device=DEVICES["h200"])
    layout, replicated = result.layout, replicated_parameters(cfg)
    model = step_bytes(cfg, tp=2, dp=1, zero=1, micro_batch=layout.micro_batch, accumulation=layout.accumulation,
                       seq_len=layout.seq_len, precision=layout.precision, activation_checkpointing=False,
                       sequence_parallel=False)
    assert [(r.tp_rank, r.pp_stage) for r in result.roles] == [(0, 0), (1, 0)]
    for role in result.roles:
        assert (role.trace.parameters - replicated) * 2 + replicated == parameter_count(cfg, padded=True)["total"]
        assert role.trace.collectives == pytest.approx({k: v for k, v in model.items() if k.startswith("tp/")}, rel=1e-9)


def test_real_shape_dry_run_of_1_7b_at_tp2(tmp_path, capsys):
    """cplm-1.7b's shipped run at tp 2 (dp 8 on 16 GPUs, one micro-batch a step to keep the suite
    short): both tp ranks at 8 x 2048 tokens a micro-batch, the JSON complete, the estimator within
    10% and the tp bytes the model's."""
    from cplm_dist_tools.dry_run import main

    out = tmp_path / "dry.json"
    layout = ["parallel.tp=2", "train.global_batch_size=64"]
    assert main(["--config", str(REPO / "configs/runs/cplm-1.7b.yaml"), "--gpus", "16", *layout, "--device", "h100",
                 "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "fits: the heaviest rank" in stdout and "roofline" in stdout
    result = json.loads(out.read_text())
    cfg = load_config(REPO / "configs/runs/cplm-1.7b.yaml", layout)
    assert result["accumulation"] == 1
    assert result["world"] == 16 and result["layout"] == {"tp": 2, "pp": 1, "cp": 1, "dp": 8, "zero_stage": 1}
    assert result["total_parameters"] == parameter_count(cfg)["total"]
    assert result["replicated_parameters"] == replicated_parameters(cfg)
    assert result["fits"] is True and result["device_bytes"] == DEVICES["h100"].memory_bytes
    roles = result["roles"]
    assert [(r["tp_rank"], r["pp_stage"]) for r in roles] == [(0, 0), (1, 0)]
    split = roles[0]["parameters"] - result["replicated_parameters"]
    assert split * 2 + result["replicated_parameters"] == parameter_count(cfg, padded=True)["total"]
    t = cfg.train
    model = step_bytes(cfg, tp=2, dp=8, zero=1, micro_batch=t.micro_batch_size, accumulation=result["accumulation"],
                       seq_len=cfg.data.seq_length, precision="bf16", activation_checkpointing=False, sequence_parallel=False)
    for role in roles:
        assert role["collectives_traced"] == pytest.approx({k: v for k, v in model.items() if k.startswith("tp/")}, rel=1e-9)
        assert abs(role["estimate_bytes"] - role["peak_bytes"]) / role["peak_bytes"] < 0.10
        assert role["traced"]["by_kind"]["activation"] > role["traced"]["by_kind"]["parameter"]


@pytest.mark.parametrize("args, message", [
    (["parallel.tp=3"], "model.num_heads=8 is not divisible by parallel.tp=3"),
    (["--gpus", "6", "parallel.tp=4"], "parallel.tp=4 does not divide WORLD_SIZE=6"),
    (["--gpus", "4", "train.global_batch_size=6", "train.micro_batch_size=4"], "train.global_batch_size=6 is not"),
    (["parallel.pp=3"], "parallel.pp=3 exceeds model.num_layers=2"),
    (["--gpus", "6", "parallel.cp=4"], "parallel.tp=1 x parallel.cp=4 x parallel.pp=1 = 4 does not divide WORLD_SIZE=6"),
    (["--gpus", "6", "parallel.cp=2", "parallel.pp=2"], "parallel.tp=1 x parallel.cp=2 x parallel.pp=2 = 4 does not divide WORLD_SIZE=6"),
    (["--json", "no/such/dir/dry.json"], "its parent directory no/such/dir does not exist"),
    (["model.moe.num_experts=8", "parallel.ep=3", "train.zero_stage=1"], "parallel.ep=3 does not divide model.moe.num_experts=8"),
    (["--gpus", "2", "model.moe.num_experts=8", "parallel.ep=4", "train.zero_stage=1"],
     "parallel.ep=4 x expert_tp=1 does not divide the 2 ranks of a pipeline stage"),
])
def test_a_layout_that_cannot_exist_is_one_line_and_exit_2(capsys, args, message):
    from cplm_dist_tools.dry_run import main

    argv = args if "--gpus" in args else ["--gpus", "2", *args]
    assert main(["--config", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_a_layout_that_does_not_fit_exits_1_naming_the_rank(capsys, tmp_path):
    from cplm_dist_tools.dry_run import main

    out = tmp_path / "dry.json"
    assert main(["--config", "tiny", "--gpus", "2", "parallel.tp=2", "--gpu-gb", "0.001", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "tp rank 0 of pipeline stage 0 needs" in err[0] and "0.001 GiB" in err[0], err
    assert json.loads(out.read_text())["fits"] is False


CP_DRY = ["train.overlap_comm=false", "train.global_batch_size=8", "train.micro_batch_size=4", "train.precision=fp32",
          "train.reduce_bucket_size=1000", "copy.impl=dense"]  # small buckets: the activations are what is compared


def test_context_parallel_dry_run_traces_every_cp_rank(tmp_path, capsys):
    """cp 2 x dp 2: both cp ranks traced in the fake world (megatron's cp groups), their cp
    collectives (K/V, the copy keys, the ids) exactly the communication model's, the dp ones
    modelled over dp x cp; each rank's traced peak about half that of cp 1 at the same sequence,
    and the estimator as far from the trace as at cp 1 with as many tokens a rank."""
    from cplm_dist_tools.dry_run import main

    out = tmp_path / "dry.json"
    assert main(["--config", "tiny", "--gpus", "4", *CP_DRY, "parallel.cp=2", "data.seq_length=512", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "| stage | cp rank | tp ranks |" in stdout and "world 4 = tp 1 x cp 2 x pp 1 x dp 2" in stdout
    result = json.loads(out.read_text())
    assert result["layout"] == {"tp": 1, "pp": 1, "cp": 2, "dp": 2, "zero_stage": 1} and result["accumulation"] == 1
    roles = result["roles"]
    assert [(r["tp_rank"], r["cp_rank"]) for r in roles] == [(0, 0), (0, 1)]
    cfg = load_config("tiny", [*CP_DRY, "parallel.cp=2", "data.seq_length=512"])
    model = step_bytes(cfg, tp=1, dp=2, zero=1, micro_batch=4, accumulation=1, seq_len=512, precision="fp32",
                       activation_checkpointing=False, sequence_parallel=False, cp=2)
    for role in roles:
        assert role["collectives_traced"] == pytest.approx({k: v for k, v in model.items() if k.startswith("cp/")}, rel=1e-9)
        assert role["collectives_modelled"] == {k: v for k, v in model.items() if k.startswith("dp/")}
    flat = {seq: dry_run(load_config("tiny", [*CP_DRY, f"data.seq_length={seq}"]), gpus=2, device=DEVICES["h200"]).roles[0]
            for seq in (256, 512)}
    for role in roles:
        assert 0.4 < role["traced"]["peak_bytes"] / flat[512].trace.peak_bytes < 0.55
        error = (role["estimate_bytes"] - role["peak_bytes"]) / role["peak_bytes"]
        assert abs(error - flat[256].error) < 0.05, (error, flat[256].error)  # tiny's own offset, not cp's


def test_a_cp_x_pp_layout_dry_runs_every_role_as_the_communication_model_says():
    """cp 2 x pp 2 x tp 2 (8 fake ranks, sequence parallel, document masking): a role for every tp
    rank x stage x cp rank; each role's tp and cp collectives and its stage boundary exactly the
    communication model's at its stage (K/V of its own layers, the copy keys on the last stage,
    the ids and positions on every stage), the dp ones over dp x cp; beside them only the last
    stage's token count summed over cp (8 bytes a micro-batch, bookkeeping the model leaves out)."""
    overrides = [*CP_DRY, "parallel.cp=2", "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                 "train.zero_stage=1", "data.seq_length=512", "model.max_seq_len=512", "model.num_layers=3",
                 "data.document_mask=true"]
    cfg = load_config("tiny", overrides)
    result = dry_run(cfg, gpus=8, device=DEVICES["h200"])
    assert (result.layout.tp, result.layout.cp, result.layout.pp, result.layout.dp) == (2, 2, 2, 1)
    assert sorted((r.pp_stage, r.cp_rank, r.tp_rank) for r in result.roles) == [
        (s, c, t) for s in range(2) for c in range(2) for t in range(2)]
    for role in result.roles:
        model = step_bytes(cfg, tp=2, dp=1, zero=1, micro_batch=4, accumulation=2, seq_len=512, precision="fp32",
                           activation_checkpointing=False, sequence_parallel=True, pp=2, stage=role.pp_stage, cp=2)
        traced = dict(role.trace.collectives)
        bookkeeping = traced.pop("cp/all_reduce", 0.0)
        assert bookkeeping == (8 * role.trace.micro_batches if role.pp_stage == 1 else 0.0)
        assert traced == pytest.approx({k: v for k, v in model.items() if k.startswith(("tp/", "cp/"))}, rel=1e-9)
        assert role.trace.boundary == pytest.approx({k: v for k, v in model.items() if k.startswith("pp/")}, rel=1e-9)
        assert model["cp/all_gather_into_tensor"] > 0 and ("cp/reduce_scatter_tensor" in model)
    # the heaviest rank (the first stage, 2 in-flight micro-batches): about half of pp alone's at the same sequence
    pipe = dry_run(load_config("tiny", [*overrides, "parallel.cp=1"]), gpus=4, device=DEVICES["h200"]).heaviest
    assert result.heaviest.pp_stage == 0 and 0.35 < result.heaviest.peak_bytes / pipe.peak_bytes < 0.55
    assert abs(result.heaviest.error) < 0.05, result.heaviest.error


@pytest.mark.parametrize("cp", [1, 2])
def test_a_document_masked_layout_dry_runs(capsys, cp):
    """data.document_mask (block-causal attention and copy candidates): traced with fake tensors,
    whose positions have no values to check (a training row's check reads real ones only)."""
    from cplm_dist_tools.dry_run import main

    assert main(["--config", "tiny", "--gpus", "2", *CP_DRY, f"parallel.cp={cp}", "data.seq_length=256",
                 "data.document_mask=true"]) == 0
    assert f"world 2 = tp 1 x {'cp 2 x ' if cp > 1 else ''}pp 1 x dp {2 // cp}" in capsys.readouterr().out


def test_the_planner_confirms_its_choice(capsys):
    from cplm_dist_tools.plan import main

    assert main(["--config", "tiny", "--gpus", "2", "--gpu-gb", "8", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dry run of the best layout" in out and "fits: the heaviest rank" in out


def test_a_dualpipev_layout_dry_runs_each_rank_as_its_two_stages(capsys):
    """parallel.pp_schedule=dualpipev at tp 2 x pp 2 (4 layers, 4 micro-batches): rank 0 runs the
    embedding's and the head's stages, rank 1 the middle two (turning the micro-batches around);
    each role's tp collectives and both links' boundary (whole tensors at tp > 1, as DualPipeV
    sends them) are the communication model's, the estimator within 20% of the trace, and the
    report names the schedule and its bubble."""
    from cplm_dist_tools.dry_run import main

    overrides = [*CP_DRY, "parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=dualpipev", "train.zero_stage=1",
                 "data.seq_length=256", "model.max_seq_len=256", "model.num_layers=4", "train.global_batch_size=16"]
    cfg = load_config("tiny", overrides)
    result = dry_run(cfg, gpus=4, device=DEVICES["h200"])
    assert (result.layout.pp, result.layout.accumulation) == (2, 4)
    params = {r.pp_stage: r.trace.parameters for r in result.roles}
    assert params[0] > params[1]  # rank 0: the embedding, the head and a layer each way
    for role in result.roles:
        model = step_bytes(cfg, tp=2, dp=1, zero=1, micro_batch=4, accumulation=4, seq_len=256, precision="fp32",
                           activation_checkpointing=False, sequence_parallel=False, pp=2, stage=role.pp_stage)
        assert role.trace.collectives == pytest.approx({k: v for k, v in model.items() if k.startswith("tp/")}, rel=1e-9)
        assert role.trace.boundary == pytest.approx({k: v for k, v in model.items() if k.startswith("pp/")}, rel=1e-9)
        assert "tied/all_reduce" not in role.modelled["collectives"] and abs(role.error) < 0.2, role.error
    assert main(["--config", "tiny", "--gpus", "4", *overrides]) == 0
    assert "x pp 2 x dp 1" in (out := capsys.readouterr().out) and "dualpipev bubble 11.1%" in out


@pytest.mark.parametrize("expert_tp", [1, 2])
def test_a_sparse_layout_dry_runs_each_role_as_counting_and_the_communication_model_say(expert_tp):
    """tp 2 + sequence parallelism x ep 2 on 4 fake ranks, experts whole (expert_tp 1: ep over the
    tp ranks) or split like the MLP (expert_tp 2: their inputs gathered over tp, the combine
    reduce-scattered in fp32): a role for each tp rank (the ep ranks alike, routing balanced), each
    holding the parameters counting says (4 of the 8 experts of each layer), its tp and ep
    collectives exactly the communication model's (the all-to-alls of 2 sparse layers, no MLP
    gathers of their own; beside them only the routers' token counts summed over tp, "other/",
    bookkeeping the model leaves out), the experts' reduction modelled over their expert-dp ranks."""
    from cplm_dist.model.counting import parameters_per_device

    overrides = [*CP_DRY, "parallel.tp=2", "parallel.sequence_parallel=true", "train.zero_stage=1", "data.seq_length=256"]
    sparse = ["model.moe.num_experts=8", "model.moe.expert_impl=sequential", "parallel.ep=2", f"parallel.expert_tp={expert_tp}"]
    cfg = load_config("tiny", [*overrides, *sparse])
    result = dry_run(cfg, gpus=4, device=DEVICES["h200"])
    L = result.layout
    assert (L.tp, L.dp, L.ep) == (2, 2, 2) and [r.tp_rank for r in result.roles] == [0, 1]
    model = step_bytes(cfg, tp=2, dp=2, zero=1, micro_batch=L.micro_batch, accumulation=L.accumulation, seq_len=256,
                       precision="fp32", activation_checkpointing=False, sequence_parallel=True)
    for role in result.roles:
        assert role.trace.parameters == parameters_per_device(cfg, 2)
        traced = {k: v for k, v in role.trace.collectives.items() if not k.startswith("other/")}
        assert traced == pytest.approx({k: v for k, v in model.items() if k.startswith(("tp/", "ep/"))}, rel=1e-9)
        assert model["ep/all_to_all_single"] > 0  # the experts' gradients over 4 / (ep x expert_tp) expert-dp ranks:
        assert ("edp/all_reduce" in role.modelled["collectives"]) == (expert_tp == 1)  # none at expert_tp 2

