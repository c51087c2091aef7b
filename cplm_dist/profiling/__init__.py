"""Measuring and predicting training cost, apart from the training core.

- `throughput`  FLOPs per token, device peaks, MFU (the training log uses it too)
- `measure`     clean and instrumented steps of the real train step: tokens/s, phases, collectives, memory
- `memory`      per-device memory of a step from the config and layout alone
- `plotting`    the PNG figures the tools write
"""
