"""lm-evaluation-harness tasks on a CPLM checkpoint (optional: pip install lm-eval).

    python tools/lm_eval_cplm.py --checkpoint runs/quickstart-... --tasks lambada_openai --limit 20
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/lm_eval_cplm.py --checkpoint runs/tp2-run --tasks hellaswag --limit 10

The harness downloads its task data from the Hugging Face hub (or reads HF_DATASETS_CACHE);
scores come from the model's full mixed distribution (cplm_dist/evaluation/lm_eval_adapter.py).
"""

from __future__ import annotations

import argparse
import json
import sys

from cplm_dist.cli import exit_on_usage_error
from cplm_dist.errors import UsageError


@exit_on_usage_error
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tasks", nargs="+", required=True)
    p.add_argument("--limit", type=float, help="examples per task (or a fraction)")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--output", help="write the harness's results JSON here")
    args = p.parse_args(argv)
    try:
        import lm_eval
    except ImportError:
        raise UsageError("lm-eval is not installed: pip install lm-eval (an optional extra)") from None
    from cplm_dist.evaluation.lm_eval_adapter import register

    register()
    results = lm_eval.simple_evaluate(model="cplm", model_args=f"checkpoint={args.checkpoint}", tasks=args.tasks,
                                      limit=args.limit, num_fewshot=args.num_fewshot)
    if results is not None:  # rank 0
        print(json.dumps(results["results"], indent=2, default=str))
        if args.output:
            with open(args.output, "w") as f:
                json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
