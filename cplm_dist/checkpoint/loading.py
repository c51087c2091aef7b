"""Loading a checkpoint for evaluation, generation and export, without a DeepSpeed engine: its
config (`load_checkpoint_config`, from complete.json alone) and its model at this launch's tp
(`load_model`), whatever tp, ZeRO stage, pipeline layout or ep it was saved with.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from cplm_dist.checkpoint.expert_files import saved_experts, with_saved_experts
from cplm_dist.checkpoint.manifest import CARRIED_TOKENIZER, COMPLETE, Manifest, check_intact, read_manifest, resolve_checkpoint
from cplm_dist.checkpoint.safe_io import layer_states_name, load_states, model_states_file, weights_only_torch_load
from cplm_dist.config import Config, check_tp_divides, from_dict
from cplm_dist.config.curriculum import all_entries
from cplm_dist.errors import CheckpointError, ConfigError
from cplm_dist.files import sha256_file
from cplm_dist.megatron_compat import import_deepspeed, parallel_state
from cplm_dist.model.cplm import build_model
from cplm_dist.model.parallel.sharding import full_state_dict, load_full_state_dict
from cplm_dist.model.parallel.stages import checkpoint_layer_names


def _self_contained(cfg: Config, manifest: Manifest) -> Config:
    """The checkpoint's config with paths that work from here: data.tokenizer is the copy the
    checkpoint carries; relative data paths that do not exist here are taken from the directory
    training ran in (the manifest's `cwd`; where it has none, the nearest directory above the
    checkpoint that holds them), when they exist there."""
    step_dir = manifest.step_dir
    bases = ([Path(manifest.cwd)] if manifest.cwd else []) + list(step_dir.resolve().parents)[1:5]
    main = CARRIED_TOKENIZER.get(cfg.data.tokenizer_backend, (None,))[0]
    if main in manifest.tokenizer_files:
        cfg.data.tokenizer = str(step_dir / main)  # a Hugging Face tokenizer.json reads its config beside it
    elif cfg.data.tokenizer:
        cfg.data.tokenizer = _found_from(cfg.data.tokenizer, bases, "")
    for entry in all_entries(cfg):  # every stage's blend (cplm_dist.config.curriculum)
        entry.path = _found_from(entry.path, bases, ".idx")
    return cfg


def _found_from(path: str, bases: list[Path], suffix: str) -> str:
    """`path` if it exists from here (or is absolute), else the first base that holds it."""
    if Path(path).is_absolute() or Path(path + suffix).exists():
        return path
    return next((str(b / path) for b in bases if Path(str(b / path) + suffix).exists()), path)


def read_checkpoint(path: str | Path) -> tuple[Config, Manifest]:
    """(the resolved config a checkpoint was trained with, its paths made to work from here;
    its manifest) of a run directory, its checkpoints/ directory or one step-* directory."""
    root, tag = resolve_checkpoint(path)
    manifest = read_manifest(root / tag)
    try:
        cfg = from_dict(manifest.config)
    except ConfigError as e:
        raise CheckpointError(f"{root / tag / COMPLETE}: its config does not load ({e})") from None
    return _self_contained(cfg, manifest), manifest


def load_checkpoint_config(path: str | Path) -> tuple[Config, dict]:
    """`read_checkpoint` with the manifest as plain data, its `root` and `tag` added."""
    cfg, manifest = read_checkpoint(path)
    return cfg, manifest.info()


def check_carried_tokenizer(manifest: Manifest) -> None:
    """The tokenizer files a checkpoint carries must be the ones it was saved with (their sha256 in
    the manifest's files, the training tokenizer's fingerprint): one line when one is missing or
    was replaced, since its token ids would not be the ones the model learned."""
    for name in manifest.tokenizer_files:
        entry, path = manifest.files.get(name), manifest.step_dir / name
        if entry is None:
            continue
        if not path.is_file():
            raise CheckpointError(f"{path}: the tokenizer this checkpoint carries is missing (its {COMPLETE} lists it, "
                                  f"sha256 {entry['sha256'][:12]}...): restore the run's data.tokenizer there, or use "
                                  "an earlier step (--checkpoint <run>/checkpoints/step-*)")
        found = sha256_file(path)
        if found != entry["sha256"]:
            raise CheckpointError(f"{path}: the tokenizer this checkpoint carries is not the one it was saved with "
                                  f"(sha256 {found[:12]}..., its {COMPLETE} records {entry['sha256'][:12]}...): its "
                                  "token ids would not be the model's; restore the run's data.tokenizer there, or use "
                                  "an earlier step (--checkpoint <run>/checkpoints/step-*)")


def pipeline_shards(manifest: Manifest, cfg: Config) -> list[dict]:
    """Each saved tp rank's weights under their CPLM names, from a pipeline checkpoint's layer
    files (one per pipeline layer and tp rank)."""
    names, saved_tp = checkpoint_layer_names(cfg), manifest.layout.tp
    files = {(i, r): manifest.step_dir / layer_states_name(i, r) for i in names for r in range(saved_tp)}
    check_intact(manifest, [f.name for f in files.values()])
    shards = [{} for _ in range(saved_tp)]
    for (i, r), file in files.items():
        shards[r].update({names[i] + k: v for k, v in load_states(file, module=False).items()})
    return shards


def saved_shards(manifest: Manifest, cfg: Config) -> list[dict]:
    """Each saved tp rank's weights (pipeline layer files joined; ZeRO-3's optimizer shards merged)."""
    step_dir, saved_tp = manifest.step_dir, manifest.layout.tp
    if manifest.layout.pp > 1:
        return pipeline_shards(manifest, cfg)
    files = [model_states_file(step_dir, r) for r in range(saved_tp)]
    check_intact(manifest, [f.name for f in files])
    shards = [load_states(f)["module"] for f in files]
    if any(getattr(v, "numel", lambda: 1)() == 0 for v in shards[0].values()):  # ZeRO-3: weights live in the optimizer shards
        if saved_tp != 1:
            raise CheckpointError(f"{step_dir}: ZeRO-3 checkpoints saved at tp>1 cannot be merged for evaluation yet "
                                  "(DeepSpeed's zero_to_fp32 reads tp rank 0 only); evaluate one saved at tp=1")
        import_deepspeed()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        check_intact(manifest)
        with weights_only_torch_load():
            shards = [get_fp32_state_dict_from_zero_checkpoint(str(manifest.root), tag=manifest.tag)]
    return shards


def saved_buffers(model: torch.nn.Module, shard: dict) -> list[str]:
    """The model's persistent buffers a saved shard holds (a sparse layer's router expert bias:
    model state that decides the routing, not optimizer state)."""
    buffers = dict(model.named_buffers())
    return [k for k in model.state_dict() if k in buffers and k in shard]


@torch.no_grad()
def copy_buffers(model: torch.nn.Module, shard: dict, names: list[str]) -> None:
    """Those buffers from the shard (replicated on every rank: all ranks equal at save)."""
    buffers = dict(model.named_buffers())
    for k in names:
        buffers[k].copy_(shard[k])


def load_model(path: str | Path, device=None, dtype=torch.float32):
    """(model in eval mode, config, manifest as plain data with `root` and `tag`) on this rank, at
    this launch's tp whatever tp the checkpoint was saved at: every saved tp rank's weights are
    joined into the tp-independent tensors (cplm_dist.model.parallel.sharding) and this rank's shard is
    taken. ZeRO-3 checkpoints keep the weights only in the optimizer shards, which DeepSpeed's
    zero_to_fp32 merges (saved at tp = 1). A pipeline checkpoint's per-layer files are read under
    the names a CPLM gives them, so it loads as a whole model too (evaluation and generation run
    without pipeline stages). A sparse model loads at ep = 1 whatever ep it was saved at: its
    experts from the expert files by global id (cplm_dist.checkpoint.expert_files), its persistent
    buffers (the routers' expert bias) from the model states. The tokenizer the checkpoint carries (the config's data.tokenizer
    from here) must hash as recorded at save (`check_carried_tokenizer`)."""
    cfg, manifest = read_checkpoint(path)
    check_carried_tokenizer(manifest)  # cfg.data.tokenizer is the copy it carries (_self_contained)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    try:
        check_tp_divides(cfg.model, tp)
    except ConfigError as e:
        raise CheckpointError(f"{path} (saved at tp={manifest.layout.tp}) cannot be loaded with {tp} ranks: {e}") from None
    cfg.parallel.tp, cfg.parallel.cp = tp, 1  # a cp run's weights are whole on every cp rank: evaluated without cp
    model = build_model(cfg, device=device, dtype=dtype, activation_checkpointing=False, compile_layers=False,
                        sequence_parallel=False)
    shards = saved_shards(manifest, cfg)
    params = dict(model.named_parameters())
    persistent = saved_buffers(model, shards[0])  # a sparse layer's expert bias
    unexpected = [k for k in shards[0] if k not in params and k not in persistent and not k.endswith("_extra_state")]
    try:
        if unexpected:
            raise ValueError(f"unexpected {unexpected[:3]}")
        # a sparse model saved at ep > 1: every expert from its expert files, by global id
        full = with_saved_experts(full_state_dict(shards, model), saved_experts(manifest), model)
        load_full_state_dict(model, full, tp_rank, tp)
        copy_buffers(model, shards[0], persistent)
    except (ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: weights do not match the model ({str(e).splitlines()[0]})") from None
    return model.to(dtype).eval(), cfg, manifest.info()
