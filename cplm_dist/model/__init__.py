"""The Copy-Paste LM: `build_model(cfg)` returns this rank's tensor-parallel module."""

from cplm_dist.model.cplm import CPLM, build_model

__all__ = ["CPLM", "build_model"]
