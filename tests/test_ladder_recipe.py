"""Ladder recipes (cplm_dist/experiments/ladder_recipe.py): a ladder from 135M to 1.7B on the
135M run config gets each point's learning rate, micro-batch, global batch and Slurm job size from
the rules or the ladder file's table (the command line winning over both), in its training
arguments and its submit.sh options; under --slurm each trained point is evaluated in a job of its
own, whose sbatch keeps the ladder's queue options and sets its own size. Planning only: nothing
trains or is queued."""

import math
import shlex
from pathlib import Path

import pytest

from cplm_dist.config import load_config
from cplm_dist.experiments.ladder import Ladder, plan_ladder
from cplm_dist.experiments.ladder_recipe import DEEPSEEK_BATCH, Job, Recipe

BASE = "configs/runs/cplm-135m.yaml"
TARGETS = [1.35e8, 4e8, 1.7e9]
JOB = Job(max_nodes=4, gpus_per_node=8, slurm=True)  # the user of issue 58: 4 nodes x 8 H100


def _plan(tmp_path, recipe=None, overrides=()):
    ladder = Ladder(BASE, TARGETS, ["off"], overrides=list(overrides), out=tmp_path, recipe=recipe or Recipe(), job=JOB)
    return {p["target"]: p for p in plan_ladder(ladder)}


def _arg(point, key):
    return next(a.split("=", 1)[1] for a in reversed(point["train_args"]) if a.startswith(f"{key}="))


def test_each_point_gets_its_recipe_from_the_rules(tmp_path):
    base = load_config(BASE)
    points = _plan(tmp_path)
    small, large = points[1.35e8], points[1.7e9]
    for p in points.values():
        r = p["recipe"]
        # lr: the base's along the width (muP's 1/width), min_lr at the base's ratio
        assert r["lr"] == pytest.approx(base.optim.lr * base.model.hidden_size / p["hidden"])
        assert r["min_lr"] == pytest.approx(r["lr"] * base.optim.min_lr / base.optim.lr)
        dp = r["gpus"] // base.parallel.tp
        assert r["global_batch"] % (r["micro_batch"] * dp) == 0 and 1 <= r["nodes"] <= 4 and r["gpus"] <= 32
        # the batch: DeepSeek's tokens a step at the point's compute, rounded up to whole micro-batches over dp
        want = DEEPSEEK_BATCH[0] * p["flops"] ** DEEPSEEK_BATCH[1] / base.data.seq_length
        assert want - 1 <= r["global_batch"] < want + 1 + r["micro_batch"] * dp
        assert float(_arg(p, "optim.lr")) == pytest.approx(r["lr"], rel=1e-6)
        assert int(_arg(p, "train.global_batch_size")) == r["global_batch"]
        assert int(_arg(p, "train.micro_batch_size")) == r["micro_batch"]
        assert p["tokens"] == p["steps"] * r["global_batch"] * base.data.seq_length
        assert p["submit_options"][p["submit_options"].index("--nodes") + 1] == str(r["nodes"])
        assert r["source"] == "rules: lr width, batch deepseek, micro memory"
    assert large["recipe"]["lr"] < small["recipe"]["lr"] < base.optim.lr * 1.5  # not 3e-3 at 1.7B
    assert large["recipe"]["micro_batch"] < small["recipe"]["micro_batch"] <= base.train.micro_batch_size
    assert large["recipe"]["global_batch"] > small["recipe"]["global_batch"]
    assert large["recipe"]["gpus"] > small["recipe"]["gpus"]  # more compute, a larger job within 24 h


def test_the_ladder_files_table_and_the_command_line_win(tmp_path):
    (tmp_path / "ladder.yaml").write_text("rules: {lr: deepseek, hours: 1}\n"
                                          "table:\n  - {params: 1.7e9, lr: 4.0e-4, global_batch: 512, micro_batch: 2, nodes: 2}\n")
    recipe = Recipe.from_file(tmp_path / "ladder.yaml")
    points = _plan(tmp_path, recipe)
    large, small = points[1.7e9]["recipe"], points[1.35e8]["recipe"]
    assert (large["lr"], large["global_batch"], large["micro_batch"], large["nodes"], large["gpus"]) == (4e-4, 512, 2, 2, 16)
    assert large["source"].startswith("table row params=1.7e+09, else rules: lr deepseek")
    # no row: the rule, at the budget's compute (the plan's tokens round up to whole steps)
    assert small["lr"] == pytest.approx(0.3118 * points[1.35e8]["flops"] ** -0.125, rel=1e-3)
    assert small["gpus"] > _plan(tmp_path / "24h")[1.35e8]["recipe"]["gpus"]  # 1 hour, not 24: more GPUs
    given = _plan(tmp_path / "given", recipe, ["optim.lr=1.0e-3", "train.micro_batch_size=1"])
    for p in given.values():
        assert (p["recipe"]["lr"], p["recipe"]["micro_batch"]) == (1e-3, 1) and float(_arg(p, "optim.lr")) == 1e-3


@pytest.mark.parametrize("text, message", [
    ("rules: {lr: sqrt}", "rules.lr='sqrt': choose one of ['width', 'deepseek', 'base']"),
    ("rules: {mfu: 0}", "rules.mfu=0: give a positive number"),
    ("table: [{lr: 1.0e-3}]", "table is a list of rows, each with params"),
    ("steps: 3", "give a mapping with `rules:` and/or `table:`"),
])
def test_a_bad_ladder_file_is_one_line(tmp_path, capsys, text, message):
    from cplm_dist_tools.scaling import main

    (tmp_path / "ladder.yaml").write_text(text)
    assert main(["--base-config", "tiny", "--sizes", "2e5", "--out", str(tmp_path / "out"), "--suite", "none",
                 "--ladder-file", str(tmp_path / "ladder.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --ladder-file {tmp_path / 'ladder.yaml'}: ") and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_slurm_points_are_sized_by_their_recipe_and_evaluated_in_jobs_of_their_own(tmp_path, capsys):
    from cplm_dist.experiments.slurm import evaluate_in_jobs, submit_command
    from cplm_dist_tools.scaling import job_of, world_of

    options = shlex.split("--nodes 4 --gpus-per-node 8 --time 12:00:00 --partition gpu --account lab --max-requeues 2 "
                          "--dry-run")
    assert job_of(shlex.join(options)) == JOB and world_of("torchrun --nproc-per-node 8 --nnodes=2") == 16
    cpu = job_of("--nodes 2 --tasks-per-node 2 --gpus-per-node 0 --time 00:10:00")  # 4 data-parallel CPU ranks
    cpu_plan = plan_ladder(Ladder(BASE, [1.35e8], ["off"], out=tmp_path / "cpu", job=cpu))[0]
    assert cpu_plan["recipe"]["global_batch"] % (4 * cpu_plan["recipe"]["micro_batch"]) == 0 and not cpu_plan["submit_options"]
    points = _plan(tmp_path)
    large = points[1.7e9]
    cmd = submit_command(large, options, tmp_path / "slurm")
    nodes = len(cmd) - 1 - cmd[::-1].index("--nodes")  # the point's --nodes comes after the ladder's: it wins
    assert cmd[nodes + 1] == str(large["recipe"]["nodes"]) and nodes > cmd.index("--nodes")
    assert cmd[cmd.index("--") + 1:][-2:] == ["--resume", "auto"]
    evaluate = ["/venv/bin/python", "-m", "cplm_dist_tools.evaluate"]
    assert evaluate_in_jobs(list(points.values()), evaluate, ["induction"], 8, options, tmp_path, tmp_path / "log") is False
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("dry run: the evaluation of ")]
    assert len(lines) == 3
    job = shlex.split(lines[-1].split(" would be submitted as: ")[1])
    assert job[0] == "sbatch" and job[job.index("--nodes") + 1] == "1" and job[job.index("--gpus-per-node") + 1] == "1"
    for kept in ("--time", "--partition", "--account"):
        assert kept in job
    for dropped in ("--max-requeues", "--dry-run", "--tasks-per-node"):
        assert dropped not in job
    assert job.count("--nodes") == 1 and job[job.index("--job-name") + 1] == f"scaling-eval-{large['point']}"
    wrapped = shlex.split(job[job.index("--wrap") + 1])
    assert wrapped[1:] == [*evaluate, "--checkpoint", large["run_dir"], "--tasks", "induction", "--samples", "8",
                           "--valid-batches", "0", "--out", str(Path(large["run_dir"]) / "eval")]
    assert evaluate_in_jobs(list(points.values()), evaluate, ["none"], 8, options, tmp_path, tmp_path / "log") is True
    assert math.isfinite(large["flops"])
