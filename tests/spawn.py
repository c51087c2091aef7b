"""The one helper for multi-process tests: N gloo ranks on CPU, a free port, a hard timeout.

    results = run_ranks(worker, world_size=2, args=(...,))   # [rank 0's return, rank 1's, ...]

`worker(*args)` runs in a fresh process (forked from a server that preloaded torch, DeepSpeed,
megatron-core and cplm_dist once) with RANK / WORLD_SIZE / MASTER_* set as torchrun
would, OMP_NUM_THREADS=1 and one torch thread; it calls cplm_dist.distributed.init_distributed
itself, so the launch path under test is the real one. Return values travel through torch.save
files (no shared-memory tensors outliving their process). A rank that raises fails the test with
its traceback; a job that outlives `timeout` is killed and fails, it never hangs the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import traceback

import torch

from cplm_dist.distributed import free_port

# Ranks fork from a server that imported these once per session, instead of each spawned rank
# importing torch, DeepSpeed and megatron-core anew (~5 s a rank, in every multi-process test).
# Nothing in them starts threads or touches a device at import; each rank still joins its own
# process group, with the environment the test had when it called run_ranks.
PRELOAD = ["torch", "torch.distributed", "deepspeed", "megatron.core.tensor_parallel", "megatron.core.parallel_state",
           "cplm_dist.train.driver", "cplm_dist.model", "cplm_dist.checkpoint"]
_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _entry(fn, args, rank, world_size, port, out_path, extra_env, parent_env):
    os.environ.clear()
    os.environ.update(parent_env)  # as a spawned process would have it: the caller's, not the server's
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **extra_env,
    )
    torch.set_num_threads(1)
    try:
        result = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result = ("error", traceback.format_exc())
    finally:
        try:
            from cplm_dist.distributed import destroy_distributed

            destroy_distributed()
        except Exception:  # noqa: BLE001
            pass
    torch.save(result, out_path)


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 240.0, env: dict | None = None) -> list:
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="cplm-spawn-") as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pt") for r in range(world_size)]
        procs = [
            ctx.Process(target=_entry, args=(fn, args, r, world_size, port, paths[r], env or {}, dict(os.environ)))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in procs):
            for p in procs:
                p.kill()
            raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish within {timeout:.0f}s")
        results = []
        for r, (p, path) in enumerate(zip(procs, paths)):
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} of {fn.__name__} died with exit code {p.exitcode}")
            status, value = torch.load(path, weights_only=False)
            if status != "ok":
                raise RuntimeError(f"rank {r} of {fn.__name__} failed:\n{value}")
            results.append(value)
        return results
