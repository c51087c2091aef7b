"""The one import of megatron-core (and of DeepSpeed, `import_deepspeed`), without their
import-time noise.

megatron-core warns on import that Transformer Engine and Apex are absent (they are optional for
us: our block uses torch SDPA and torch optimizers), once per process and per rank. Everything in
cplm_dist takes megatron from here so that the warning filter is in place first.
"""

import logging
import os
import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    from megatron.core import ModelParallelConfig, parallel_state, tensor_parallel
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

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
