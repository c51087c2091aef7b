"""Evaluation by context length: the generators are deterministic, as long as asked, and hold
their answer; an oracle scores perfectly and chance scores nothing; chunked prefill equals
feeding the whole prompt; tools/evaluate.py --context-lengths writes its JSON and plot, refuses a
length beyond the model, and --compare draws two runs side by side; the lm-eval group
cplm_local_long builds offline."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cplm_dist.config import load_config
from cplm_dist.data.corpora import stdlib_documents
from cplm_dist.data.tokenizer import load_tokenizer
from cplm_dist.evaluation.long_context import LONG_TASKS, TEXT_TASKS, long_samples, run_by_length, token_haystack
from cplm_dist.evaluation.tasks import EvalContext
from tests.reference_models import OracleModel, UniformModel
from tests.spawn import run_ranks

REPO = Path(__file__).resolve().parent.parent
LENGTHS = (128, 200)


@pytest.fixture(scope="module")
def ctx(small_data):
    return EvalContext(vocab_size=512, max_len=128, tokenizer=load_tokenizer(small_data.tokenizer),
                       filler=[doc for _, doc in zip(range(20), stdlib_documents())])


def test_samples_are_deterministic_as_long_as_asked_and_hold_their_answer(ctx):
    hay = token_haystack(ctx, 400)
    for task in LONG_TASKS:
        for length in (128, 300):
            a, b = (long_samples(task, ctx, hay, length, 5, seed=3) for _ in range(2))
            assert [s.ids for s in a] == [s.ids for s in b]
            assert [s.ids for s in long_samples(task, ctx, hay, length, 5, seed=4)] != [s.ids for s in a]
            for s in a:
                if task in TEXT_TASKS:  # prompt + answer and the one token generated after it: `length`
                    assert len(s.ids) + 1 == length, (task, length, len(s.ids))
                    assert s.answer.strip() and s.answer in ctx.tokenizer.decode(s.ids[s.prompt_len:])
                else:
                    assert len(s.ids) == length and len(s.scored) == 8
                    for t in s.scored:  # each queried key's value appears after the same key earlier on
                        assert any(s.ids[j] == s.ids[t] and s.ids[j + 1] == s.ids[t + 1] for j in range(t - 1))
    vartrack = long_samples("vartrack", ctx, hay, 300, 1, seed=0)[0]
    text = ctx.tokenizer.decode(vartrack.ids[: vartrack.prompt_len])
    assert text.count("VAR ") >= 6 and vartrack.answer in text  # two chains of a value and two hops


def test_an_oracle_scores_perfectly_and_chance_scores_nothing(ctx):
    hay = token_haystack(ctx, 2 * max(LENGTHS))
    sequences = [s.ids for task in LONG_TASKS for n in LENGTHS for s in long_samples(task, ctx, hay, n, 3, seed=0)]
    quiet = lambda *a: None  # noqa: E731
    oracle = run_by_length(OracleModel(ctx.vocab_size, sequences), ctx, list(LENGTHS), samples=3, seed=0, log=quiet)
    uniform = run_by_length(UniformModel(ctx.vocab_size), ctx, list(LENGTHS), samples=3, seed=0, log=quiet)
    assert set(oracle) == set(LONG_TASKS)
    for task in LONG_TASKS:
        assert set(oracle[task]) == {str(n) for n in LENGTHS}
        assert all(row["accuracy"] == 1.0 for row in oracle[task].values()), (task, oracle[task])
        assert all(row["accuracy"] <= 0.05 for row in uniform[task].values()), (task, uniform[task])


def _prefill_worker():
    from cplm_dist.distributed import init_distributed
    from cplm_dist.evaluation.generation import generate
    from cplm_dist.evaluation.long_context import chunked_score
    from cplm_dist.model import build_model

    init_distributed(1)
    out = {}
    for name, overrides in {"gate": ["copy.rope=true"], "gpt2": ["model.arch=gpt2"], "off": ["copy.enabled=false"]}.items():
        model = build_model(load_config("tiny", overrides + ["model.max_seq_len=128", "data.seq_length=128"])).eval()
        ids = torch.randint(3, 512, (2, 70), generator=torch.Generator().manual_seed(2))
        targets = ids.roll(-1, 1)
        out[name] = {"whole": generate(model, ids, 5).tokens, "chunked": generate(model, ids, 5, prefill_chunk=16).tokens,
                     "score": model.score(ids, targets), "score_chunked": chunked_score(model, ids, targets, chunk=9)}
    return out


def test_prompts_prefilled_in_chunks_give_what_the_whole_prompt_gives():
    for name, r in run_ranks(_prefill_worker, 1)[0].items():
        assert torch.equal(r["whole"], r["chunked"]), name
        assert torch.allclose(r["score"][0], r["score_chunked"][0], atol=1e-5), name
        assert torch.equal(r["score"][1], r["score_chunked"][1]), name


def tool(*args, expect=0):
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


def test_evaluate_by_context_length_and_compare(trained, tmp_path):
    """The JSON has a result per task and length, the PNG exists; a second evaluation (another
    seed: another pair's stand-in) and --compare of the two draws them side by side."""
    a, b = tmp_path / "a", tmp_path / "b"
    tool("tools/evaluate.py", "--checkpoint", str(trained), "--context-lengths", "128", "--samples", "2",
         "--valid-batches", "1", "--out", str(a))
    report = json.loads((a / "eval_by_length.json").read_text())
    assert set(report["tasks"]) == set(LONG_TASKS) and report["lengths"] == [128]
    for rows in report["tasks"].values():
        assert set(rows) == {"128"} and all(0 <= r["accuracy"] <= 1 and r["samples"] == 2 for r in rows.values())
    assert (a / "by_length.png").stat().st_size > 0
    out = tmp_path / "cmp"
    proc = tool("tools/evaluate.py", "--compare", str(a), str(trained), "--context-lengths", "128", "--samples", "1",
                "--valid-batches", "0", "--seed", "1", "--tasks", "mqar", "--out", str(out))
    both = json.loads((out / "compare.json").read_text())
    assert len(both) == 2 and (out / "compare.png").stat().st_size > 0 and "wrote" in proc.stdout
    assert [r["seed"] for r in both.values()] == [0, 1] and [set(r["tasks"]) for r in both.values()][1] == {"mqar"}


def test_evaluate_by_length_refuses_what_cannot_run_in_one_line(trained, capsys):
    """Checked before the model is loaded (in-process: no process group is made)."""
    from cplm_dist_tools.evaluate import main

    for args, words in [(["--context-lengths", "256"], "exceeds the checkpoint's model.max_seq_len=128"),
                        (["--context-lengths", "8"], "too short"),
                        (["--context-lengths", "128", "--tasks", "induction"], "drop --tasks induction"),
                        (["--tasks", "vartrack"], "by context length only"),
                        (["--compare", str(trained), str(trained)], "add --context-lengths")]:
        checkpoint = [] if "--compare" in args else ["--checkpoint", str(trained)]
        assert main([*checkpoint, *args]) == 2, args
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], (args, lines)


def test_the_lm_eval_long_group_is_built_offline_from_the_same_generators():
    """cplm_local_long: each task file names a generator of long_tasks.py, the group names every
    task, and the rows are as long as asked (characters) with their answer after the question.
    (Loading the group through lm_eval's TaskManager scans all of lm-eval's tasks, ~35 s: checked
    by hand, docs/evaluation.md.)"""
    import re

    from cplm_dist.evaluation.harness_tasks import TASKS_DIR, long_tasks

    group = (TASKS_DIR / "cplm_local_long.yaml").read_text()
    names = re.findall(r"- (cplm_long_\w+)", group)
    assert names == ["cplm_long_needle", "cplm_long_phonebook", "cplm_long_vartrack"]
    for name in names:
        spec = (TASKS_DIR / f"{name}.yaml").read_text()
        fn = re.search(r"!function long_tasks\.(\w+)", spec).group(1)
        data = getattr(long_tasks, fn)(n=2, lengths=[600, 3000])["test"]
        assert len(data) == 4 and sorted(set(data["length"])) == [600, 3000]
        for row in data:
            assert row["length"] - 40 <= len(row["context"]) <= row["length"] and row["answer"]
        assert [r["context"] for r in getattr(long_tasks, fn)(n=2, lengths=[600, 3000])["test"]] == data["context"]
