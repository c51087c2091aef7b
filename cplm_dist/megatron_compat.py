"""The one import of megatron-core (and of DeepSpeed, `import_deepspeed`), without their
import-time noise.

megatron-core warns on import that Transformer Engine and Apex are absent (they are optional for
us: our block uses torch SDPA and torch optimizers), once per process and per rank. Everything in
cplm_dist takes megatron from here so that the warning filter is in place first.

Sequence parallelism on a machine without CUDA: megatron-core's sequence-parallel linears and
mappings allocate their all-gather / reduce-scatter buffers with
`device=torch.cuda.current_device()`, which a CPU-only torch cannot answer. Where CUDA is absent,
those three modules (tensor_parallel.layers, tensor_parallel.mappings, core.utils) see a torch
whose `cuda.current_device()` is the CPU, so the same megatron code runs on gloo (the tests).
With CUDA nothing is changed.

Versions: DeepSpeed and megatron-core are used down to their internals (DeepSpeed 0.19's ZeRO and
pipeline code: cplm_dist/training/zero_partitions.py, engine.py; megatron-core's parallel state,
tp layers and datasets as of 0.14-0.16), so `SUPPORTED` holds the ranges this code accepts, the
same that pyproject.toml states (tests/test_packaging.py keeps them equal). An installed version
outside them is refused here, before either is imported: one line on stderr, exit 2
(`CPLM_ALLOW_UNTESTED_VERSIONS=1` makes it a one-line warning, to try a newer release).
"""

import contextlib
import functools
import logging
import os
import re
import sys
import types
import warnings
from importlib import metadata

# distribution -> (lowest accepted, first refused): pyproject.toml says `name>=low,<high`
SUPPORTED = {"deepspeed": ("0.19", "0.20"), "megatron-core": ("0.14", "0.17")}
ALLOW_UNTESTED = "CPLM_ALLOW_UNTESTED_VERSIONS"


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: '0.19.8' -> (0, 19, 8); '0.16.0rc1+local' -> (0, 16, 0)."""
    found = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(p) for p in found.group().split(".")) if found else ()


def version_problem(name: str, installed: str) -> str | None:
    """What is wrong with `installed` of `name` (outside SUPPORTED), in words, or None."""
    low, high = SUPPORTED[name]
    if _release(low) <= _release(installed) < _release(high):
        return None
    return f"{name} {installed} is installed, but cplm_dist accepts {name}>={low},<{high}"


def check_versions(installed: dict[str, str] | None = None, environ=None) -> list[str]:
    """Refuse (one line on stderr, SystemExit 2) an installed DeepSpeed or megatron-core outside
    SUPPORTED; with CPLM_ALLOW_UNTESTED_VERSIONS=1 warn in one line instead. `installed`: name ->
    version (default: what importlib.metadata finds; a library it cannot find is left to its import
    to report). Returns the problems it let pass."""
    environ = os.environ if environ is None else environ
    if installed is None:
        installed = {}
        for name in SUPPORTED:
            try:
                installed[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                pass
    problems = {n: p for n, p in ((n, version_problem(n, v)) for n, v in installed.items()) if p}
    for name, problem in problems.items():
        low, high = SUPPORTED[name]
        if environ.get(ALLOW_UNTESTED) != "1":
            print(f"error: {problem}: pip install '{name}>={low},<{high}' (the tested versions: pip install -c "
                  f"tools/constraints-cluster.txt -e '.[cluster]', docs/cluster.md), or set {ALLOW_UNTESTED}=1 "
                  "to try this one", file=sys.stderr)
            raise SystemExit(2)
        print(f"warning: {problem}; trying it anyway ({ALLOW_UNTESTED}=1)", file=sys.stderr)
    return list(problems.values())


check_versions()

import torch  # noqa: E402  (after the check: a refused install stops before megatron and torch load)


@contextlib.contextmanager
def _hidden(module: str):
    """`import <module>` fails inside (a None entry in sys.modules), unless it is imported already.
    megatron-core's `import megatron.core` tries `import wandb` for its inference contexts' own
    logging (HAVE_WANDB), which we never use: with wandb installed that cost every process that
    imports cplm_dist 0.6 s. Our own W&B logging (cplm_dist.training.wandb_log) imports it afterwards."""
    if module in sys.modules:
        yield
        return
    sys.modules[module] = None
    try:
        yield
    finally:
        if sys.modules.get(module, ...) is None:
            del sys.modules[module]


@contextlib.contextmanager
def _compile_on_first_call():
    """`torch.compile(fn)` returns a function that compiles `fn` when it is first called.
    megatron-core compiles its fused kernels (`megatron.core.jit.jit_fuser`, e.g. the bias-GeGLU
    fusions) as it is imported, which imports torch's dynamo and inductor: 2.5 s in every process,
    for kernels our layers never call. Whatever calls one still gets it compiled."""
    real = torch.compile

    def lazy(model=None, **options):
        if model is None:  # @torch.compile(mode=...)
            return lambda fn: lazy(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = lazy
    try:
        yield
    finally:
        torch.compile = real


with warnings.catch_warnings(), _hidden("wandb"), _compile_on_first_call():
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    # megatron's TransformerConfig (built for each sparse layer) warns of its own defaults
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    warnings.filterwarnings("ignore", message=".*MLP requires ffn_hidden_size.*")
    warnings.filterwarnings("ignore", message=".*tp_group is None, using default tp group.*")
    from megatron.core import ModelParallelConfig, parallel_state, tensor_parallel
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy



class _CudaOnCPU:
    """torch.cuda as megatron's allocation sites use it, answering the CPU as the current device."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return torch.device("cpu")


class _TorchOnCPU(types.ModuleType):
    """The torch module, but for `cuda` (read through to torch for everything else)."""

    cuda = _CudaOnCPU()

    def __getattr__(self, name):
        return getattr(torch, name)


def _allocate_on_cpu_without_cuda() -> None:
    if torch.cuda.is_available():
        return
    from megatron.core import utils as core_utils
    from megatron.core.tensor_parallel import layers, mappings

    shim = _TorchOnCPU("torch")
    for module in (layers, mappings, core_utils):
        module.torch = shim


_allocate_on_cpu_without_cuda()
# megatron-core calls torch's reduce_scatter_tensor, which torch 2.13 deprecates once per call site
warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor. is deprecated.*", category=FutureWarning)

class _NoStream:
    """A CUDA stream (or event) where there is none: every wait and sync is already done."""

    def wait_stream(self, _other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, _event=None) -> "_NoStream":
        return self

    def __eq__(self, other) -> bool:
        return isinstance(other, _NoStream)

    def __hash__(self) -> int:
        return 0


MOE_MENDED = (0, 16)  # the megatron-core release whose MoE path the mends below were written against


@functools.cache
def moe_modules() -> types.SimpleNamespace:
    """megatron-core's MoE layer (MoELayer, TopKRouter, its dispatchers, SequentialMLP, the shared
    expert), mended to run on a CPU-only torch and on gloo. Imported on first use (a dense model
    never loads it). Each mend, and why (megatron-core 0.16.1):

    - streams: the all-to-all dispatcher makes a side stream for its device-to-host copies and the
      shared expert one to overlap; the router and experts allocate on `torch.cuda.current_device()`.
      Without CUDA their modules see a torch whose cuda answers the CPU and no-op streams.
    - `te_general_gemm`: the router's fp32 gating names it, bound only when Transformer Engine
      imports; without TE it is None, as megatron's own check expects.
    - split sizes: the dispatcher hands its all-to-all numpy split sizes, which NCCL's binding
      accepts and gloo's refuses; they are passed as lists of ints.
    - the jit fuser is made lazy for all of megatron at import (`_compile_on_first_call`).
    - the aux-loss tracker allocates with device="cuda": the router's tracker calls go to ours
      instead (cplm_dist.model.moe_stats, which our logs read; cplm_dist.model.moe points
      `router_module.save_to_aux_losses_tracker` there, the model package being above this one).
    - uneven all-gathers: at expert_tp > 1 the all-to-all dispatcher gathers each tp rank's routed
      tokens, a different count per rank, with torch's list all_gather, which gloo refuses for
      unequal sizes; on gloo they are padded to the largest and cut back (`_gather_uneven`).
    With CUDA only the aux-loss tracker and the split sizes apply (and the gather on gloo). A
    megatron-core other than MOE_MENDED is refused for MoE
    with one line (the dense model is unaffected)."""
    from cplm_dist.errors import ConfigError

    installed = metadata.version("megatron-core")
    if _release(installed)[:2] != MOE_MENDED and os.environ.get(ALLOW_UNTESTED) != "1":
        raise ConfigError(f"model.moe runs on megatron-core {'.'.join(map(str, MOE_MENDED))}.x (this is {installed}): "
                          f"pip install 'megatron-core=={'.'.join(map(str, MOE_MENDED))}.1', or set {ALLOW_UNTESTED}=1 to try")
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import experts, moe_layer, moe_utils, router, shared_experts, token_dispatcher
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not torch.cuda.is_available():
        _CudaOnCPU.Stream = _CudaOnCPU.Event = staticmethod(lambda *a, **k: _NoStream())
        _CudaOnCPU.current_stream = staticmethod(lambda *a, **k: _NoStream())
        _CudaOnCPU.stream = staticmethod(lambda _s=None: contextlib.nullcontext())
        shim = _TorchOnCPU("torch")
        for module in (experts, moe_layer, moe_utils, router, shared_experts, token_dispatcher):
            module.torch = shim
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def listed(sizes):
        return None if sizes is None else [int(s) for s in sizes]

    def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
        return mappings.all_to_all(group, input_, listed(output_split_sizes_), listed(input_split_sizes))

    token_dispatcher.all_to_all = all_to_all
    if not getattr(mappings._gather_along_first_dim, "_cplm_uneven", False):
        mappings._gather_along_first_dim = _gather_uneven(mappings._gather_along_first_dim)
    return types.SimpleNamespace(TransformerConfig=TransformerConfig, MoELayer=moe_layer.MoELayer,
                                 TopKRouter=router.TopKRouter, router_module=router, moe_utils=moe_utils,
                                 get_moe_module_spec=get_moe_module_spec, build_module=build_module)


def _gather_uneven(gather):
    """megatron's _gather_along_first_dim, whose uneven form (`output_split_sizes`) gloo refuses:
    there each rank's rows are padded to the largest count, gathered, and cut back to their sizes."""

    def gathered(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or torch.distributed.get_backend(group) != "gloo":
            return gather(input_, group, output_split_sizes, use_global_buffer)
        largest = max(output_split_sizes)
        padded = input_.new_zeros((largest, *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, output_split_sizes)])

    gathered._cplm_uneven = True
    return gathered


def collective_holders() -> list:
    """Objects that keep references of their own to torch.distributed's collectives, bound once:
    megatron-core's tensor-parallel modules (`dist_all_gather_func`, `dist_reduce_scatter_func`,
    its sequence-parallel collectives), torch's distributed_c10d (which DeepSpeed calls directly)
    and DeepSpeed's communication backend once it exists (`all_gather_function`,
    `reduce_scatter_function`: ZeRO's parameter gathers and gradient reduce-scatters). A profiler
    that patches only torch.distributed misses every call made through these."""
    import sys

    from megatron.core.tensor_parallel import layers, mappings

    holders = [torch.distributed.distributed_c10d, layers, mappings]
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and getattr(ds_comm, "cdb", None) is not None:
        holders.append(ds_comm.cdb)
    return holders


__all__ = [
    "BlendedMegatronDatasetBuilder",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexedDatasetBuilder",
    "ModelParallelConfig",
    "VocabParallelCrossEntropy",
    "convert_split_vector_to_split_matrix",
    "parallel_state",
    "tensor_parallel",
]


def import_deepspeed():
    """deepspeed, told which accelerator it runs on: on a machine without CUDA it would guess the
    CPU one and print a warning to stdout (into a tool's output). Its loggers say warnings only."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return deepspeed
