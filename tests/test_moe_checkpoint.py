"""Checkpoints of sparse models (cplm_dist.checkpoint.expert_files): a run at ep 2 saves every ep
rank's experts by global id; it resumes exactly at ep 2, its checkpoint evaluates at ep 1 (and at
ep 2) to the validation loss the run reported, a missing expert file is refused with one line,
a resume at another ep without --reshape too; an ep-1 save is as before. One saved ep-2 run serves them all."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from cplm_dist.training.run_log import read_metrics
from tests.spawn import run_ranks
from tests.test_moe import SPARSE
from tests.test_train import _valid_loss_of_checkpoint, argv, losses, train

STEPS = 6
# the router's expert bias moves every step: a resume must restore it
BIAS = ("model.moe.score=sigmoid", "model.moe.expert_bias=true", "model.moe.bias_update_rate=0.01")
EP2 = (*SPARSE, *BIAS, "parallel.ep=2", "train.zero_stage=1", f"train.train_steps={STEPS}", "train.save_interval=3",
       f"train.eval_interval={STEPS}")


@pytest.fixture(scope="module")
def ep2_run(small_data, tmp_path_factory):
    """The straight ep-2 run (2 ranks, dp 2 x ep 2, ZeRO-1): checkpoints at steps 3 and 6."""
    out = tmp_path_factory.mktemp("moe-ckpt") / "run"
    assert train(2, argv(small_data, out, *EP2)) == [0, 0]
    return out


def test_an_ep2_checkpoint_holds_every_expert_once_and_resumes_exactly(small_data, tmp_path, ep2_run):
    step6 = ep2_run / "checkpoints" / "step-00000006"
    manifest = json.loads((step6 / "complete.json").read_text())
    assert manifest["layout"]["ep"] == 2
    experts = sorted(n for n in manifest["files"] if n.startswith("experts_"))
    assert experts == ["experts_pp_00_ep_00_etp_00.pt", "experts_pp_00_ep_01_etp_00.pt"]
    keys = [set(torch.load(step6 / n, weights_only=True)["experts"]) for n in experts]
    assert not keys[0] & keys[1] and {int(k.split(".local_experts.")[1].split(".")[0]) for k in keys[1]} == {2, 3}
    # resumed from step 3 at ep 2, saving in the background: steps 4-6 as the straight run's
    out = tmp_path / "resumed"
    assert train(2, argv(small_data, out, *EP2, "train.async_save=true")
                 + ["--resume", str(ep2_run / "checkpoints" / "step-00000003")]) == [0, 0]
    straight, resumed = losses(ep2_run), losses(out)
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert abs(straight[step] - resumed[step]) <= 1e-6, (step, straight[step], resumed[step])
    again = out / "checkpoints" / "step-00000006"  # the asynchronous save wrote the same experts and bias
    for name in experts:
        a, b = (torch.load(d / name, weights_only=True)["experts"] for d in (step6, again))
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), name
    bias = [torch.load(d / "mp_rank_00_model_states.pt", weights_only=False)["module"] for d in (step6, again)]
    keys = [k for k in bias[0] if k.endswith("router.expert_bias")]
    assert keys and all(bias[0][k].abs().sum() > 0 and torch.allclose(bias[0][k], bias[1][k], atol=1e-6) for k in keys)


def _log_probs(step_dir: Path, ep: int) -> torch.Tensor:
    """load_model at this launch's ep (ep ranks = world): each next token's log-prob in a fixed batch."""
    from cplm_dist.checkpoint import load_model
    from cplm_dist.distributed import init_distributed

    init_distributed(1, ep_size=ep)
    model, cfg, _ = load_model(step_dir)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return -model(tokens).nll


def test_an_ep2_checkpoint_evaluates_at_ep1_to_the_runs_validation_loss(small_data, ep2_run):
    step6 = ep2_run / "checkpoints" / "step-00000006"
    # the run validated eval_batches=2 micro-batches on each of its 2 dp ranks: the same 4 in one process
    args = argv(small_data, ep2_run, *EP2, "train.eval_batches=4")
    layout, loss, evaluated = run_ranks(_valid_loss_of_checkpoint, 1, args=(step6, args))[0]
    assert layout["ep"] == 2
    reported = read_metrics(ep2_run / "logs" / "metrics.jsonl", "valid")[STEPS]["loss"]
    assert loss == pytest.approx(reported, abs=1e-5) and evaluated["loss"] == loss
    at_ep1 = run_ranks(_log_probs, 1, args=(step6, 1))[0]
    at_ep2 = run_ranks(_log_probs, 2, args=(step6, 2))  # each ep rank its own experts, from the same files
    for got in at_ep2:
        torch.testing.assert_close(got, at_ep1, atol=1e-5, rtol=0)


def _init_from_log_probs(step_dir: Path, ep: int) -> torch.Tensor:
    """model.init_from=<an ep-2 checkpoint> at this launch's ep: the fresh model's log-probs."""
    from cplm_dist.checkpoint import read_manifest
    from cplm_dist.config import from_dict
    from cplm_dist.distributed import init_distributed
    from cplm_dist.interop.init_from import initialise_from
    from cplm_dist.model.cplm import build_model

    init_distributed(1, ep_size=ep)
    cfg = from_dict(read_manifest(step_dir).config)
    cfg.model.init_from, cfg.seed = str(step_dir), cfg.seed + 1  # another seed: every weight must come from the source
    model = build_model(cfg)
    initialise_from(model, cfg, 0, 1)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return -model.eval()(tokens).nll


def test_a_run_starts_from_an_ep2_checkpoint_at_ep1_and_ep2(ep2_run):
    step6 = ep2_run / "checkpoints" / "step-00000006"
    want = run_ranks(_log_probs, 1, args=(step6, 1))[0]
    torch.testing.assert_close(run_ranks(_init_from_log_probs, 1, args=(step6, 1))[0], want, atol=1e-5, rtol=0)
    for got in run_ranks(_init_from_log_probs, 2, args=(step6, 2)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _load_error(step_dir: Path) -> str:
    from cplm_dist.checkpoint import CheckpointError, load_model
    from cplm_dist.distributed import init_distributed

    init_distributed(1)
    try:
        load_model(step_dir)
    except CheckpointError as e:
        return str(e)
    return ""


def test_a_missing_expert_file_or_another_ep_is_refused_with_one_line(small_data, tmp_path, ep2_run):
    from cplm_dist.checkpoint import CheckpointError, check_layout, find_resume, read_manifest
    from cplm_dist.config import load_config

    step = tmp_path / "step-00000006"
    shutil.copytree(ep2_run / "checkpoints" / "step-00000006", step)
    (step / "experts_pp_00_ep_01_etp_00.pt").unlink()
    before = {p.name: p.read_bytes() for p in step.iterdir()}
    message = run_ranks(_load_error, 1, args=(step,))[0]
    assert "experts_pp_00_ep_01_etp_00.pt" in message and "missing or damaged" in message and "\n" not in message
    assert {p.name: p.read_bytes() for p in step.iterdir()} == before  # nothing written or removed
    # a resume at ep 1: another layout, refused without --reshape (tests/test_moe_reshape.py reshapes it)
    args = argv(small_data, tmp_path / "other", *SPARSE, *BIAS, "train.zero_stage=1", f"train.train_steps={STEPS + 2}")
    cfg = load_config(args[1], args[2:])
    with pytest.raises(CheckpointError, match=r"another layout \(ep 2 -> 1\).*add --reshape"):
        find_resume(cfg, str(ep2_run / "checkpoints" / "step-00000006"), 1, 2)
    # at ZeRO-0 the optimizer states are dp rank 0's (ep rank 0's experts'): such a save does not resume
    manifest = read_manifest(ep2_run / "checkpoints" / "step-00000006")
    zero0 = dataclasses.replace(manifest, layout=dataclasses.replace(manifest.layout, zero_stage=0))
    with pytest.raises(CheckpointError, match="saved at parallel.ep=2 with train.zero_stage=0"):
        check_layout(zero0, load_config(args[1], args[2:] + ["parallel.ep=2", "train.zero_stage=1"]), 1, 2)


def test_an_ep1_sparse_checkpoint_is_as_before(small_data, tmp_path):
    out = tmp_path / "run"
    args = argv(small_data, out, *SPARSE, *BIAS, "train.train_steps=2", "train.eval_interval=2")
    assert train(1, args) == [0]
    step = out / "checkpoints" / "step-00000002"
    manifest = json.loads((step / "complete.json").read_text())
    assert "ep" not in manifest["layout"] and not [n for n in manifest["files"] if n.startswith("experts_")]
    layout, loss, _ = run_ranks(_valid_loss_of_checkpoint, 1, args=(step, args))[0]
    assert loss == pytest.approx(read_metrics(out / "logs" / "metrics.jsonl", "valid")[2]["loss"], abs=1e-5)
