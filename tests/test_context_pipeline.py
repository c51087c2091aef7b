"""Context x pipeline parallelism (parallel.cp > 1 at parallel.pp > 1): cp 2 x pp 2 (4 ranks)
gives one process's loss and every parameter's gradient for the joint mix, the GPT-2 backbone and
copy off, under document masking and without, through DeepSpeed's pipeline engine at ZeRO-0 (its
own gradient reduction, adapted to dp x cp); a 10-step cp 2 x pp 2 run at ZeRO-1 (the gate mix,
document masking) follows one process, and stopped at step 5 and resumed it equals the straight run."""

import pytest
import torch

from cplm_dist.config import load_config
from tests.spawn import run_ranks
from tests.test_documents import _labels, packed_row
from tests.test_model import batch

# forward / backward against one process: every mix's extremes and the backbones with learned positions
GRAD_VARIANTS = {"joint-next": ["copy.mix=joint", "copy.paste=next"],
                 "gpt2-gate-self": ["model.arch=gpt2", "copy.mix=gate", "copy.paste=self"],
                 "copy-off-untied": ["copy.enabled=false", "model.tie_embeddings=false"]}
MICRO = 2  # micro-batches a step: each row of the (2, 24) batch one


def _micro_batches(ids, labels, positions, shard=None):
    """The step's micro-batches, each one row (this rank's two chunks of it under cp)."""
    take = (lambda t: t) if shard is None else shard.take
    out = []
    for r in range(ids.shape[0]):
        b = {"input_ids": take(ids[r : r + 1]), "labels": take(labels[r : r + 1])}
        if positions is not None:
            b["position_ids"] = take(positions[r : r + 1])
        out.append(b)
    return out


def _reference(cfg, micro_batches, group):
    """(loss, {name: gradient}) of one process's CPLM over the micro-batches: the mean of their
    per-token means, as the train step trains."""
    from cplm_dist.model import build_model

    model = build_model(cfg, tp_group=group)
    total = 0.0
    for b in micro_batches:
        out = model(b["input_ids"], b["labels"], b.get("position_ids"))
        loss = out.nll.sum() / (b["labels"] != -100).sum() / len(micro_batches)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _cp_pp_worker(variants):
    """{(variant, documents): (loss error, the largest gradient error of this stage's parameters,
    how many parameters this stage compared)} of a cp 2 x pp 2 train step against one process."""
    import torch.distributed as dist

    from cplm_dist.distributed import init_distributed
    from cplm_dist.model.parallel.context import context_of
    from cplm_dist.training.step import build_train_step

    dims = init_distributed(1, pp_size=2, cp_size=2)
    alone = [dist.new_group([r]) for r in range(dims.world_size)][dims.rank]  # one process's model, on every rank
    shard = context_of(dims)
    common = ["train.precision=fp32", "train.zero_stage=0", f"train.global_batch_size={MICRO}", "train.micro_batch_size=1", "optim.clip_grad=0"]
    results = {}
    for name, overrides in variants.items():
        for documents in (False, True):
            one = load_config("tiny", overrides + common)
            if documents:
                ids, positions, _ = packed_row(one.model.vocab_size)
                labels = _labels(ids)
            else:
                ids, positions = batch(one.model.vocab_size), None
                labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
            want_loss, want = _reference(one, _micro_batches(ids, labels, positions), alone)
            step = build_train_step(load_config("tiny", overrides + common + ["parallel.cp=2", "parallel.pp=2"]), dims,
                                    torch.device("cpu"))
            seen, clip = {}, step.optimizer.before_step  # the gradients DeepSpeed reduced, before the step

            def capture(clip=clip, seen=seen, module=step.engine.module):
                seen.update({n: p.grad.detach().clone() for n, p in module.canonical_named_parameters()})
                clip()

            step.optimizer.before_step = capture
            result = step(iter(_micro_batches(ids, labels, positions, shard)))
            errors = [(seen[n] - want[n]).abs().max().item() for n in seen]
            results[(name, documents)] = (abs(result.loss - want_loss), max(errors), len(errors))
    return results


@pytest.fixture(scope="module")
def cp_pp_gradients():
    return run_ranks(_cp_pp_worker, 4, args=(GRAD_VARIANTS,), timeout=400)


def test_cp2_pp2_gives_one_process_loss_and_gradients(cp_pp_gradients):
    for rank, result in enumerate(cp_pp_gradients):
        assert len(result) == 2 * len(GRAD_VARIANTS)
        for (name, documents), (loss_err, grad_err, compared) in result.items():
            where = f"rank {rank} {name} documents={documents}"
            assert compared > 0, where
            assert loss_err < 1e-5, f"{where}: loss off by {loss_err}"
            assert grad_err < 1e-5, f"{where}: gradients off by {grad_err}"


# --- training: cp 2 x pp 2 follows one process; resume ------------------------------------------

STEPS = 10
CP_PP = ["train.micro_batch_size=1", "train.eval_batches=4", "parallel.cp=2", "parallel.pp=2"]


def _args(small_data, out, *extra):
    """Global batch 4 of 64 tokens, the gate mix, document masking: one process micro 4; cp 2 x pp 2
    (dp 1) micro 1, four micro-batches through the 1F1B schedule."""
    from tests.test_train import argv

    return argv(small_data, out, f"train.train_steps={STEPS}", "train.global_batch_size=4", "optim.clip_grad=1.0",
                "copy.mix=gate", "data.document_mask=true", "train.save_interval=5", "train.eval_interval=10",
                "train.zero_stage=1", *extra)


@pytest.fixture(scope="module")
def cp_pp_training(small_data, tmp_path_factory):
    from tests.test_train import train

    root = tmp_path_factory.mktemp("cp_pp_training")
    runs = {"one": (1, ["train.micro_batch_size=4", "train.eval_batches=1"]),  # validation: the same 4 samples
            "cp2-pp2": (4, CP_PP)}
    for name, (world, extra) in runs.items():
        assert train(world, _args(small_data, root / name, *extra)) == [0] * world, name
    return root


def test_cp2_pp2_training_follows_one_process(cp_pp_training):
    """Losses, LM-only losses, copy shares, gradient norms and the validation loss."""
    from cplm_dist.training.run_log import read_metrics

    got, want = (read_metrics(cp_pp_training / d / "logs" / "metrics.jsonl") for d in ("cp2-pp2", "one"))
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        for key in ("loss", "lm_loss", "copy_share", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-4), (step, key)
    valid = [read_metrics(cp_pp_training / d / "logs" / "metrics.jsonl", "valid")[STEPS]["loss"] for d in ("cp2-pp2", "one")]
    assert abs(valid[0] - valid[1]) < 1e-4, valid
    import json

    manifest = json.loads((cp_pp_training / "cp2-pp2" / "checkpoints" / f"step-{STEPS:08d}" / "complete.json").read_text())
    assert (manifest["layout"]["cp"], manifest["layout"]["pp"], manifest["layout"]["dp"]) == (2, 2, 1)


def test_a_stopped_and_resumed_cp2_pp2_run_equals_the_straight_one(small_data, cp_pp_training, tmp_path):
    from tests.test_train import losses, train

    source = cp_pp_training / "cp2-pp2" / "checkpoints" / "step-00000005"
    out = tmp_path / "resumed"
    args = _args(small_data, out, *CP_PP)
    assert train(4, args + ["--resume", str(source)]) == [0] * 4
    got, want = losses(out), losses(cp_pp_training / "cp2-pp2")
    assert sorted(got) == list(range(6, STEPS + 1))
    for step in got:
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])


def test_a_cp2_pp2_checkpoint_evaluates_as_a_whole_model(small_data, cp_pp_training):
    """Its layer files, one set whatever cp (the cp ranks hold the same weights; cp rank 0 writes
    them), load into a plain CPLM: training's validation and evaluate.py's perplexity of step 10
    are the validation loss the cp x pp run logged."""
    import os

    from cplm_dist.training.run_log import read_metrics
    from tests.test_train import _valid_loss_of_checkpoint

    run = cp_pp_training / "cp2-pp2"
    step = run / "checkpoints" / f"step-{STEPS:08d}"
    from cplm_dist.config.cli import config_parser, load_from_args
    from cplm_dist.model.parallel.stages import checkpoint_layer_names

    cfg = load_from_args(config_parser("").parse_intermixed_args(_args(small_data, run, *CP_PP)))
    assert sorted(f for f in os.listdir(step) if f.startswith("layer_")) == [
        f"layer_{i:02d}-model_00-model_states.pt" for i in checkpoint_layer_names(cfg)]  # as at cp 1
    layout, loss, evaluated = run_ranks(_valid_loss_of_checkpoint, 1, args=(step, _args(small_data, run, *CP_PP)))[0]
    assert (layout["cp"], layout["pp"]) == (2, 2)
    logged = read_metrics(run / "logs" / "metrics.jsonl", "valid")[STEPS]["loss"]
    assert loss == pytest.approx(logged, abs=1e-5) and evaluated["loss"] == loss


def test_a_cp2_pp2_checkpoint_continues_as_plain_data_parallel(small_data, cp_pp_training, tmp_path):
    """--reshape from cp 2 x pp 2 (ZeRO-1, the optimizer partitioned over dp x cp) to dp 2 without
    stages or cp: steps 6-10 are the straight cp x pp run's."""
    from tests.test_train import losses, train

    source = cp_pp_training / "cp2-pp2" / "checkpoints" / "step-00000005"
    out = tmp_path / "dp2"
    args = _args(small_data, out, "train.micro_batch_size=2", "train.eval_batches=1")
    assert train(2, args + ["--resume", str(source), "--reshape"]) == [0, 0]
    got, want = losses(out), losses(cp_pp_training / "cp2-pp2")
    assert sorted(got) == list(range(6, STEPS + 1))
    for step in got:
        assert abs(got[step] - want[step]) < 1e-5, (step, got[step], want[step])
