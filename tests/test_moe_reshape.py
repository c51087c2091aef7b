"""Reshape of sparse checkpoints across ep (cplm_dist.checkpoint.reshape_experts): one straight run
saved at ep 2 x dp 2, ZeRO-1 (2 ranks) continues at tp 2 + sequence parallelism, ep 1, experts split
over tp, ZeRO-2, and that continuation's own checkpoint continues at ep 2 over the tp ranks
(expert_tp 1), ZeRO-1: each follows the straight run (loss at 1e-5 per step after its resume),
which needs every expert's fp32 weight, both Adam moments and step, the routers' expert bias, the
schedule and the data position carried. A reshape that cannot work is one line."""

from __future__ import annotations

import dataclasses

import pytest

from tests.test_moe import SPARSE, TP_SP
from tests.test_train import argv, losses, train

STEPS = 8
# clipping every step and the expert bias moving every step (tests.test_moe.SPARSE): a resume must restore both
COMMON = (*SPARSE, "model.moe.bias_update_rate=0.01", f"train.train_steps={STEPS}", "train.save_interval=3")
EP2_DP2 = ("parallel.ep=2", "train.zero_stage=1")
TP2_EP1 = (*TP_SP, "train.zero_stage=2")  # expert_tp null = tp: each expert split over the 2 tp ranks
TP2_EP2 = (*TP_SP, "parallel.ep=2", "parallel.expert_tp=1", "train.zero_stage=1")  # ep over the tp ranks


@pytest.fixture(scope="module")
def straight(small_data, tmp_path_factory):
    """The uninterrupted ep-2 run; its checkpoint at step 3 is the one reshaped."""
    out = tmp_path_factory.mktemp("moe-reshape") / "straight"
    assert train(2, argv(small_data, out, *COMMON, *EP2_DP2)) == [0, 0]
    return out, losses(out)


def follows(want: dict, out, steps) -> None:
    got = losses(out)
    assert sorted(got) == list(steps)
    for step in steps:
        assert abs(got[step] - want[step]) <= 1e-5, (step, got[step], want[step])


def test_ep2_continues_at_ep1_and_back_at_ep2_over_tp(small_data, tmp_path, straight):
    src, want = straight
    ep1 = tmp_path / "ep1"
    args = argv(small_data, ep1, *COMMON, *TP2_EP1, "train.exit_at_step=6")
    assert train(2, args + ["--resume", str(src / "checkpoints" / "step-00000003"), "--reshape"]) == [0, 0]
    follows(want, ep1, range(4, 7))
    ep2 = tmp_path / "ep2"
    args = argv(small_data, ep2, *COMMON, *TP2_EP2)
    assert train(2, args + ["--resume", str(ep1 / "checkpoints" / "step-00000006"), "--reshape"]) == [0, 0]
    follows(want, ep2, range(7, STEPS + 1))
    assert not [p for d in (ep1, ep2) for p in d.iterdir() if p.name.startswith(".reshape")]


def test_a_sparse_reshape_that_cannot_work_is_one_line(small_data, tmp_path, straight):
    """Another expert split is another layout (a resume without --reshape is refused, one line);
    a ZeRO-3 sparse checkpoint, whose experts' partitions are not converted, does not reshape to
    another ep or expert split."""
    from cplm_dist.checkpoint import CheckpointError, ReshapeError, check_layout, read_manifest
    from cplm_dist.config import load_config

    manifest = read_manifest(straight[0] / "checkpoints" / "step-00000003")
    parallel = {**manifest.config["parallel"], "tp": 2, "sequence_parallel": True, "ep": 1, "expert_tp": None}
    at_tp2 = dataclasses.replace(manifest, config={**manifest.config, "parallel": parallel},
                                 layout=dataclasses.replace(manifest.layout, tp=2, dp=1, ep=1, zero_stage=2))
    args = argv(small_data, tmp_path / "run", *COMMON)
    whole = load_config(args[1], args[2:] + [*TP2_EP1, "parallel.expert_tp=1"])  # the same ranks, experts whole
    with pytest.raises(CheckpointError) as caught:
        check_layout(at_tp2, whole, 2, 1)
    assert str(caught.value) == (f"checkpoint {manifest.step_dir} was saved with another layout (expert_tp 2 -> 1): "
                                 "resume with the layout it was saved with, or add --reshape to convert it to this one")
    check_layout(at_tp2, whole, 2, 1, reshape=True)
    zero3 = dataclasses.replace(at_tp2, layout=dataclasses.replace(at_tp2.layout, zero_stage=3))
    with pytest.raises(ReshapeError) as caught:
        check_layout(zero3, load_config(args[1], args[2:] + list(TP2_EP2)), 2, 1, reshape=True)
    assert str(caught.value) == (
        f"{manifest.step_dir}: --reshape of a sparse model saved at ZeRO-3 to another ep or expert_tp is not supported "
        "(its experts' partitions are converted from ZeRO-1/2 only): resume at its layout (tp=2 pp=1 dp=1 ZeRO-3), or "
        "reshape it to ZeRO-1 at its ep first")
