"""Watching the copy head learn (docs/training.md, "Watching the copy head learn"): the live gradient
paths against a dense QR reference and tools/grad_bottleneck.py's measure at tp 1 and 2, in-loop
evaluation at dp 2 against one process, staged data mixtures stopped and resumed across a boundary
(also with another global batch), a planted spike found and skipped alike by a straight and a
resumed run, and the diagnostics and in-loop evaluation leaving training's losses as they were. The
per-source figures are checked on the dp x cp and pipeline runs of test_context_parallel.py and
test_train.py (tests/source_reference.py)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from cplm_dist.config import ConfigError, load_config
from cplm_dist.training.run_log import read_metrics
from tests.spawn import run_ranks
from tests.test_train import argv, losses, train

# --- the live bottleneck -------------------------------------------------------------------------------


def _dense_suppressed(model, ids, labels) -> float:
    """The dense reference: G = dL/dz and W gathered over the vocabulary (its padding rows cut),
    Q from a QR of W (V x D), 1 - ||G Q||^2 / ||G||^2 in float64."""
    import cplm_dist.model.loss as vp

    with torch.no_grad():
        h = model.hidden_states(ids)
        copy = model.copy_head(h, ids, labels)
    logits = model.lm_logits(h, model.tied).detach().requires_grad_(True)
    nll = vp.mixed_nll(logits, labels, copy, model.copy_cfg.mix, model.tp_group).nll
    (grad,) = torch.autograd.grad(nll.sum() / (labels != vp.IGNORE_INDEX).sum(), logits)
    vocab = model.vocab_size
    g = vp.gather_vocab(grad.flatten(0, 1), model.tp_group)[:, :vocab].double()
    weight = model.embedding.weight if model.model_cfg.tie_embeddings else model.lm_head.weight
    q, _ = torch.linalg.qr(vp.gather_vocab(weight.detach(), model.tp_group, dim=0)[:vocab].double(), mode="reduced")
    return float(1 - (g @ q).pow(2).sum() / g.pow(2).sum())


def _paths_worker(tp, sequence_parallel):
    from cplm_dist.distributed import init_distributed
    from cplm_dist.evaluation.bottleneck import measure
    from cplm_dist.model import build_model
    from cplm_dist.model.gradient_paths import gradient_paths

    cfg = load_config("tiny", ["model.vocab_size=500", f"parallel.tp={tp}"])  # padded over tp: the padding rows must stay out
    init_distributed(tp)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, sequence_parallel=sequence_parallel)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 500, (2, 65), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :5] = -100
    planted = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = planted[n].clone()
    live = gradient_paths(model, ids[:, :-1], labels)
    untouched = all(torch.equal(p.grad, planted[n]) for n, p in model.named_parameters())
    tool = measure(model, ids[:, :-1], labels) if not sequence_parallel else None
    dense = _dense_suppressed(model, ids[:, :-1], labels) if not sequence_parallel else None
    return live, tool, dense, untouched


def test_live_gradient_paths_equal_the_tools_measure_at_tp1_and_tp2():
    """tp 2 (and tp 2 with sequence parallelism) gives tp 1's figures, which are the tool's; the
    suppressed fraction, from W^T W and G W summed over the vocabulary shards, is the dense QR
    reference's (G and W gathered, the padding rows cut); the parameters' .grad is left as it was."""
    one = run_ranks(_paths_worker, 1, args=(1, False))[0]
    two = run_ranks(_paths_worker, 2, args=(2, False))
    two_sp = run_ranks(_paths_worker, 2, args=(2, True))
    live, tool, dense, untouched = one
    assert untouched
    for key in ("loss", "suppressed_fraction", "grad_norm_h_via_lm_head", "grad_norm_h_via_copy_head", "tokens"):
        assert live[key] == pytest.approx(tool[key], rel=1e-6), key
    assert live["suppressed_fraction"] == pytest.approx(dense, rel=1e-6)
    assert 0 < live["suppressed_fraction"] < 1 and live["grad_norm_h_via_copy_head"] > 0
    assert live["copy_to_lm_ratio"] == pytest.approx(live["grad_norm_h_via_copy_head"] / live["grad_norm_h_via_lm_head"])
    assert 0 <= live["copy_dominates"] <= 1 and 0 < live["copy_share_mean"] < 1
    for rank_live, rank_tool, rank_dense, rank_untouched in two + two_sp:
        assert rank_untouched
        for key, value in live.items():
            assert rank_live[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        if rank_tool is not None:
            assert rank_tool["suppressed_fraction"] == pytest.approx(tool["suppressed_fraction"], rel=1e-5)
            assert rank_dense == pytest.approx(dense, rel=1e-5)


# --- in-loop evaluation --------------------------------------------------------------------------------


def _in_loop_worker(tp, tokenizer):
    from cplm_dist.data.tokenizer import load_tokenizer
    from cplm_dist.distributed import init_distributed
    from cplm_dist.evaluation.in_loop import in_loop_eval
    from cplm_dist.model import build_model

    cfg = load_config("tiny", ["model.vocab_size=512", "model.max_seq_len=128", "data.seq_length=128",
                               "train.eval_tasks=[induction, mqar, phonebook]", "train.eval_task_samples=5",
                               "train.eval_task_lengths=[64]"])
    dims = init_distributed(tp)
    torch.manual_seed(cfg.seed)
    out = in_loop_eval(build_model(cfg), cfg, dims, load_tokenizer(tokenizer))
    out.pop("seconds")
    return out


def test_in_loop_evaluation_at_dp2_equals_one_process(small_data):
    one = run_ranks(_in_loop_worker, 1, args=(1, str(small_data.tokenizer)))[0]
    dp2 = run_ranks(_in_loop_worker, 2, args=(1, str(small_data.tokenizer)))
    assert set(one["tasks"]) == {"induction", "mqar", "phonebook"} and set(one["by_length"]["mqar"]) == {"64"}
    assert one["tasks"]["induction"]["span=8"]["n"] == 5 * 7  # 5 samples (odd: the ranks' shares differ), 7 scored each
    for rank in dp2:
        assert rank.keys() == one.keys()
        for section in ("tasks", "by_length"):
            for task, rows in one[section].items():
                for label, figures in rows.items():
                    for key, value in figures.items():  # losses are float32 sums over a different batching: 1e-6
                        tol = 1e-6 if "loss" in key else 1e-12
                        assert rank[section][task][label][key] == pytest.approx(value, rel=tol), (task, label, key)


# --- staged data, spikes, and diagnostics / in-loop evaluation leave training alone ------------------


STEPS, BOUNDARY, SPIKE = 8, 4, 7


def _staged_args(small_data, out, *extra):
    code, copy = small_data.prefixes["code"], small_data.prefixes["copy"]
    stages = (f"data.stages=[{{from_step: 0, blend: [{{path: {code}, weight: 0.5}}, {{path: {copy}, weight: 0.5}}]}}, "
              f"{{from_step: {BOUNDARY}, blend: [{{path: {copy}, weight: 1.0}}]}}]")
    return argv(small_data, out, f"train.train_steps={STEPS}", "data.blend=[]", stages, "train.spike_window=3",
                "train.spike_zscore=8", "train.skip_spikes=true", f"train.inject_spike_at=[{SPIKE}]", *extra)


def _records(out, event):
    return [json.loads(line) for line in (Path(out) / "logs" / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["event"] == event]


@pytest.fixture(scope="module")
def staged(small_data, tmp_path_factory):
    """{name: out_dir}: the staged run straight with diagnostics and in-loop evaluation on, the same
    with them off, and stopped in stage 0 (step 3, a copy kept) and resumed to the end."""
    root = tmp_path_factory.mktemp("staged")
    on = ("train.diagnostics_interval=2", "train.eval_interval=4", "train.eval_tasks=[induction, mqar]",
          "train.eval_task_samples=2", "train.eval_task_lengths=[64]")
    assert train(1, _staged_args(small_data, root / "on", *on)) == [0]
    assert train(1, _staged_args(small_data, root / "off")) == [0]
    resumed = _staged_args(small_data, root / "resumed", "train.save_interval=3")
    assert train(1, resumed + ["train.exit_at_step=3"]) == [0]
    shutil.copytree(root / "resumed", root / "stopped")
    assert train(1, resumed + ["--resume", "auto"]) == [0]
    return root


def test_diagnostics_and_in_loop_evaluation_leave_the_losses_alone(staged):
    on, off = losses(staged / "on"), losses(staged / "off")
    assert sorted(on) == list(range(1, STEPS + 1))
    for step in on:
        assert on[step] == pytest.approx(off[step], rel=0, abs=1e-6), step
    diagnostics = {r["step"]: r for r in _records(staged / "on", "diagnostics")}
    assert sorted(diagnostics) == [2, 4, 6, 8]
    assert all(0 < r["suppressed_fraction"] < 1 and r["copy_to_lm_ratio"] > 0 for r in diagnostics.values())
    evaluated = {r["step"]: r for r in _records(staged / "on", "eval_tasks")}
    assert sorted(evaluated) == [4, 8] and set(evaluated[8]["tasks"]) == {"induction", "mqar"}
    assert "64" in evaluated[8]["by_length"]["mqar"]
    assert list((staged / "on" / "logs" / "tensorboard").glob("events.out.tfevents.*"))


def test_each_stage_reads_its_own_blend(staged):
    log = read_metrics(staged / "off" / "logs" / "metrics.jsonl")
    for step, record in log.items():
        assert set(record["sources"]) == ({"code", "copy"} if step <= BOUNDARY else {"copy"}), step
    cumulative = log[STEPS]["sources"]["copy"]["cumulative_tokens"]
    assert cumulative == sum(r["sources"]["copy"]["tokens"] for r in log.values())  # log_interval 1: every step's
    valid = read_metrics(staged / "off" / "logs" / "metrics.jsonl", "valid")[STEPS]
    assert set(valid["sources"]) == {"copy"}  # validation reads the last stage's blend


def test_a_planted_spike_is_found_skipped_and_decided_alike_after_a_resume(staged):
    for run in ("off", "resumed"):
        spikes = [r for r in _records(staged / run, "spike") if r["metric"] == "loss"]
        assert [(r["step"], r["skipped"]) for r in spikes] == [(SPIKE, True)], run
        assert set(spikes[0]["sources"]) == {"copy"} and spikes[0]["zscore"] > 8
        summary = _records(staged / run, "summary")[-1]  # the spike's skip counted apart from non-finite steps
        assert (summary["skipped_steps"], summary["skipped_spikes"]) == (0, 1), run
    straight, resumed = losses(staged / "off"), losses(staged / "resumed")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in straight:  # across the stage boundary and the skipped update
        assert resumed[step] == pytest.approx(straight[step], rel=0, abs=1e-6), step


def test_a_resume_with_another_global_batch_keeps_each_stage_position(small_data, staged, tmp_path):
    """Stopped at step 3 (global batch 16), resumed at 32: stage 0 continues at sample 48 for its
    one remaining step, stage 1 starts at its own sample 0; the positions are in the checkpoint."""
    out = staged / "stopped"
    args = _staged_args(small_data, out, "train.global_batch_size=32", "train.inject_spike_at=[]")
    assert train(1, args + ["--resume", "auto"]) == [0]
    state = torch.load(out / "checkpoints" / f"step-{STEPS:08d}" / "mp_rank_00_model_states.pt", weights_only=False)
    stages = state["data_stages"]
    assert [s["consumed_samples"] for s in stages] == [3 * 16 + 32, 4 * 32], stages
    assert state["loader"] == {"consumed_samples": 3 * 16 + 5 * 32}
    log = read_metrics(out / "logs" / "metrics.jsonl")
    assert set(log[4]["sources"]) == {"code", "copy"} and set(log[5]["sources"]) == {"copy"}


def test_a_resume_that_changes_a_begun_stage_is_one_line(small_data, staged):
    import subprocess
    import sys

    args = _staged_args(small_data, staged / "off", "train.train_steps=10").copy()
    args = [a.replace(f"from_step: {BOUNDARY}", f"from_step: {BOUNDARY + 1}") for a in args]
    proc = subprocess.run([sys.executable, "-m", "cplm_dist.train", *args, "--resume", "auto"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "trained stage 1 of its data mixture as" in proc.stderr.strip().splitlines()[-1]


# --- the config --------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, words", [
    (["parallel.pp=2", "model.num_layers=4", "train.diagnostics_interval=10"], "train.diagnostics_interval runs on the whole model"),
    (["parallel.cp=2", "train.eval_tasks=[mqar]"], "train.eval_tasks runs on the whole model"),
    (["train.zero_stage=3", "train.eval_task_lengths=[64]"], "train.eval_tasks runs on the whole model"),
    (["train.eval_tasks=[needle]"], "train.eval_tasks names 'needle'"),
    (["data.stages=[{from_step: 5, blend: [{path: a}]}]"], "the first stage must begin at from_step 0"),
    (["data.stages=[{from_step: 0, blend: [{path: a}]}, {from_step: 0, blend: [{path: b}]}]"], "is not after"),
    (["train.train_steps=10", "data.stages=[{from_step: 0, blend: [{path: a}]}, {from_step: 10, blend: [{path: b}]}]"],
     "would never run"),
])
def test_monitor_and_stage_configs_that_cannot_run_are_one_line(overrides, words):
    blend = [] if any(o.startswith("data.stages") for o in overrides) else None
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides + (["data.blend=[]"] if blend is not None else []))
    assert words in str(e.value)


def test_data_blend_and_stages_together_are_refused():
    with pytest.raises(ConfigError, match="data.blend and data.stages are both set"):
        load_config("tiny", ["data.blend=[{path: a}]", "data.stages=[{from_step: 0, blend: [{path: b}]}]"])


def test_the_spike_monitor_finds_a_planted_spike_and_restores_its_window():
    from types import SimpleNamespace

    from cplm_dist.training.stability import SpikeMonitor

    cfg = SimpleNamespace(spike_window=5, spike_zscore=4.0, skip_spikes=True)
    values = [3.0, 2.9, 3.1, 3.0, 2.95, 2.9, 3.05, 9.0, 3.0]
    straight, found = SpikeMonitor(cfg), []
    for i, v in enumerate(values):
        skip = straight.skips(v)
        spikes = straight.observe(v, 1.0)
        assert skip == any(s.metric == "loss" for s in spikes)
        found += [(i, s.metric) for s in spikes]
        if i == 4:
            saved = straight.state_dict()
    assert found == [(7, "loss")]
    resumed = SpikeMonitor(cfg)
    resumed.load_state_dict(json.loads(json.dumps(saved)))
    assert [resumed.skips(v) or bool(resumed.observe(v, 1.0)) for v in values[5:]] == [False, False, True, False]
    assert not SpikeMonitor(SimpleNamespace(spike_window=0, spike_zscore=4.0, skip_spikes=True)).skips(100.0)


# --- profiling steps of a real run; a logger that fails ----------------------------------------------


def _train_reporting_warnings(args):
    import contextlib
    import io

    from cplm_dist.train.driver import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    return code, [line for line in err.getvalue().splitlines() if line.startswith("warning:")]


def test_profile_steps_write_a_chrome_trace_and_a_failing_tensorboard_is_one_warning(small_data, tmp_path):
    """train.profile_steps=[2, 3] of a 3-step run: logs/profile/rank0-step2-3.json, a Chrome trace
    of both steps (their ProfilerStep spans and the ops inside). Its TensorBoard directory is a file
    (so every TensorBoard write fails): one warning line, and the run finishes with its metrics."""
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "tensorboard").write_text("not a directory")
    args = argv(small_data, out, "train.train_steps=3", "train.profile_steps=[2, 3]")
    ((code, warnings),) = run_ranks(_train_reporting_warnings, 1, args=(args,))
    assert code == 0 and len(warnings) == 1 and warnings[0].startswith("warning: TensorBoard failed ("), warnings
    assert sorted(read_metrics(out / "logs" / "metrics.jsonl")) == [1, 2, 3]
    assert [p.name for p in (out / "logs" / "profile").iterdir()] == ["rank0-step2-3.json"]
    events = json.loads((out / "logs" / "profile" / "rank0-step2-3.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {n for n in names if n.startswith("ProfilerStep#")} == {"ProfilerStep#2", "ProfilerStep#3"}
    assert any(n.startswith("aten::") for n in names)


def test_profile_and_keep_fields_refuse_bad_values_with_one_line():
    for overrides, pattern in [
        (["train.profile_steps=[3]"], r"^train\.profile_steps=\[3\] must be \[first, last\] steps with 1 <= first <= last"),
        (["train.train_steps=10", "optim.warmup_steps=2", "train.profile_steps=[5, 11]"], r"<= train\.train_steps=10 \(\[\] = no profile\)$"),
        (["train.keep_every=-1"], r"^train\.keep_every=-1 must be >= 0 \(0: only train\.keep_last decides\)$"),
        (["train.reshape_timeout_minutes=0"], r"^train\.reshape_timeout_minutes=0 must be > 0 \(e\.g\. 120\)$"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            load_config("tiny", overrides)
