"""Where torch.compile can work (train.compile): regional compilation, each transformer layer's
block on its own (cplm_dist.model.recompute_compile), not the whole model.

Every layer runs the same code, so dynamo traces one graph and every layer reuses it (parameters
are graph inputs): compile time is one layer's, whatever the depth, and the fused norms, RoPE and
SwiGLU are what the layers gain. The embedding, LM head and loss stay eager (the loss is a custom
autograd Function over the vocabulary shards); the copy head compiles its pointwise parts
(CopyHead.compile_pointwise). Decoding compiles differently: one graph for a whole step of one
token over a static cache (cplm_dist.model.static_decode).

Where compilation cannot work (no C++ compiler for CPU code, no Triton for CUDA, dynamo not
supported on this Python), the run warns once and trains eager.
"""

from __future__ import annotations

import os
import shutil

import torch


def unavailable_reason(device: torch.device) -> str | None:
    """Why torch.compile cannot build kernels for `device` here, or None when it can."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed (pip install triton)"
    compiler = os.environ.get("CXX", "g++")
    return None if shutil.which(compiler) else f"no C++ compiler ({compiler}) for CPU kernels (apt install g++, or set CXX)"
