"""Peak bytes of live tensors, by kind, over a whole training step: torch's MemTracker
(torch.distributed._tools.mem_tracker: parameters, buffers, gradients, activations, temporaries,
optimizer states; tensors only, no allocator caches), which works on real and fake tensors alike,
so the dry run (cplm_dist.profiling.dry_run) and the real step it is held to
(cplm_dist.profiling.real_trace) are measured the same way.

    with StepTracker() as tracker:
        tracker.track_external(model)
        ...                                  # any number of micro-batches
    peak_by_kind(tracker)                    # {"total": bytes, "parameter": ..., "activation": ...}

MemTracker keeps statistics per module call and refuses a module called again in the same step
(a second micro-batch, a pipeline's in-flight micro-batches); StepTracker starts that module's
statistics afresh instead. Only the per-module breakdown is affected: the peak is over every
tensor alive.
"""

from __future__ import annotations

import warnings

from torch.distributed._tools.mem_tracker import MemTracker


class StepTracker(MemTracker):
    def _pre_fw_hook(self, module, inputs) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            del self.memory_tracking[module]  # called again in this step: its statistics start afresh
        super()._pre_fw_hook(module, inputs)

    def __enter__(self) -> "StepTracker":
        self._warnings = warnings.catch_warnings()  # MemTracker warns of each hook it finds already gone
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._warnings.__exit__(*exc)


def peak_by_kind(tracker: MemTracker) -> dict[str, int]:
    """The peak's bytes by kind (lower-case names, kinds with none left out) and its "total"."""
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {("total" if str(k) == "Total" else str(k.value).lower()): int(v) for k, v in snapshot.items() if v}
