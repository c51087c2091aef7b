"""Many runs from one driver: one subprocess a run and the copy variants (runs.py), the copy-head
ablation and its paired statistics (ablation.py), scaling ladders (ladder.py: points planned,
trained, evaluated, collected; slurm.py: each point a Slurm job; ladder_report.py: fits, gains,
report) and their shapes and power-law fits (scaling.py). tools/ablate.py and tools/scaling.py
are their command lines."""

# what cplm_dist.experiments held when it was one module (runs.py now)
_RUNS = ("VARIANTS", "COPY_TASKS", "run", "finished", "mean_score", "ensure_quickstart_data")


def __getattr__(name: str):
    if name in _RUNS:
        from cplm_dist.experiments import runs

        return getattr(runs, name)
    raise AttributeError(f"module 'cplm_dist.experiments' has no attribute {name!r}")
