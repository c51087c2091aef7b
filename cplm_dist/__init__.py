"""cplm_dist: pretraining Copy-Paste Language Models with megatron-core TP and DeepSpeed ZeRO.

The packages, in the order a run's data flows through them; each imports only from those above it
(tests/test_layout.py's PACKAGE_ORDER holds the order, a package each, nothing else):

    errors, files, plotting, megatron_compat   what every package may use: one-line usage errors, atomic files, PNG figures, the one megatron import
    config/        the typed config tree, YAML + overrides, validation, the command line, the data curriculum;
                   backbones/: each backbone's record of features beside its HF adapter
    distributed/   launch variables, joining hosts, the TP x CP x DP x PP groups, heartbeats
    data/          tokenizers, sources, indexed datasets, megatron's blending, the resumable loader (and IGNORE_INDEX)
    model/         the CPLM: layers, positions, the copy head, the mixes, the loss; parallel/ its parallel pieces
    training/      the optimizer step: the DeepSpeed engine and its mpu, the pipeline module, the one
                   reduction over dp x cp, the optimizer, validation loss, logging, throughput
    checkpoint/    the format: save, resume, reshape, load for evaluation
    interop/       model.init_from and transformers (hf/)
    evaluation/, profiling/, experiments/   what reads trained models, measures steps, drives many runs
    train/         the driver: `cplm-train`, `python -m cplm_dist.train`, `python -m cplm_dist.train.preflight`

Two module paths of the layout before 2026-12 still run, because launch scripts of that layout typed
them (`python -m cplm_dist.launch_env slurm-port`, `python -m cplm_dist.preflight`): `MOVED` maps
each to the module that holds it now.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

MOVED = {  # old module path -> the module that holds it now: only what launch scripts of that layout typed
    "cplm_dist.launch_env": "cplm_dist.distributed.launch_env",  # slurm*.sbatch: python -m cplm_dist.launch_env slurm-port
    "cplm_dist.preflight": "cplm_dist.train.preflight",  # submit.sh: python -m cplm_dist.preflight --world N ...
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module itself (one module object under both names), and
    runs it as `python -m OLD`."""

    def find_spec(self, name, path=None, target=None):
        real = importlib.util.find_spec(MOVED[name]) if name in MOVED else None
        if real is None:
            return None
        spec = importlib.util.spec_from_loader(name, self, origin=real.origin)
        spec.loader_state = real
        return spec

    def create_module(self, spec):
        return importlib.import_module(spec.loader_state.name)

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # the import gave it the old name's spec: it keeps its own

    def get_code(self, name):
        real = importlib.util.find_spec(MOVED[name])
        return real.loader.get_code(real.name)


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
