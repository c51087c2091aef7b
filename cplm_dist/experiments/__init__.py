"""Many runs from one driver: the copy variants compared, one subprocess a run (runs.py), scaling
ladders and their fits (scaling.py)."""

# what cplm_dist.experiments held when it was one module (runs.py now)
_RUNS = ("VARIANTS", "COPY_TASKS", "run", "finished", "mean_score", "ensure_quickstart_data")


def __getattr__(name: str):
    if name in _RUNS:
        from cplm_dist.experiments import runs

        return getattr(runs, name)
    raise AttributeError(f"module 'cplm_dist.experiments' has no attribute {name!r}")
