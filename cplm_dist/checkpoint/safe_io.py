"""Checkpoint files read and written safely: DeepSpeed's file names in one place, weights-only
loading (a received checkpoint never runs code: STYLE habit 12), and a failed write turned into
the operating system's reason.

DeepSpeed's files in a step directory (tp rank r, pipeline layer i):

    mp_rank_{r:02d}_model_states.pt                 model states: weights (ZeRO 0-2), schedule, our client state
    zero_pp_rank_0_mp_rank_{r:02d}_model_states.pt  the same under ZeRO-3 (its weights in the optimizer shards)
    layer_{i:02d}-model_{r:02d}-model_states.pt      a pipeline layer's weights (parallel.pp > 1)
    *_optim_states.pt                               optimizer shards (read by DeepSpeed and its converters only)
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
from pathlib import Path

import torch

from cplm_dist.errors import CheckpointError
from cplm_dist.megatron_compat import import_deepspeed


def model_states_name(tp_rank: int, zero3: bool = False) -> str:
    """DeepSpeed's model-states file of tp rank `tp_rank` (its name under ZeRO-3 with zero3)."""
    return f"{'zero_pp_rank_0_' if zero3 else ''}mp_rank_{tp_rank:02d}_model_states.pt"


def model_states_file(step_dir: Path, tp_rank: int) -> Path:
    """The model-states file of tp rank `tp_rank` in `step_dir`, whichever name the save gave it."""
    plain = step_dir / model_states_name(tp_rank)
    return plain if plain.is_file() else step_dir / model_states_name(tp_rank, zero3=True)


def layer_states_name(layer: int, tp_rank: int) -> str:
    """DeepSpeed's file of pipeline layer `layer`'s weights on tp rank `tp_rank`."""
    return f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"


# --- weights-only loading -----------------------------------------------------------------------


def deepspeed_safe_globals() -> list:
    """The only non-tensor types a checkpoint may hold beyond plain data (DeepSpeed's optimizer
    states carry these three); anything else is refused when loading."""
    import_deepspeed()
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def safe_load(path, map_location=None):
    """torch.load with weights_only=True and DeepSpeed's allow-list: a crafted file cannot run code
    (evaluation, and DeepSpeed's resume through `use_safe_loading`)."""
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            return torch.serialization.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        what = next((line.strip() for line in str(e).splitlines() if "Unsupported global" in line), str(e).splitlines()[0])
        raise CheckpointError(f"{path} holds something a checkpoint of cplm-train never does ({what[:160]}): it was "
                              "not written by cplm-train and is not loaded (it could run code)") from None


def use_safe_loading(engine) -> None:
    """Make DeepSpeed's own checkpoint loading (resume) weights-only with the allow-list."""
    engine.checkpoint_engine.load = safe_load


@contextlib.contextmanager
def weights_only_torch_load(fix=None):
    """DeepSpeed's zero_to_fp32, universal-checkpoint converter and universal loader call
    torch.load(weights_only=False) themselves; while they run, that name loads safely instead,
    each loaded object passed through `fix` when given (cplm_dist.checkpoint.reshape cleans model states)."""
    real = torch.load

    def load(f, map_location=None, **_):
        obj = safe_load(f, map_location)
        return obj if fix is None else fix(obj)

    torch.load = load
    try:
        yield
    finally:
        torch.load = real


def load_states(file: Path, module: bool = True) -> dict:
    """torch.load of a DeepSpeed model-states file (`module`: one holding the whole module's
    states, not a pipeline layer's); a missing or damaged one is a CheckpointError."""
    try:
        state = safe_load(file, map_location="cpu")
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing although its checkpoint is marked complete: use an earlier step "
                              "(--checkpoint <run>/checkpoints/step-*)") from None
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError ... on a damaged file
        raise CheckpointError(f"{file} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:100]}): the file is "
                              "damaged; use an earlier step (--checkpoint <run>/checkpoints/step-*)") from None
    if not isinstance(state, dict) or (module and "module" not in state):
        raise CheckpointError(f"{file} is not a DeepSpeed model-states file (no 'module'): point --checkpoint at a run")
    return state


# --- writes that fail with the disk's reason -----------------------------------------------------


def os_error(write, directory: Path | None = None) -> str | None:
    """Run `write`; a failure to write as one line (None: it worked). torch.save hides the
    operating system's reason ("unexpected pos 704 vs 598"), so after any other error a probe
    write into `directory` finds it: no space left, read-only, file too large."""
    try:
        write()
    except OSError as e:
        return f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}"
    except Exception as e:  # noqa: BLE001 - whatever torch or DeepSpeed raised, the disk's reason is what matters
        probe = _probe_write(directory) if directory is not None else None
        return probe or f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return None


def _probe_write(directory: Path) -> str | None:
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            for _ in range(8):
                f.write(b"\0" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        free = f", {shutil.disk_usage(directory).free / 1e9:.2f} GB free" if directory.is_dir() else ""
        return f"{e.strerror or e} ({directory}{free})"
    finally:
        probe.unlink(missing_ok=True)
    return None


def same_weights(a: Path, b: Path) -> tuple[bool, int]:
    """(every weight tensor in step directories `a` and `b` equal, dtype and bits, how many were
    compared). The weights are the "module" of each mp_rank_*_model_states.pt and, for a pipeline
    checkpoint (whose model-states files hold "module": None), each layer_*-model_*-model_states.pt;
    no such files, other names, or other tensor names is unequal."""
    names = weight_files(a)
    if not names or names != weight_files(b):
        return False, 0
    equal, count = True, 0
    for name in names:
        x, y = _weights(a / name), _weights(b / name)
        tensors = [k for k, v in x.items() if isinstance(v, torch.Tensor)]
        count += len(tensors)
        equal &= x.keys() == y.keys() and all(
            isinstance(y[k], torch.Tensor) and x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in tensors)
    return bool(equal), count


def weight_files(step_dir: Path) -> list[str]:
    """The names of the files holding a step directory's weights: its model-states files and a pipeline's layer files."""
    return sorted(p.name for pattern in ("mp_rank_*_model_states.pt", "layer_*-model_*-model_states.pt")
                  for p in step_dir.glob(pattern))


def _weights(file: Path) -> dict:
    """The weights a file holds: a model-states file's "module" ({} for a pipeline's, whose weights
    are in its layer files), or a layer file's whole state dict."""
    state = safe_load(file, map_location="cpu")
    if file.name.startswith("layer_"):
        return state
    return state.get("module") or {}
