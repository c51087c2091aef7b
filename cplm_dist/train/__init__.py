"""The training driver: `cplm-train`, `python -m cplm_dist.train` (what it runs is cplm_dist.training):

    driver.py       config -> checks -> groups -> model -> engine -> data -> resume -> loop -> summary
    preflight.py    what a job submission checks before it queues (`python -m cplm_dist.train.preflight`)
    diagnostics.py  every train.diagnostics_interval steps, the copy head's gradient path (a metrics record)

`main` and `train_parser` load the driver on first use: `cplm_dist.train.preflight` imports without it.
"""

__all__ = ["main", "train_parser"]


def __getattr__(name: str):
    if name in __all__:
        from cplm_dist.train import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'cplm_dist.train' has no attribute {name!r}")
