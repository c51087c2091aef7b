"""lm-evaluation-harness tasks on a CPLM checkpoint (optional: pip install -e ".[lm-eval]").

    python tools/lm_eval_cplm.py --checkpoint runs/quickstart-... --tasks cplm_local --batch-size 16
    python tools/lm_eval_cplm.py --checkpoint runs/x --tasks hellaswag --limit 100 --log-samples --output-path results/
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/lm_eval_cplm.py --checkpoint runs/x --tasks cplm_local

This is lm-eval's own `run` command with the model set to the checkpoint (the same as
`lm_eval run --model cplm --model_args checkpoint=... --include_path <cplm tasks>`), plus checks made
before the model loads: the checkpoint, the task names, the flags. The shipped local tasks
(`cplm_local`: copy and retrieval multiple choice, phone-book generation, corpus perplexity) are
always on the include path. Under torchrun the documents are split over data-parallel replicas
(docs/evaluation.md). Hub tasks need their datasets: on an offline cluster, pre-fill
HF_DATASETS_CACHE and set HF_DATASETS_OFFLINE=1 (docs/evaluation.md).
"""

from __future__ import annotations

import argparse
import sys

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a run directory, its checkpoints/, or a step-* directory")
    p.add_argument("--tasks", nargs="+", required=True, help="task or group names (spaces or commas), or task YAML files")
    p.add_argument("--include-path", "--include_path", action="append", default=[], metavar="DIR",
                   help="more task YAMLs (repeatable); the shipped cplm tasks are always included")
    p.add_argument("--batch-size", "--batch_size", default="16",
                   help="rows in one forward: an integer or 'auto' (16); scores do not depend on it")
    p.add_argument("--limit", type=float, help="examples per task (or a fraction); for testing only")
    p.add_argument("--num-fewshot", "--num_fewshot", type=int)
    p.add_argument("--output-path", "--output_path", "--output", dest="output_path",
                   help="write the results JSON (and with --log-samples each task's samples) under this path")
    p.add_argument("--log-samples", "--log_samples", action="store_true", help="keep every request and answer")
    p.add_argument("--model-args", "--model_args", default="",
                   help="more model arguments, e.g. tp=2,dtype=bfloat16,max_length=1024 (docs/evaluation.md)")
    p.add_argument("--device", default=None, help="cpu to stay on the CPU; default: this rank's GPU, else the CPU")
    p.add_argument("--seed", default=None, help="lm-eval's --seed (e.g. 0 or 0,1234,1234,1234)")
    return p


def unknown_tasks(names: list[str], include_paths: list[str]) -> list[str]:
    """The names (not YAML files) that no task, group or tag matches: first among the include
    paths alone (fast), then among lm-eval's own thousands (an index of ~10 s)."""
    from lm_eval.tasks import TaskManager

    missing = [n for n in names if not n.endswith(".yaml")]
    for defaults in (False, True):
        if missing:
            manager = TaskManager(include_path=include_paths, include_defaults=defaults)
            missing = [n for n in missing if not manager.match_tasks([n])]
    return missing


def check_limit_covers_replicas(args, saved_tp: int) -> None:
    """An integer --limit below the launch's dp size leaves a replica without documents, which
    then skips lm-eval's collectives and the run hangs: refused with one line before it starts."""
    from lm_eval.utils import simple_parse_args_string

    from cplm_dist.distributed import evaluation_tp
    from cplm_dist.distributed.launch_env import LaunchEnv

    if args.limit is None or args.limit < 1:
        return  # none, or a fraction of each task
    world = LaunchEnv.from_environ(mpi_rendezvous=False).world_size
    asked = simple_parse_args_string(args.model_args or "").get("tp")  # as the harness model will read it
    try:
        tp = evaluation_tp(saved_tp, None if asked is None else int(asked), world)
    except ValueError as e:
        raise UsageError(f"--model-args tp: {e}") from None
    if args.limit < world // tp:
        raise UsageError(f"--limit {args.limit:g} is below the {world // tp} data-parallel replicas of this launch: a "
                         "replica without documents stops lm-eval's collectives and the run hangs; use --limit >= "
                         f"{world // tp} or fewer ranks")


def lm_eval_argv(args, names: list[str]) -> list[str]:
    model_args = ",".join(a for a in (f"pretrained={args.checkpoint}", args.model_args) if a)  # names the output folder
    argv = ["lm_eval", "run", "--model", "cplm", "--model_args", model_args, "--tasks", ",".join(names),
            "--batch_size", str(args.batch_size)]
    for flag, value in (("--limit", args.limit), ("--num_fewshot", args.num_fewshot), ("--output_path", args.output_path),
                        ("--device", args.device or "cuda"), ("--seed", args.seed)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--log_samples"] if args.log_samples else [])


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UsageError('lm-eval is not installed: pip install -e ".[lm-eval]" (an optional extra)') from None
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from cplm_dist.checkpoint import load_checkpoint_config
    from cplm_dist.evaluation.harness_model import parse_batch_size, register
    from cplm_dist.evaluation.harness_tasks import TASKS_DIR

    try:
        parse_batch_size(args.batch_size)
    except ValueError as e:
        raise UsageError(f"--batch-size: {e}") from None
    if args.log_samples and not args.output_path:
        raise UsageError("--log-samples needs --output-path (where the samples are written)")
    if args.limit is not None and args.limit <= 0:
        raise UsageError(f"--limit {args.limit}: need a positive count or fraction")
    _, info = load_checkpoint_config(args.checkpoint)  # a bad checkpoint: one line, before anything loads
    check_limit_covers_replicas(args, info["layout"]["tp"])
    names = [n for t in args.tasks for n in t.split(",") if n]
    include_paths = [str(TASKS_DIR)] + args.include_path
    missing = unknown_tasks(names, include_paths)
    if missing:
        raise UsageError(f"unknown task(s) {', '.join(missing)}: list the known ones with `lm_eval ls tasks` (add "
                         f"--include_path DIR for a directory of task YAMLs; cplm's own: {TASKS_DIR}), or pass "
                         "their directory with --include-path")
    register()  # also when the .pth hook is not installed (a source checkout on PYTHONPATH)
    sys.argv = lm_eval_argv(args, names)
    setup_logging()
    cli = HarnessCLI()
    run_args = cli.parse_args()
    run_args.include_path = include_paths  # its TaskManager takes several; its flag, one
    cli.execute(run_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
