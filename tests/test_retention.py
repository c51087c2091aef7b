"""The retention grid (tools/ablate.py --arms, cplm_dist.experiments.retention): arms resolve
against the base config, the report reads the in-loop curves token-weighted and says which arm
keeps retrieval without costing validation loss, and the tool trains a grid in miniature."""

import json

import pytest

from cplm_dist.errors import UsageError
from cplm_dist.experiments.retention import RetentionGrid, arm_overrides, curves_of, run_overrides, write_grid_report
from tests.test_evaluation import tool

QUICKSTART = "configs/quickstart.yaml"


def test_arms_resolve_against_the_base_config():
    arms = arm_overrides(["gate", "nosynth", "staged", "lr-half", "detach"], QUICKSTART, [], 2000,
                         custom={"peak6": ["optim.lr=6e-3"]})
    assert list(arms) == ["gate", "nosynth", "staged", "lr-half", "detach", "peak6"]
    assert arms["gate"] == [] and arms["detach"] == ["copy.gate_detach=true"]
    assert arms["nosynth"] == ["data.blend=[{path: data/quickstart/stdlib, weight: 0.5}]"]
    assert arms["lr-half"] == ["optim.lr=0.0015", "optim.min_lr=0.00015"]
    grid = RetentionGrid(QUICKSTART, ["tiny"], arms, seeds=[1], steps=2000)
    staged = run_overrides(grid, "tiny", "staged", 1)  # loads: the stages replace the blend
    assert "data.blend=[]" in staged and any("from_step: 1000" in o for o in staged)
    assert "train.eval_tasks=[induction, mqar, spamlang]" in staged and "train.eval_interval=100" in staged
    with pytest.raises(UsageError, match="unknown arm"):
        arm_overrides(["gate", "gatee"], QUICKSTART, [], 2000)
    with pytest.raises(UsageError, match="no entry with 'synthetic'"):
        arm_overrides(["nosynth"], QUICKSTART, ["data.blend=[{path: data/quickstart/stdlib, weight: 1.0}]"], 2000)


def _run_dir(root, name, accuracies, final_loss, n=(10, 30)):
    """metrics.jsonl of a run whose in-loop accuracy follows `accuracies` (every task, both
    settings, the second setting 0.1 lower: token-weighted it is acc - 0.075), pointer 0.9."""
    lines = []
    for i, acc in enumerate(accuracies):
        step = 100 * (i + 1)
        settings = {"a": {"accuracy": acc, "copy_pointer_accuracy": 0.9, "copy_share": acc / 2, "n": n[0], "loss": 1.0},
                    "b": {"accuracy": acc - 0.1, "copy_pointer_accuracy": 0.9, "copy_share": acc / 2, "n": n[1], "loss": 1.0}}
        lines.append({"event": "eval_tasks", "step": step, "tasks": {t: settings for t in ("induction", "mqar", "spamlang")}})
        lines.append({"event": "valid", "step": step, "loss": final_loss + 0.1 * (len(accuracies) - 1 - i)})
    run = root / name
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run


def test_the_report_reads_curves_and_says_which_arm_keeps_retrieval(tmp_path):
    arms = {"gate": [], "keeper": ["copy.gate_bias_init=-2"], "costly": ["copy.mix=joint"], "same": ["optim.schedule=wsd"]}
    grid = RetentionGrid(QUICKSTART, ["tiny"], arms, seeds=[1, 2, 3], steps=400, out=tmp_path)
    shape = {"gate": (0.5, 0.4, 0.3, 0.2), "keeper": (0.5, 0.5, 0.55, 0.6), "costly": (0.5, 0.5, 0.55, 0.6), "same": (0.5, 0.4, 0.3, 0.2)}
    runs = []
    for arm, accuracies in shape.items():
        for seed, loss in zip((1, 2, 3), (3.00, 3.02, 2.98)):
            extra = {"costly": 0.5, "keeper": 0.001 * seed}.get(arm, 0.0)
            jitter = 0.01 * seed if arm in ("keeper", "costly") else 0.0  # paired differences that vary by seed
            run = _run_dir(tmp_path, f"tiny-{arm}-seed{seed}", [a + jitter for a in accuracies], loss + extra)
            runs.append({"size": "tiny", "arm": arm, "seed": seed, **curves_of(run)})
    # token-weighted: (0.2 x 10 + 0.1 x 30) / 40 = 0.125 at the gate's last eval
    assert runs[0]["evals"][400]["mqar"]["accuracy"] == pytest.approx(0.125)
    report = write_grid_report(runs, grid, tmp_path)
    rows = {line.split("|")[1].strip(): line for line in report.splitlines() if line.startswith("| ")}
    assert "keeps retrieval, loss within the seeds' spread" in rows["keeper"]
    assert "keeps retrieval, costs validation loss" in rows["costly"]
    assert "does not keep retrieval" in rows["same"]
    # keeper minus gate at the end: 0.4 + 0.01 x seed -> +0.420 [+0.410, +0.430]; retained 1 against 0.2/0.5 x ...
    assert "+0.420 [+0.410, +0.430]" in rows["keeper"]
    assert (tmp_path / "retention.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "retention.md").is_file()


def test_the_grid_in_miniature(small_data, tmp_path):
    """Two arms (a named and a custom one) of 2 steps: trained with the in-loop suite, reported;
    the first arm is the reference."""
    blend = ", ".join(f"{{path: {small_data.prefixes[n]}, weight: 0.5}}" for n in ("code", "copy"))
    out = tmp_path / "grid"
    stdout = tool("tools/ablate.py", "--arms", "gate", "--arm", "detached", "copy.gate_detach=true", "--sizes", "tiny",
                  "--seeds", "1", "--steps", "2", "--out", str(out), "model.vocab_size=512", "model.max_seq_len=64",
                  "data.seq_length=64", f"data.tokenizer={small_data.tokenizer}", f"data.blend=[{blend}]",
                  "data.num_workers=0", "optim.warmup_steps=1", "train.eval_batches=1", timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["arm"], r["seed"]) for r in summary] == [("gate", 1), ("detached", 1)]
    assert all(sorted(r["evals"]) == ["1", "2"] and set(r["evals"]["2"]) == {"induction", "mqar", "spamlang"} for r in summary)
    assert "| detached |" in stdout and "each arm minus gate" in stdout
