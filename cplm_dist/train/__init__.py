"""Training: the driver (`cplm-train`, `python -m cplm_dist.train`) and what it runs, in the order
it uses them:

    driver.py      config -> checks -> groups -> model -> engine -> data -> resume -> loop -> summary
    engine.py      the DeepSpeed engine from the typed config, the mpu adapter
    optim.py       AdamW groups, the schedules, the non-finite guard
    step.py        the one optimizer step (training runs it, the profiler measures it)
    validation.py  the validation loss (pipeline or not)
    run_log.py     console, metrics.jsonl, TensorBoard; wandb_log.py Weights & Biases
    throughput.py  FLOPs per token, MFU, peak memory
    preflight.py   what a job submission checks before it queues

`main` and `train_parser` load the driver on first use: the pieces below it import without it.
"""

__all__ = ["main", "train_parser"]


def __getattr__(name: str):
    if name in __all__:
        from cplm_dist.train import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'cplm_dist.train' has no attribute {name!r}")
