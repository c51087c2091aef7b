"""Measuring training steps: throughput from clean steps, a breakdown from instrumented ones,
several steps alternated on the same shapes (`alternate`), and the memory meters.

Every step measured is training's own (cplm_dist.training.step.TrainStep) on synthetic tokens.
`measure(step, ...)` runs warm-up steps, then `steps` clean steps (nothing added: no
synchronisation inside the step, no wrapped collectives) for tokens/s, TFLOP/s and MFU, then
`breakdown_steps` instrumented steps that time forward, backward and the optimizer step
separately (synchronising the device between them) and every collective (wrapped to wait for
completion), classified by process group: tensor-parallel all-reduces, data-parallel / ZeRO
reduce-scatters and all-gathers (over dp x cp under context parallelism), context-parallel K/V
and key gathers and their reduce-scatters, pipeline sends and receives, and a sparse model's
expert-parallel token all-to-alls (the ep group). Instrumentation removes overlap, so the breakdown adds up to a
little more than a clean step: the headline figures never come from instrumented steps.
"""

from __future__ import annotations

import inspect
import os
import statistics
import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from cplm_dist.config import Config
from cplm_dist.distributed import ParallelDims, synchronize
from cplm_dist.megatron_compat import collective_holders
from cplm_dist.training.throughput import device_peak_flops, flops_per_token

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "all_to_all_single", "reduce", "_all_gather_base", "_reduce_scatter_base",
               "all_reduce_coalesced", "_all_gather_base_coalesced")
P2P = ("send", "recv", "isend", "irecv")  # pipeline stages' activations and their gradients


def collective_bytes(args: tuple, kwargs: dict) -> int:
    """The size of a collective's whole buffer: its largest tensor argument, a list of tensors
    counted as their sum. So an all-reduce counts its tensor, an all-gather its gathered output
    and a reduce-scatter its unscattered input (the bytes NCCL's bus-bandwidth convention scales),
    whichever way the call passes them."""
    def size(a) -> int:
        if isinstance(a, torch.Tensor):
            return a.numel() * a.element_size()
        if isinstance(a, (list, tuple)):
            return sum(size(t) for t in a if isinstance(t, torch.Tensor))
        return 0

    return max([size(a) for a in (*args, *kwargs.values())] or [0])


class CommTimer:
    """While active, every torch.distributed collective and point-to-point transfer is timed to
    completion and filed under the group it ran on ("tp", "dp", "cp", "pp", "tied", "world" or
    "other"; sends and receives between pipeline stages: "pp"; under context parallelism the cp
    group is "cp" and the dp x cp group, where gradients are reduced, "dp"; a sparse model's token
    dispatch on the ep group "ep", its experts' tp group "tp", their gradients' group "edp"): seconds, calls and
    bytes (the whole buffer, `collective_bytes`), also by collective in
    `by_name[(group, name)] = [calls, bytes]`. `engine`: a DeepSpeed pipeline engine, whose grid
    has process groups of its own. `regions` ({name: module}): what each module's forward runs,
    and its backward (from the gradient reaching its outputs to its inputs' gradient: the module's
    full backward hooks), is also filed in `by_region[(name, group)] = [calls, bytes]`, e.g. the
    copy head's share of the cp traffic (tools/bench_context_parallel.py)."""

    def __init__(self, dims: ParallelDims, device: torch.device, engine=None, regions: dict | None = None):
        self.device = device
        self.regions, self.region, self._hooks = dict(regions or {}), None, []
        self.by_region = defaultdict(lambda: [0, 0])
        self.groups = {id(dims.tp_group): "tp", id(dims.dp_group): "dp", id(dims.pp_group): "pp"}
        self.groups.update({id(g): kind for g, kind in ((dims.cp_group, "cp"), (dims.dp_cp_group, "dp")) if g is not None})
        from cplm_dist.megatron_compat import parallel_state

        expert_tp = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)  # a sparse model's
        for group, kind in ((dims.ep_group, "ep"), (expert_tp, "tp"), (dims.expert_dp_group, "edp")):
            if group is not None:
                self.groups.setdefault(id(group), kind)
        grid = getattr(engine, "grid", None)
        if grid is not None:
            self.groups.update({id(grid.get_slice_parallel_group()): "tp", id(grid.get_data_parallel_group()): "dp",
                                id(grid.get_pipe_parallel_group()): "pp"})
            self.groups.update({id(comm["group"]): "tied" for comm in engine.module.tied_comms.values()})
        self.seconds, self.calls, self.bytes = defaultdict(float), defaultdict(int), defaultdict(int)
        self.by_name = defaultdict(lambda: [0, 0])
        self._saved = {}
        self._depth = threading.local()  # torch's send is an isend and a wait: count the outer call only

    def _kind(self, group) -> str:
        if group is None or group is dist.group.WORLD:
            return "world"
        return self.groups.get(id(group), "other")

    def _wrap(self, name, fn):
        signature = inspect.signature(fn)

        def timed(*args, **kwargs):
            if getattr(self._depth, "n", 0):
                return fn(*args, **kwargs)
            self._depth.n = 1
            try:
                return counted(*args, **kwargs)
            finally:
                self._depth.n = 0

        def counted(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            group = bound.get("group")
            if name not in P2P and group is not None and group is not dist.group.WORLD and dist.get_world_size(group) == 1:
                return fn(*args, **kwargs)  # one rank: nothing moves
            kind = "pp" if name in P2P else self._kind(group)
            synchronize(self.device)
            start = time.perf_counter()
            work = fn(*args, **kwargs)
            if bound.get("async_op") and work is not None:
                work.wait()
            synchronize(self.device)
            self.seconds[kind] += time.perf_counter() - start
            size = collective_bytes(args, kwargs)
            self.calls[kind] += 1
            self.bytes[kind] += size
            self.by_name[(kind, name)][0] += 1
            self.by_name[(kind, name)][1] += size
            if self.region is not None:
                self.by_region[(self.region, kind)][0] += 1
                self.by_region[(self.region, kind)][1] += size
            return work

        return timed

    def __enter__(self):
        originals = {id(getattr(dist, name)): name for name in COLLECTIVES + P2P if hasattr(dist, name)}
        targets = [(dist, name) for name in originals.values()]
        # megatron-core, DeepSpeed and torch's own c10d module call collectives through references
        # bound at their import: each such name is wrapped too, under the collective's name
        for holder in collective_holders():
            targets += [(holder, attr) for attr, value in list(vars(holder).items()) if id(value) in originals]
        for holder, attr in targets:
            fn = getattr(holder, attr)
            self._saved[(holder, attr)] = fn
            setattr(holder, attr, self._wrap(originals[id(fn)], fn))
        for name, module in self.regions.items():
            self._hooks += [module.register_forward_pre_hook(lambda *_, name=name: self._enter_region(name)),
                            module.register_forward_hook(lambda *_: self._enter_region(None)),
                            module.register_full_backward_pre_hook(lambda *_, name=name: self._enter_region(name)),
                            module.register_full_backward_hook(lambda *_: self._enter_region(None))]
        return self

    def _enter_region(self, name: str | None) -> None:
        self.region = name  # returns None: the hooks change nothing they are given

    def __exit__(self, *exc):
        for (module, name), fn in self._saved.items():
            setattr(module, name, fn)
        self._saved.clear()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.region = None


def synthetic_batches(cfg: Config, micro: int, seq_len: int, device, generator: torch.Generator, context=None):
    """Endless micro-batches of uniformly random token ids, as the data loader yields them: under
    context parallelism (`context`, this rank's ContextShard) its two chunks of each sequence
    (the cp ranks of a replica draw the same sequences from the same generator seed)."""
    while True:
        ids = torch.randint(0, cfg.model.vocab_size, (micro, seq_len + 1), generator=generator)
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        if context is not None:
            batch = {k: context.take(v) for k, v in batch.items()}
        yield {k: v.to(device) for k, v in batch.items()}


def timed_steps(step, batches, count: int, device: torch.device) -> list[float]:
    """Seconds of each of `count` clean steps, the device synchronised around each (never inside)."""
    times = []
    for _ in range(count):
        synchronize(device)
        start = time.perf_counter()
        step(batches)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def measure(step, cfg: Config, dims: ParallelDims, *, warmup: int, steps: int, breakdown_steps: int, seq_len: int,
            device: torch.device, baseline_bytes: int, trace_path: str | None = None) -> dict:
    """Throughput and a step-time breakdown of `step`, a TrainStep (see the module docstring).

    `baseline_bytes`: memory in use before the model was built; the step's memory is reported
    above it (`step_memory_gb`, what cplm_dist.profiling.memory estimates) and as the absolute peak."""
    from cplm_dist.model.parallel.context import context_of

    t = cfg.train
    batches = synthetic_batches(cfg, t.micro_batch_size, seq_len, device, torch.Generator().manual_seed(1234 + dims.dp_rank),
                                context_of(dims))
    for _ in range(warmup):
        step(batches)
    synchronize(device)
    with PeakMeter(device) as meter:
        times = timed_steps(step, batches, steps, device)
    # the slowest rank sets the pace
    step_times = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(step_times, op=dist.ReduceOp.MAX)
    times = step_times.tolist()

    phases = defaultdict(float)
    comm = CommTimer(dims, device, step.engine if dims.pp_size > 1 else None)
    with comm:
        for _ in range(breakdown_steps):
            step(batches, phases=phases)
    if trace_path:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                    + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])) as prof:
            step(batches)
            synchronize(device)
        prof.export_chrome_trace(trace_path)

    median = statistics.median(times)
    tokens = t.global_batch_size * seq_len
    tokens_per_s = tokens / median
    flops = flops_per_token(cfg, seq_len) * tokens_per_s / dims.world_size
    peak = device_peak_flops(t.precision, device)
    n = max(1, breakdown_steps)
    total_phases = sum(phases.values())
    return {
        "step_time_s": median,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "tokens_per_step": tokens,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / dims.world_size,
        "tflops_per_device": flops / 1e12,
        "mfu": flops / peak if peak else None,
        "peak_memory_gb": meter.peak / 1e9,
        "step_memory_gb": (meter.peak - baseline_bytes) / 1e9,
        "forward_s": phases["forward"] / n,
        "backward_s": phases["backward"] / n,
        "optimizer_s": phases["optimizer"] / n,
        "optimizer_share": phases["optimizer"] / total_phases if total_phases else None,  # of the timed phases
        "pipeline_s": phases["pipeline"] / n,  # pp > 1: forward, backward and the step interleave in one schedule
        "comm_pp_s": comm.seconds["pp"] / n,
        "comm_pp_mb": comm.bytes["pp"] / n / 1e6,
        "comm_cp_s": comm.seconds["cp"] / n,  # context parallelism: K/V, copy keys and ids gathered, gradients scattered
        "comm_cp_calls": comm.calls["cp"] / n,
        "comm_cp_mb": comm.bytes["cp"] / n / 1e6,
        "comm_ep_s": comm.seconds["ep"] / n,  # expert parallelism: the dispatcher's token all-to-alls (and their counts)
        "comm_ep_calls": comm.calls["ep"] / n,
        "comm_ep_mb": comm.bytes["ep"] / n / 1e6,
        "comm_tp_s": comm.seconds["tp"] / n,
        "comm_dp_s": (comm.seconds["dp"] + comm.seconds["world"] + comm.seconds["edp"]) / n,  # expert gradients too
        "comm_tp_calls": comm.calls["tp"] / n,
        "comm_dp_calls": (comm.calls["dp"] + comm.calls["world"] + comm.calls["edp"]) / n,
        "comm_tp_mb": comm.bytes["tp"] / n / 1e6,
        "comm_dp_mb": (comm.bytes["dp"] + comm.bytes["world"] + comm.bytes["edp"]) / n / 1e6,
        "comm_by_collective": {f"{kind}/{name}": {"calls": calls / n, "mb": size / n / 1e6}
                               for (kind, name), (calls, size) in sorted(comm.by_name.items())},
    }


def alternate(steps: dict, cfg: Config, dims: ParallelDims, device: torch.device, seq_len: int, *, warmup: int,
              steps_per_round: int, rounds: int) -> dict:
    """Interleave timed steps of several TrainSteps on the same shapes (copy on / off, a peer
    model): {name: {step_time_s (the median), tokens_per_s, tokens_per_s_per_device, memory_gb}}
    for `steps` = {name: (step, bytes its states took when built, `measure_building`)}, the
    memory being those states plus its steps' peak above them."""
    from cplm_dist.model.parallel.context import context_of

    batches = synthetic_batches(cfg, cfg.train.micro_batch_size, seq_len, device, torch.Generator().manual_seed(0),
                                context_of(dims))
    times = {name: [] for name in steps}
    peaks = {name: 0 for name in steps}
    for step, _ in steps.values():
        for _ in range(warmup):
            step(batches)
    for _ in range(rounds):
        for name, (step, _) in steps.items():
            before = current_memory_bytes(device)
            with PeakMeter(device) as meter:
                times[name] += timed_steps(step, batches, steps_per_round, device)
            peaks[name] = max(peaks[name], meter.peak - before)
    tokens = cfg.train.global_batch_size * seq_len
    out = {}
    for name, (_, static) in steps.items():
        median = statistics.median(times[name])
        out[name] = {"step_time_s": median, "tokens_per_s": tokens / median,
                     "tokens_per_s_per_device": tokens / median / dims.world_size,
                     "memory_gb": (static + peaks[name]) / 1e9}
    return out


def measure_building(make, device: torch.device):
    """(what make() returns, the memory building it took)."""
    before = current_memory_bytes(device)
    built = make()
    return built, current_memory_bytes(device) - before


# --- memory -------------------------------------------------------------------------------------


def release_freed_memory_on_cpu() -> None:
    """Make glibc hand large freed blocks back to the OS at once, so that the resident set tracks
    live tensors: by default glibc raises its mmap threshold after each large free (up to 32 MiB),
    and blocks below it stay in the process after they are freed, inflating the measured peak."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: fixed, which also stops the dynamic raise
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def current_memory_bytes(device: torch.device) -> int:
    """Memory in use now: CUDA allocated bytes, or this process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMeter:
    """The peak of `current_memory_bytes` while active: CUDA's own peak counter, or on CPU the
    kernel's high-water mark of the resident set (VmHWM, reset on entry through
    /proc/self/clear_refs), which no allocation escapes however short. Where that reset is not
    allowed, a thread samples the resident set every millisecond instead (it can miss a peak
    shorter than its period, or one reached while it waits for a core)."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0
        self._stop = threading.Event()
        self._thread = None
        self._high_water = False

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, current_memory_bytes(self.device))
            self._stop.wait(0.001)

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self.peak = current_memory_bytes(self.device)
        self._high_water = reset_high_water_mark()
        if not self._high_water:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            return
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        high_water = high_water_mark_bytes() if self._high_water else None
        self.peak = max(self.peak, current_memory_bytes(self.device), high_water or 0)


def reset_high_water_mark() -> bool:
    """Set this process's VmHWM to its current resident set (Linux >= 4.0); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return high_water_mark_bytes() is not None
    except OSError:
        return False


def high_water_mark_bytes() -> int | None:
    """This process's peak resident set since start or the last reset (VmHWM), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
