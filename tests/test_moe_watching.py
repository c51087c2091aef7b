"""Watching a sparse run (docs/moe.md, "Watching a sparse run"): a 2-layer sparse run of the
quickstart's shape writes each layer's expert load, router entropy and auxiliary losses to
metrics.jsonl and TensorBoard at the log interval, over the steps since the last record, beside
the copy share and the diagnostics as they were; a capacity factor drops tokens and says so."""

import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cplm_dist.training.run_log import read_metrics
from tests.test_train import argv, train

E, TOP_K, STEPS, EVERY = 4, 2, 4, 2
TOKENS = 16 * 64  # the global batch x data.seq_length of tests.test_train.argv
SPARSE = (f"model.moe.num_experts={E}", f"model.moe.top_k={TOP_K}", "model.moe.z_loss_coeff=1e-3",
          f"train.train_steps={STEPS}", f"train.log_interval={EVERY}", "train.eval_interval=1000")


@pytest.fixture(scope="module")
def sparse_runs(small_data, tmp_path_factory):
    """One dropless run (with the live diagnostics) and one at capacity_factor 0.5, 4 steps each."""
    root = tmp_path_factory.mktemp("moe_watch")
    runs = {"dropless": root / "dropless", "capacity": root / "capacity"}
    assert train(1, argv(small_data, runs["dropless"], *SPARSE, "train.diagnostics_interval=2")) == [0]
    assert train(1, argv(small_data, runs["capacity"], *SPARSE, "model.moe.capacity_factor=0.5",
                         "train.tensorboard=false")) == [0]
    return runs


def test_a_sparse_run_logs_its_routing_per_layer_over_the_window(sparse_runs):
    log = read_metrics(sparse_runs["dropless"] / "logs" / "metrics.jsonl")
    assert sorted(log) == list(range(EVERY, STEPS + 1, EVERY))
    for step, record in log.items():
        moe = record["moe"]
        assert set(moe) >= {"max_load", "dropped", "entropy", "load_balancing_loss", "z_loss", "L0", "L1"}
        for layer in ("L0", "L1"):
            figures = moe[layer]
            # dropless: every token reaches top_k experts, summed over the window's steps
            assert len(figures["tokens_per_expert"]) == E
            assert sum(figures["tokens_per_expert"]) == EVERY * TOKENS * TOP_K
            assert figures["max_load"] >= 1 and figures["dropped"] == 0
            assert 0 < figures["entropy"] <= math.log(E) + 1e-6
            assert figures["load_balancing_loss"] > 0 and figures["z_loss"] > 0
        assert moe["max_load"] == pytest.approx((moe["L0"]["max_load"] + moe["L1"]["max_load"]) / 2)
        # the copy head's figures are where they were, the routing none of them
        assert 0 < record["copy_share"] < 1 and set(record["sources"]) and "moe" not in record["sources"]
    diagnostics = read_metrics(sparse_runs["dropless"] / "logs" / "metrics.jsonl", "diagnostics")
    assert sorted(diagnostics) == [2, 4]
    figures = {k: v for k, v in diagnostics[4].items() if k not in ("event", "step")}
    assert set(figures) == {"loss", "tokens", "suppressed_fraction", "grad_norm_h_via_lm_head", "grad_norm_h_via_copy_head",
                            "copy_to_lm_ratio", "copy_share_mean", "copy_share_std", "copy_dominates"}
    assert all(math.isfinite(v) for v in figures.values()) and 0 < figures["copy_share_mean"] < 1


def test_tensorboard_gets_the_routing_figures(sparse_runs):
    events = EventAccumulator(str(sparse_runs["dropless"] / "logs" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/moe/max_load", "train/moe/entropy", "train/moe/load_balancing_loss", "train/moe/L1/dropped",
                "train/moe/L0/z_loss", *(f"train/moe/L0/tokens_per_expert/{j}" for j in range(E))):
        assert tag in tags, tag
    load = [sum(events.Scalars(f"train/moe/L1/tokens_per_expert/{j}")[-1].value for j in range(E))]
    assert load == [EVERY * TOKENS * TOP_K]
    assert [s.step for s in events.Scalars("train/moe/max_load")] == [2, 4]


def test_a_capacity_factor_drops_tokens_and_the_log_says_how_many(sparse_runs):
    log = read_metrics(sparse_runs["capacity"] / "logs" / "metrics.jsonl")
    for record in log.values():
        for layer in ("L0", "L1"):
            figures = record["moe"][layer]
            assert 0 < figures["dropped"] < 1
            kept = sum(figures["tokens_per_expert"])
            assert kept < EVERY * TOKENS * TOP_K
            # capacity 0.5 x (tokens x top_k / E) a micro-batch: no expert keeps more
            micro = 8 * 64
            assert max(figures["tokens_per_expert"]) <= EVERY * 2 * math.ceil(0.5 * micro * TOP_K / E)
