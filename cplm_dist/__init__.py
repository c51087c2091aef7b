"""cplm_dist: pretraining Copy-Paste Language Models with megatron-core TP and DeepSpeed ZeRO.

The packages, in the order a run's data flows through them; each imports only from those above it
(tests/test_layout.py holds the order):

    errors, files, megatron_compat   what everything uses: one-line usage errors, atomic files, the one megatron import
    config/        the typed config tree, YAML + overrides, validation, the command line
    distributed/   launch variables, joining hosts, the TP x CP x DP x PP groups, heartbeats
    model/         the CPLM: backbones, layers, the copy head, the mixes, the loss; parallel/ its parallel pieces
    data/          tokenizers, sources, indexed datasets, megatron's blending, the resumable loader
    train/         the step, the DeepSpeed engine, the optimizer, validation, logging; the driver on top
    checkpoint/    the format: save, resume, reshape, load for evaluation
    interop/       model.init_from and transformers (hf/)
    evaluation/, profiling/, experiments/   what reads trained models, measures steps, drives many runs

Module paths of the layout before 2026-12 (cplm_dist.distributed, cplm_dist.model.loss,
cplm_dist.hf_llama, ...) still import: `MOVED` maps each to the module that holds it now.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

MOVED = {  # old module path -> the module that holds it now (a package's submodules follow it)
    "cplm_dist.model.sequence_parallel": "cplm_dist.model.parallel.sequence",
    "cplm_dist.model.context_parallel": "cplm_dist.model.parallel.context",
    "cplm_dist.model.pipeline": "cplm_dist.training.pipeline",
    "cplm_dist.model.stages": "cplm_dist.model.parallel.stages",
    "cplm_dist.model.sharding": "cplm_dist.model.parallel.sharding",
    "cplm_dist.model.parallelize": "cplm_dist.model.recompute_compile",
    "cplm_dist.model.backbone": "cplm_dist.config.backbones",
    "cplm_dist.profiling.throughput": "cplm_dist.training.throughput",
    "cplm_dist.checkpoint.init_from": "cplm_dist.interop.init_from",
    "cplm_dist.cli": "cplm_dist.config.cli",
    "cplm_dist.launch_env": "cplm_dist.distributed.launch_env",
    "cplm_dist.hosts": "cplm_dist.distributed.hosts",
    "cplm_dist.heartbeat": "cplm_dist.distributed.heartbeat",
    "cplm_dist.parallel": "cplm_dist.distributed",
    "cplm_dist.mixes": "cplm_dist.model.mixes",
    "cplm_dist.vocab_parallel": "cplm_dist.model.loss",
    "cplm_dist.train_step": "cplm_dist.training.step",
    "cplm_dist.engine": "cplm_dist.training.engine",
    "cplm_dist.optim": "cplm_dist.training.optim",
    "cplm_dist.run_log": "cplm_dist.training.run_log",
    "cplm_dist.wandb_log": "cplm_dist.training.wandb_log",
    "cplm_dist.preflight": "cplm_dist.train.preflight",
    "cplm_dist.hf_llama": "cplm_dist.config.backbones.llama",  # the Llama map (its adapter); directories: interop.hf.directory
    "cplm_dist.hf_gpt2": "cplm_dist.config.backbones.gpt2",
    "cplm_dist.hf_remote": "cplm_dist.interop.hf.remote",
    "cplm_dist.scaling": "cplm_dist.experiments.scaling",
}


MOVED_NAMES = {  # names a package exported before 2026-12 that another module holds now -> that module
    "cplm_dist.checkpoint": dict.fromkeys(("InitSource", "init_source", "initialise_from", "load_checkpoint_weights"),
                                          "cplm_dist.interop.init_from"),
}


def moved_attribute(package: str, name: str):
    """`package.name` for a name in MOVED_NAMES (a package's `__getattr__` asks here)."""
    target = MOVED_NAMES.get(package, {}).get(name)
    if target is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(target), name)


def moved_to(name: str) -> str | None:
    """The module path `name` (an old one, or a submodule of an old package) has now, else None."""
    head = name
    while head:
        if head in MOVED:
            return MOVED[head] + name[len(head):]
        head = head.rpartition(".")[0]
    return None


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module itself (one module object under both names), and
    runs it as `python -m OLD`."""

    def find_spec(self, name, path=None, target=None):
        new = moved_to(name) if name not in MOVED.values() else None
        if new is None or new == name:
            return None
        real = importlib.util.find_spec(new)
        if real is None:
            return None
        spec = importlib.util.spec_from_loader(name, self, origin=real.origin, is_package=real.submodule_search_locations is not None)
        spec.loader_state = real
        return spec

    def create_module(self, spec):
        return importlib.import_module(spec.loader_state.name)

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # the import gave it the old name's spec: it keeps its own

    def get_code(self, name):
        real = importlib.util.find_spec(moved_to(name))
        return real.loader.get_code(real.name)


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
