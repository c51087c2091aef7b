"""Measuring and predicting training cost, apart from the training core.

- `throughput`     FLOPs per token, device peaks, MFU (the training log uses it too)
- `measure`        clean and instrumented steps of the real train step: tokens/s, phases, collectives,
                   memory; several steps alternated on the same shapes
- `decoding`       KV-cache decoding speed, copy on and off
- `memory`         per-device memory of a step from the config and layout alone
- `communication`  each collective's bytes a step, from the config and layout alone
- `expert_cost`    what a sparse model's experts add to both: states, router and dispatcher, all-to-alls
- `planner`        the layouts that fit a cluster, their predicted step time and MFU
- `layout_config`  the chosen layout as config fields and overrides, written into a run config
- `dry_run_report` a dry run's table, verdict and JSON
- `dry_run_experts` how a fake rank routes a sparse model's tokens: balanced
- `sweep`          a grid of profiler runs, each point a fresh launch
- `records`        the profiler's console table, CSV rows and their markdown report
- `plotting`       the PNG figures the tools write
"""
