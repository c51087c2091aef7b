"""cplm_dist: pretraining Copy-Paste Language Models with megatron-core TP and DeepSpeed ZeRO.

Data flow: config -> parallel -> model -> data -> train -> checkpoint (see README.md).
"""

__version__ = "0.1.0"
