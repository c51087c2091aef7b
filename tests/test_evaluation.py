"""Evaluation: the suite's generators and scoring (oracle perfect, uniform at chance), decoding
with a KV cache against full recomputation at tp = 1 and 2, generation, the gradient-bottleneck
figure against a direct computation, the tools end to end (lm-eval: tests/test_lm_eval.py)."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cplm_dist.config import load_config
from cplm_dist.data.corpora import synthetic_copy_documents
from cplm_dist.data.tokenizer import load_tokenizer
from cplm_dist.evaluation.tasks import GENERATORS, TASKS, EvalContext, default_settings, run_suite
from tests.reference_models import OracleModel, UniformModel
from tests.spawn import run_ranks

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ctx(small_data):
    return EvalContext(vocab_size=512, max_len=128, tokenizer=load_tokenizer(small_data.tokenizer),
                       filler=list(synthetic_copy_documents(50, seed=9)))


def all_samples(ctx, samples=4, seed=0):
    return {task: {str(s): GENERATORS[task](ctx, s, samples, seed) for s in default_settings(task, ctx.max_len)} for task in TASKS}


def test_generators_are_deterministic_per_seed(ctx):
    a, b, c = all_samples(ctx, seed=0), all_samples(ctx, seed=0), all_samples(ctx, seed=1)
    for task in TASKS:
        assert a[task] and a[task] == b[task], task
        assert a[task] != c[task], task
    # a sample's shape follows its setting
    s = GENERATORS["mqar"](ctx, {"pairs": 8, "length": 64}, 1, 0)[0]
    assert len(s.ids) == 64 and len(s.scored) == 8
    for t in s.scored:  # each scored position holds a key whose value follows it, as given in the context
        key, value = s.ids[t], s.ids[t + 1]
        assert value == s.ids[s.ids.index(key) + 1]


def test_oracle_scores_perfectly_and_uniform_at_chance(ctx):
    samples = all_samples(ctx)
    sequences = [smp.ids for task in samples.values() for batch in task.values() for smp in batch]
    oracle = run_suite(OracleModel(ctx.vocab_size, sequences), ctx, samples=4, seed=0, log=lambda *a: None)
    uniform = run_suite(UniformModel(ctx.vocab_size), ctx, samples=4, seed=0, log=lambda *a: None)
    assert set(oracle) == set(TASKS)
    for task in TASKS:
        assert oracle[task], task
        for row in oracle[task]:
            if "exact_match" in row:
                assert row["exact_match"] == 1.0, (task, row)
            else:
                assert row["accuracy"] == 1.0 and row["loss"] == 0.0, (task, row)
        for row in uniform[task]:
            if "exact_match" in row:
                assert row["exact_match"] == 0.0, (task, row)
            else:
                assert row["loss"] == pytest.approx(math.log(ctx.vocab_size)) and row["accuracy"] <= 3 / ctx.vocab_size


# --- decoding with a cache, generation ----------------------------------------------------------


def _decode_worker(tp):
    from cplm_dist.distributed import init_distributed
    from cplm_dist.evaluation.generation import generate
    from cplm_dist.model import build_model

    init_distributed(tp)
    out = {}
    for name, overrides in {"gate-next": [], "joint-self-rope": ["copy.mix=joint", "copy.paste=self", "copy.rope=true"],
                            "sentinel-2heads": ["copy.mix=sentinel", "copy.num_heads=2"], "off": ["copy.enabled=false"],
                            "gpt2": ["model.arch=gpt2"]}.items():  # learned positions at the cache's offset
        model = build_model(load_config("tiny", overrides + [f"parallel.tp={tp}"])).eval()
        g = torch.Generator().manual_seed(5)
        span = torch.randint(4, 512, (2, 6), generator=g)
        ids = torch.cat([span, span, span[:, :3]], dim=1)  # (2, 15)
        full = model.next_token_logprobs(ids)
        state = model.new_decode_state(*ids.shape)
        steps = [model.next_token_logprobs(ids[:, :5], state=state)]  # a 5-token prompt, then one token at a time
        steps += [model.next_token_logprobs(ids[:, t:t + 1], state=state) for t in range(5, ids.shape[1])]
        greedy = generate(model, ids[:, :8], 6, mark_copies=True)
        sampled = generate(model, ids[:, :8], 6, temperature=1.0, top_k=20, top_p=0.9, seed=3)
        out[name] = {"full": full, "cached": torch.cat(steps, dim=1), "greedy": greedy.tokens,
                     "copied": greedy.copied, "sampled": sampled.tokens,
                     "top1": generate(model, ids[:, :8], 6, temperature=1.0, top_k=1, seed=4).tokens}
    return out


@pytest.fixture(scope="module")
def decoded():
    return {tp: run_ranks(_decode_worker, tp, args=(tp,)) for tp in (1, 2)}


def test_cached_decoding_equals_full_recomputation(decoded):
    for tp, ranks in decoded.items():
        for name, r in ranks[0].items():
            torch.testing.assert_close(r["cached"], r["full"], rtol=1e-5, atol=1e-5, msg=f"{name} tp={tp}")
            assert torch.equal(r["greedy"][:, 0], r["full"][:, 7].argmax(-1)), "greedy takes the argmax after the prompt"
            torch.testing.assert_close(r["full"].exp().sum(-1), torch.ones(2, 15), atol=1e-5, rtol=0)


def test_generation_is_deterministic_and_the_same_on_every_rank_and_tp(decoded):
    one = decoded[1][0]
    for name, r in one.items():
        assert torch.equal(r["top1"], r["greedy"]), "top-k=1 sampling is greedy"
        assert (r["copied"] is None) == (name == "off")
        for rank in decoded[2]:
            assert torch.equal(rank[name]["greedy"], r["greedy"]) and torch.equal(rank[name]["sampled"], r["sampled"])


# --- gradient bottleneck ----------------------------------------------------------------------------


def _bottleneck_worker(tp):
    import numpy as np

    from cplm_dist.distributed import init_distributed
    from cplm_dist.evaluation.bottleneck import measure
    from cplm_dist.model import build_model

    init_distributed(tp)
    res = {}
    for name, ov in {"off": ["copy.enabled=false"], "gate": []}.items():
        cfg = load_config("tiny", ov + ["model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2",
                                        "model.vocab_size=2048", f"parallel.tp={tp}"])
        model = build_model(cfg)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(4, 2048, (2, 33), generator=g)
        ids, labels = x[:, :-1], x[:, 1:]
        res[name] = measure(model, ids, labels)
        if name == "off" and tp == 1:  # the direct computation: G = (softmax(h W^T) - onehot) / N, Q from an SVD
            with torch.no_grad():
                h = model.hidden_states(ids).double().flatten(0, 1)
                w = model.embedding.weight.double()[:2048]
                p = torch.softmax(h @ w.T, -1)
                grad = (p - torch.nn.functional.one_hot(labels.flatten(), 2048).double()) / labels.numel()
                u = np.linalg.svd(w.numpy(), full_matrices=False)[0]  # (V, D) basis of W's columns
                gq = grad.numpy() @ u
                res["direct"] = 1 - float((gq**2).sum() / (grad.numpy() ** 2).sum())
    return res


def test_bottleneck_matches_a_direct_computation_and_tp():
    one = run_ranks(_bottleneck_worker, 1, args=(1,))[0]
    assert one["off"]["suppressed_fraction"] == pytest.approx(one["direct"], abs=1e-9)
    assert one["off"]["suppressed_fraction"] > 0.95  # D = 32 against V = 2048
    assert one["off"]["grad_norm_h_via_copy_head"] == 0 and one["gate"]["grad_norm_h_via_copy_head"] > 0
    two = run_ranks(_bottleneck_worker, 2, args=(2,))
    for name in ("off", "gate"):
        for key in ("suppressed_fraction", "grad_norm_h_via_lm_head", "grad_norm_h_via_copy_head", "loss"):
            assert two[0][name][key] == pytest.approx(one[name][key], rel=1e-5, abs=1e-9), (name, key)


# --- the tools on a trained checkpoint --------------------------------------------------------------


def tool(*args, timeout=300):
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_evaluate_generate_and_bottleneck_tools(trained, tmp_path):
    out = tmp_path / "ev"
    stdout = tool("tools/evaluate.py", "--checkpoint", str(trained), "--samples", "2", "--valid-batches", "2", "--out", str(out))
    report = json.loads((out / "eval.json").read_text())
    assert report["step"] == 6 and report["validation"]["perplexity"] > 1
    assert set(report["tasks"]) == set(TASKS)
    for task in TASKS:
        assert (out / f"{task}.png").exists()
    assert "induction" in stdout and "exact match" in stdout
    text = tool("tools/generate.py", "--checkpoint", str(trained), "--prompt", "Items: a, b, c. The items again:",
                "--max-new-tokens", "8", "--mark-copies")
    assert text.startswith("--- prompt 0") and "Items: a, b, c. The items again:" in text
    stdout = tool("tools/grad_bottleneck.py", "--checkpoint", str(trained), "--all", "--plot", str(tmp_path / "b.png"),
                  "--json", str(tmp_path / "b.json"), "--seq-len", "32", "--batches", "1")
    rows = json.loads((tmp_path / "b.json").read_text())
    assert [r["step"] for r in rows] == [3, 3, 6, 6] and all(0.5 < r["suppressed_fraction"] < 1 for r in rows)
    assert (tmp_path / "b.png").exists() and "suppressed" in stdout


def test_evaluation_tools_refuse_bad_input_with_one_line(trained, small_data, tmp_path):
    """Bad values, a tokenizer the model cannot take, a too-long sequence, a damaged checkpoint:
    one line, exit 2, nothing written."""
    import shutil

    from cplm_dist.data.corpora import synthetic_copy_documents
    from cplm_dist.data.tokenizer import train_sentencepiece

    big_tok = tmp_path / "big.model"
    train_sentencepiece(synthetic_copy_documents(400, seed=1), big_tok, vocab_size=700)  # the model has 512 ids
    damaged = tmp_path / "damaged"
    shutil.copytree(trained, damaged)
    step = damaged / "checkpoints" / (damaged / "checkpoints" / "latest").read_text().strip()
    states = next(step.glob("*model_states.pt"))
    states.write_bytes(states.read_bytes()[:1000])
    cases = [
        (["tools/generate.py", "--checkpoint", str(trained), "--prompt", "x", "--top-p", "0"], r"0 < top-p <= 1"),
        (["tools/generate.py", "--checkpoint", str(trained), "--prompt", "x", "--max-new-tokens", "0"], r"max-new-tokens >= 1"),
        (["tools/generate.py", "--checkpoint", str(trained), "--prompt", "x", "--tokenizer", str(big_tok)],
         r"has 700 ids but model.vocab_size=512"),
        (["tools/evaluate.py", "--checkpoint", str(trained), "--samples", "0"], r"need samples >= 1"),
        (["tools/evaluate.py", "--checkpoint", str(trained), "data.seq_length=512"],
         r"data.seq_length=512 exceeds the checkpoint's model.max_seq_len=128"),
        (["tools/evaluate.py", "--checkpoint", str(trained), f"data.tokenizer={big_tok}", "--valid-batches", "0"],
         r"has 700 ids but model.vocab_size=512"),
        (["tools/generate.py", "--checkpoint", str(damaged), "--prompt", "x"], r"model_states\.pt'\] missing or damaged"),
    ]
    cases = [([*args, "--out" if "evaluate" in args[0] else "--seed", str(tmp_path / "out") if "evaluate" in args[0] else "0"],
              pattern) for args, pattern in cases]
    # the real command line once, for the case that goes furthest (a loaded model, data overrides,
    # a tokenizer); the others call each tool's main() in one spawned process (a process each cost
    # ~5 s of imports), stderr captured at the file descriptor
    cli = cases.pop(5)
    proc = subprocess.run([sys.executable, *cli[0]], capture_output=True, text=True, timeout=300, cwd=REPO)
    results = run_ranks(_refusals_worker, 1, args=([args for args, _ in cases],))[0] + [(proc.returncode, proc.stderr)]
    cases.append(cli)
    for (args, pattern), (code, stderr) in zip(cases, results, strict=True):
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1 and re.search(pattern, lines[0]), (args, stderr[-1500:])
    assert not (tmp_path / "out").exists()


def _refusals_worker(cases):
    """Each case's (exit code, stderr) from `tools/<name>.py`'s main(argv), in this one process."""
    import importlib
    import os
    import tempfile

    results = []
    for args in cases:
        main = importlib.import_module(f"cplm_dist_tools.{Path(args[0]).stem}").main
        with tempfile.TemporaryFile("w+") as err:
            sys.stderr.flush()
            saved = os.dup(2)
            os.dup2(err.fileno(), 2)
            try:
                code = main(args[1:])
            except SystemExit as e:
                code = e.code
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
            err.seek(0)
            results.append((code, err.read()))
    return results


def test_ablation_in_miniature(small_data, tmp_path, capsys, monkeypatch):
    blend = ", ".join(f"{{path: {small_data.prefixes[n]}, weight: 0.5}}" for n in ("code", "copy"))
    out = tmp_path / "ablation"
    stdout = tool("tools/ablate.py", "--sizes", "tiny", "--variants", "off", "gate", "--steps", "4", "--samples", "2",
                  "--out", str(out), "model.vocab_size=512", "model.max_seq_len=64", "data.seq_length=64",
                  f"data.tokenizer={small_data.tokenizer}", f"data.blend=[{blend}]", "data.num_workers=0",
                  "optim.warmup_steps=1", "train.eval_batches=2", timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in summary] == ["tiny-off-seed1", "tiny-gate-seed1"]
    report = (out / "report.md").read_text()
    assert "| tiny-gate-seed1 |" in report and "tiny, seed 1, gate:" in report and "matched pairs" in report
    for png in ("loss.png", "suite.png", "suppression.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert "Copy on beat copy off" in stdout
    # finished runs are reused: a second call trains nothing (in this process: it only reads and
    # plots, and would still launch a training if it retrained)
    from cplm_dist_tools.ablate import main

    monkeypatch.chdir(REPO)  # where the tool ran above
    assert main(["--sizes", "tiny", "--variants", "off", "gate", "--steps", "4", "--samples", "2",
                 "--out", str(out), "model.vocab_size=512", "model.max_seq_len=64", "data.seq_length=64",
                 f"data.tokenizer={small_data.tokenizer}", f"data.blend=[{blend}]", "data.num_workers=0",
                 "optim.warmup_steps=1", "train.eval_batches=2"]) == 0
    again = capsys.readouterr().out
    assert "train tiny" not in again and "Copy on beat copy off" in again



def test_ablation_summarises_paired_differences_across_seeds():
    from cplm_dist.experiments.ablation import across_seeds

    def run(variant, seed, loss, induction):
        return {"size": "tiny", "variant": variant, "seed": seed, "valid_loss": loss,
                "suite": {"induction": induction, "mqar": 0.0, "spamlang": 0.0, "needle": 0.0}}

    runs = [run("off", 1, 5.0, 0.0), run("gate", 1, 4.0, 0.30), run("off", 2, 5.0, 0.10), run("gate", 2, 5.005, 0.105),
            run("off", 3, 4.0, 0.0), run("gate", 3, 4.5, 0.2)]
    table = across_seeds(runs, ["tiny"], ["off", "gate"], ["induction", "mqar", "needle", "spamlang"])
    row = next(line for line in table.splitlines() if line.startswith("| tiny | gate |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "3"
    # valid loss differences -1.0, +0.005, +0.5: mean -0.165, one win (only -1.0 is lower by > 0.01)
    assert cells[3] == "-0.165 [-1.000, +0.500], won 1/3"
    # induction +0.30, +0.005 (a tie), +0.20
    assert cells[4] == "+0.168 [+0.005, +0.300], won 2/3"
    assert "needle" not in table.splitlines()[2]  # only the copy tasks are summarised


def test_ablation_reports_what_the_optimizer_changes_in_the_copy_heads_gain(tmp_path):
    """--optimizers adamw muon: the runs are named by size and optimizer, and the report says the
    copy head's gain under each (mean over seeds) beside the gradient path it opens."""
    from cplm_dist.experiments.ablation import Ablation, grid_table, run_overrides, write_report

    ablation = Ablation("configs/quickstart.yaml", ["tiny"], ["off", "gate"], seeds=[1, 2], optimizers=["adamw", "muon"],
                        learning_rates={"muon": 6e-3}, out=tmp_path)
    assert [arm.label for arm in ablation.arms()] == ["tiny-adamw", "tiny-muon"]
    muon = run_overrides(ablation, "tiny", "gate", 1, "muon", "tiny-muon")
    assert "optim.name=muon" in muon and "optim.muon.lr=0.006" in muon and f"train.out_dir={tmp_path}/tiny-muon-gate-seed1" in muon

    def run(opt, variant, seed, loss, induction):
        return {"name": f"tiny-{opt}-{variant}-seed{seed}", "size": f"tiny-{opt}", "optimizer": opt, "variant": variant,
                "seed": seed, "valid_loss": loss, "valid_curve": [(100, loss)], "suite": {"induction": induction},
                "suppressed_fraction": 0.9, "grad_h_lm": 0.02, "grad_h_copy": 0.04 if variant != "off" else 0.0}

    runs = [run("adamw", "off", s, 5.0, 0.0) for s in (1, 2)] + [run("adamw", "gate", s, 4.0, 0.3) for s in (1, 2)]
    runs += [run("muon", "off", s, 4.5, 0.0) for s in (1, 2)] + [run("muon", "gate", s, 4.0, 0.2) for s in (1, 2)]
    grid = {"adamw": {"picked": 3e-3, "valid_loss": {1.5e-3: 5.1, 3e-3: 5.0}}, "muon": {"picked": 6e-3, "valid_loss": {6e-3: 4.5}}}
    report = write_report(runs, ablation, tmp_path, grid)
    assert "| adamw | **0.003** | 5.0000 |" in grid_table(grid) and "## Learning rates, picked on a grid first" in report
    rows = [line for line in report.splitlines() if line.startswith("| tiny | gate |")]
    assert rows == ["| tiny | gate | adamw | -1.000 | +0.300 | 2.00 | 0.9000 |",
                    "| tiny | gate | muon | -0.500 | +0.200 | 2.00 | 0.9000 |"]


def test_ablation_reports_the_copy_heads_gain_under_each_backbone(tmp_path):
    """--backbones dense sparse: the sparse arm has the dense model's active parameters (8 experts
    of width ffn/2, top-2; the router's E x D a layer apart), its runs are named by backbone, and
    the report gives the copy head's gain under each backbone across seeds, the gain's difference
    paired by seed, and the expert load and copy share over steps."""
    from cplm_dist.experiments.ablation import Ablation, run_overrides, write_report
    from cplm_dist.experiments.ablation_sparse import parameters

    ablation = Ablation("configs/quickstart.yaml", ["tiny"], ["off", "gate"], seeds=[1, 2], backbones=["dense", "sparse"],
                        skip=("bottleneck",), out=tmp_path)
    assert [arm.label for arm in ablation.arms()] == ["tiny-dense", "tiny-sparse"]
    sparse = run_overrides(ablation, "tiny", "gate", 1, "adamw", "tiny-sparse", "sparse")
    assert {"model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.ffn_hidden_size=128"} <= set(sparse)
    dense_n = parameters("configs/quickstart.yaml", run_overrides(ablation, "tiny", "gate", 1, "adamw", "tiny-dense"))
    sparse_n = parameters("configs/quickstart.yaml", sparse)
    assert sparse_n["active"] - dense_n["active"] == 2 * 8 * 128 and sparse_n["total"] > 1.5 * dense_n["total"]

    def run(backbone, variant, seed, loss, induction):
        load = [(10, 2.0), (20, 1.5), (30, 1.2)] if backbone == "sparse" else []
        return {"name": f"tiny-{backbone}-{variant}-seed{seed}", "size": f"tiny-{backbone}", "backbone": backbone,
                "optimizer": "adamw", "variant": variant, "seed": seed, "valid_loss": loss, "valid_curve": [(100, loss)],
                "suite": {"induction": induction}, "suppressed_fraction": None, "grad_h_lm": None, "grad_h_copy": None,
                "parameters": sparse_n if backbone == "sparse" else dense_n,
                "over_steps": {"max_load": load, "copy_share": [(10, 0.1), (20, 0.2), (30, 0.4)] if variant != "off" else []}}

    runs = [run("dense", "off", s, 5.0, 0.0) for s in (1, 2)] + [run("dense", "gate", 1, 4.0, 0.3), run("dense", "gate", 2, 4.2, 0.2)]
    runs += [run("sparse", "off", s, 4.8, 0.0) for s in (1, 2)] + [run("sparse", "gate", 1, 4.3, 0.3), run("sparse", "gate", 2, 4.1, 0.1)]
    report = write_report(runs, ablation, tmp_path)
    rows = [line for line in report.splitlines() if line.startswith(("| tiny-dense | dense |", "| tiny-sparse | sparse |"))]
    # mean [min, max] and the 90% t-interval of the mean (2 seeds: t = 6.314 x the standard error)
    assert rows == ["| tiny-dense | dense | gate | 2 | -0.900 [-1.000, -0.800], 90% t [-1.531, -0.269], won 2/2 | "
                    "+0.250 [+0.200, +0.300], 90% t [-0.066, +0.566], won 2/2 |",
                    "| tiny-sparse | sparse | gate | 2 | -0.600 [-0.700, -0.500], 90% t [-1.231, +0.031], won 2/2 | "
                    "+0.200 [+0.100, +0.300], 90% t [-0.431, +0.831], won 2/2 |"]
    # sparse minus dense gain by seed: valid loss +0.5 (seed 1), +0.1 (seed 2); induction 0.0, -0.1
    assert ("| tiny | adamw | gate | +0.300 [+0.100, +0.500], 90% t [-0.963, +1.563] | "
            "-0.050 [-0.100, +0.000], 90% t [-0.366, +0.266] |") in report
    assert "| tiny-sparse | gate | 1.42M / 0.83M | 2.000, 1.500, 1.200 | 0.100, 0.200, 0.400 |" in report
    assert "| tiny-dense | off | 0.83M / 0.83M | - | - |" in report
    assert (tmp_path / "routing.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "suppression.png").exists()
    assert "![routing](routing.png)" in report and "suppression.png" not in report


@pytest.mark.parametrize("args,message", [
    (["--optimizers", "adamw", "--lr-grid", "muon=1e-3"], "must be one of --optimizers"),
    (["--optimizers", "muon", "--lr", "muon=fast"], "expected OPT=LR"),
])
def test_ablation_refuses_a_bad_learning_rate_in_one_line(args, message):
    proc = subprocess.run([sys.executable, "tools/ablate.py", *args], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
