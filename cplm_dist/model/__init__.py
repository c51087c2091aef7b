"""The Copy-Paste LM: `build_model(cfg)` returns this rank's tensor-parallel module.

CPLM and build_model load on first use, so that the arithmetic modules of this package
(counting, layer_shapes, parallel.stages) import without megatron-core.
"""

__all__ = ["CPLM", "build_model"]


def __getattr__(name: str):
    if name in __all__:
        from cplm_dist.model import cplm

        return getattr(cplm, name)
    raise AttributeError(f"module 'cplm_dist.model' has no attribute {name!r}")
