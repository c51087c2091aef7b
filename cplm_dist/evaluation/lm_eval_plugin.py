"""Makes the stock `lm_eval` command know `--model cplm`, with nothing imported until lm-eval is.

lm-eval 0.4 finds models only in its own registry, filled when `lm_eval.models` is imported. The
file `cplm_dist-lm_eval.pth`, which installing cplm_dist puts in site-packages (setup.py), calls
`install()` at interpreter start: a finder that waits for `lm_eval.models` and, once that module
has run, registers "cplm" as a lazy entry (cplm_dist/evaluation/harness_model.py is imported only
when a run asks for the model). This module imports nothing beyond the standard library.
Set CPLM_NO_LM_EVAL_PLUGIN=1 to turn it off.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

TARGET = "lm_eval.models"
MODEL = ("cplm", "cplm_dist.evaluation.harness_model:CPLMHarnessModel")


def register_lazy() -> None:
    from lm_eval.api.registry import model_registry

    if MODEL[0] not in model_registry:
        model_registry.register(MODEL[0], target=MODEL[1])


class _AfterExec(importlib.abc.Loader):
    """Runs the real loader, then registers the model."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def __getattr__(self, name):  # the rest of the real loader's interface (resources, source, ...)
        return getattr(self.loader, name)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            register_lazy()
        except Exception as e:  # never break lm-eval itself
            print(f"warning: cplm_dist could not register the lm-eval model 'cplm': {e}", file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once; and so that the lookup below finds the real module
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterExec(spec.loader)
        return spec


def install() -> None:
    if os.environ.get("CPLM_NO_LM_EVAL_PLUGIN"):
        return
    if TARGET in sys.modules:  # lm-eval already loaded its models: register now
        register_lazy()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
