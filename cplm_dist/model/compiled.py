"""Regional compilation (train.compile): torch.compile on each transformer layer, not the whole model.

Every layer runs the same code, so dynamo traces one graph and every layer reuses it (parameters
are graph inputs): compile time is one layer's, whatever the depth, and the fused norms, RoPE and
SwiGLU are what the layers gain. The embedding, LM head, loss and copy head stay eager (the loss
is a custom autograd Function over the vocabulary shards). Decoding with a KV cache always runs
the eager layers (the cache changes shape every token).

Where compilation cannot work (no C++ compiler for CPU code, no Triton for CUDA, dynamo not
supported on this Python), the run warns once and trains eager.
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

log = logging.getLogger(__name__)


def unavailable_reason(device: torch.device) -> str | None:
    """Why torch.compile cannot build kernels for `device` here, or None when it can."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed (pip install triton)"
    compiler = os.environ.get("CXX", "g++")
    return None if shutil.which(compiler) else f"no C++ compiler ({compiler}) for CPU kernels (apt install g++, or set CXX)"


def compile_layers(layers: torch.nn.ModuleList, device: torch.device) -> list | None:
    """Compiled callables for `layers` (a plain list, so the state dict keeps one copy of each
    parameter), or None with one warning where compilation is unavailable."""
    reason = unavailable_reason(device)
    if reason:
        log.warning("train.compile=true but %s: training runs the layers eager", reason)
        return None
    return [torch.compile(layer) for layer in layers]
