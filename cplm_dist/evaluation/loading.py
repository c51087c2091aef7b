"""A trained model from a checkpoint, for evaluation and generation (no DeepSpeed engine).

`path` may be a run directory, its checkpoints/ directory, or one step-* directory. The config
is the one the run resolved (stored in the checkpoint), so evaluation needs no config file. The
model is rebuilt at the tp the checkpoint was saved with (each rank reads its own mp_rank file);
ZeRO-3 checkpoints keep weights only in the optimizer shards, which DeepSpeed's zero_to_fp32
merges (tp = 1).
"""

from __future__ import annotations

from pathlib import Path

import torch

from cplm_dist.checkpoint import COMPLETE, CheckpointError, latest_tag
from cplm_dist.config import Config, from_dict


def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(checkpoints root, tag) for a run dir, a checkpoints dir, or a step directory."""
    p = Path(path)
    if (p / COMPLETE).is_file():
        return p.parent, p.name
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    tag = latest_tag(root) if root.is_dir() else None
    if tag is None:
        raise CheckpointError(f"{path}: no complete checkpoint there (a run directory, its checkpoints/, or a step-* directory)")
    return root, tag


def _model_states_file(step_dir: Path, tp_rank: int) -> Path:
    plain = step_dir / f"mp_rank_{tp_rank:02d}_model_states.pt"
    return plain if plain.is_file() else step_dir / f"zero_pp_rank_0_mp_rank_{tp_rank:02d}_model_states.pt"


def _load_states(file: Path) -> dict:
    """torch.load of a DeepSpeed model-states file; a missing or damaged one is a CheckpointError."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing although its checkpoint is marked complete: use an earlier step "
                              "(--checkpoint <run>/checkpoints/step-*)") from None
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError ... on a damaged file
        raise CheckpointError(f"{file} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:100]}): the file is "
                              "damaged; use an earlier step (--checkpoint <run>/checkpoints/step-*)") from None
    if not isinstance(state, dict) or "module" not in state:
        raise CheckpointError(f"{file} is not a DeepSpeed model-states file (no 'module'): point --checkpoint at a run")
    return state


def load_checkpoint_config(path: str | Path) -> tuple[Config, dict]:
    """The resolved config a checkpoint was trained with, and its client state (step, layout, ...)."""
    root, tag = resolve_checkpoint(path)
    state = _load_states(_model_states_file(root / tag, 0))
    if "config" not in state:
        raise CheckpointError(f"{root / tag} was not written by cplm-train (no resolved config in its client state)")
    return from_dict(state["config"]), {k: state[k] for k in ("step", "layout") if k in state} | {"root": root, "tag": tag}


def load_model(path: str | Path, device=None, dtype=torch.float32):
    """(model in eval mode, config, info) on this rank, whose tp group must match the checkpoint's tp."""
    import torch.distributed as dist

    from cplm_dist.megatron_compat import parallel_state
    from cplm_dist.model import build_model

    cfg, info = load_checkpoint_config(path)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if tp != info["layout"]["tp"]:
        raise CheckpointError(f"{path} was saved at tp={info['layout']['tp']}: evaluate it with that many tensor-parallel ranks "
                              f"(this launch has tp={tp})")
    cfg.train.activation_checkpointing = False
    model = build_model(cfg, device=device, dtype=dtype)
    step_dir = info["root"] / info["tag"]
    module = _load_states(_model_states_file(step_dir, tp_rank))["module"]
    if any(getattr(v, "numel", lambda: 1)() == 0 for v in module.values()):  # ZeRO-3: weights live in the optimizer shards
        if tp != 1:
            raise CheckpointError(f"{path}: ZeRO-3 checkpoints are merged for evaluation at tp=1 only")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        module = get_fp32_state_dict_from_zero_checkpoint(str(info["root"]), tag=info["tag"])
    missing, unexpected = model.load_state_dict({k: v for k, v in module.items() if v is not None}, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(dtype).eval(), cfg, info
