"""Requests/s of the lm-eval adapter on the shipped local tasks, at several batch sizes, and how far
each batch size's answers are from batch 1's (docs/evaluation.md records the figures).

    OMP_NUM_THREADS=2 python tools/bench_lm_eval.py --checkpoint runs/quickstart-... --batch-sizes 1 16

Requests are built as lm-eval builds them for the tasks in cplm_dist/evaluation/harness_tasks (zero
shot): 4 loglikelihood requests a multiple-choice question, one rolling request a document, one
generate_until a phone book. `--adapter module:Class` times another adapter with the same interface.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time
from types import SimpleNamespace

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError


def requests(docs: int) -> dict[str, list]:
    from cplm_dist.evaluation.harness_tasks import local_datasets

    req = lambda *a: SimpleNamespace(args=a)  # noqa: E731
    mc = [req(d["context"], " " + c) for task in (local_datasets.kv_retrieval, local_datasets.list_copy)
          for d in task(n=docs)["test"] for c in d["choices"]]
    rolling = [req(d["text"]) for d in local_datasets.corpus(n=max(2, docs // 5))["test"]]
    gen = [req(d["context"], {"until": ["\n", "."], "max_gen_toks": 12}) for d in local_datasets.phonebook(n=max(1, docs // 2))["test"]]
    return {"loglikelihood": mc, "loglikelihood_rolling": rolling, "generate_until": gen}


def _scores(kind: str, answers: list) -> list[float]:
    return [a[0] for a in answers] if kind == "loglikelihood" else list(answers) if kind == "loglikelihood_rolling" else []


@exit_on_usage_error
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--docs", type=int, default=50, help="questions per multiple-choice task")
    p.add_argument("--adapter", default="cplm_dist.evaluation.lm_eval_adapter:HarnessAdapter")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.docs < 1:
        raise UsageError("--batch-sizes and --docs must be >= 1")
    module, _, name = args.adapter.partition(":")
    try:
        adapter_cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"--adapter {args.adapter}: {e}") from None

    import torch

    from cplm_dist.checkpoint import load_checkpoint_config, load_model
    from cplm_dist.data.gpt_data import tokenizer_for
    from cplm_dist.distributed import destroy_distributed, init_distributed

    load_checkpoint_config(args.checkpoint)
    init_distributed(1)
    model, cfg, _ = load_model(args.checkpoint)
    tok = tokenizer_for(cfg)
    work = requests(args.docs)
    takes_batch = "batch_size" in inspect.signature(adapter_cls).parameters
    rows, reference = [], {}
    for size in args.batch_sizes:
        adapter = adapter_cls(model, tok, **({"batch_size": size} if takes_batch else {}))
        for kind, reqs in work.items():
            with torch.inference_mode():
                start = time.perf_counter()
                answers = getattr(adapter, kind)(reqs)
                seconds = time.perf_counter() - start
            scores = _scores(kind, answers)
            reference.setdefault(kind, scores)
            diff = max((abs(a - b) for a, b in zip(scores, reference[kind])), default=0.0)
            rows.append({"batch_size": size if takes_batch else 1, "kind": kind, "requests": len(reqs),
                         "seconds": round(seconds, 3), "requests_per_s": round(len(reqs) / seconds, 1),
                         "max_abs_diff_vs_first": diff})
            print(f"batch {rows[-1]['batch_size']:>3}  {kind:<22} {len(reqs):>4} requests  {seconds:7.2f} s  "
                  f"{len(reqs) / seconds:8.1f} req/s  max |score - first batch size's| {diff:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
