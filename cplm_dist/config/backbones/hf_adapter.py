"""A backbone's Hugging Face adapter (torchtitan's state-dict adapter): how its config and weights
map onto a transformers causal LM, both ways. Each record carries one (`backbone(m).hf`), written
in the record's own file; model.init_from, tools/export_hf.py and the directory code
(cplm_dist.interop.hf.directory) ask it, never a module name.

Pure: config dicts (config.json as a dict) and tensors; it imports cplm_dist.config, cplm_dist.errors
and torch only (the records sit at the config stage, below the model).

| field | what |
|---|---|
| family | its name in messages ("Llama") |
| model_type, architecture | the stock transformers class: a copy-off export's config.json, what an import must name |
| remote | the copy-on export's class (cplm_dist/interop/hf/remote, copied beside the weights, `auto_map`); None: none (Mixtral) |
| stock_config(m) | config.json's fields of the stock class for these shapes (no token ids: the export adds the tokenizer's) |
| check(hf, m, where) | one HFImportError line where a HF config.json does not fit the run (its model_type checked before) |
| to_hf(full, m) | our full (tp-independent) weights -> the stock class's state dict, the copy head's kept under its names |
| from_hf(hf, m) | the stock class's state dict -> our full backbone weights (no copy head) |
| sparse | the family's mixture-of-experts class's adapter (a model with model.moe: Mixtral for llama, Qwen3-MoE for qwen3), or None: `hf_adapter(m)` picks |

Both sides are "full" weights: cplm_dist.model.parallel.sharding turns them into a rank's shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from cplm_dist.errors import ConfigError, HFImportError

if TYPE_CHECKING:  # the config package imports the records (config.validation): types only here
    from cplm_dist.config.tree import CopyConfig, ModelConfig

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class RemoteClass:
    """A copy-on export's transformers class, loaded with trust_remote_code=True from the files of
    cplm_dist/interop/hf/remote written beside the weights (their names are what an export loads by)."""

    model_type: str  # config.json's model_type ("cplm")
    config: str  # its config class, in configuration_cplm.py
    module: str  # the file holding the model class (modeling_cplm)
    architecture: str  # the model class (CPLMForCausalLM)

    @property
    def auto_map(self) -> dict[str, str]:
        return {"AutoConfig": f"configuration_cplm.{self.config}", "AutoModelForCausalLM": f"{self.module}.{self.architecture}"}


@dataclass(frozen=True)
class HFAdapter:
    """One backbone's map onto transformers (the fields: the table above)."""

    family: str
    model_type: str
    architecture: str
    remote: RemoteClass | None
    stock_config: Callable[[ModelConfig], dict]
    check: Callable[[dict, ModelConfig, str], None]
    to_hf: Callable[[Weights, ModelConfig], Weights]
    from_hf: Callable[[Weights, ModelConfig], Weights]
    sparse: HFAdapter | None = None

    def hf_config(self, m: ModelConfig, copy: CopyConfig | None = None) -> dict:
        """config.json of an export: the stock class's, or with a copy head the remote class's
        (model_type, auto_map and the copy_* keys its config reads)."""
        out = {"architectures": [self.architecture], "model_type": self.model_type, **self.stock_config(m)}
        if copy is not None and copy.enabled:
            if self.remote is None:
                raise ConfigError(f"a copy-on model does not export as {self.family} (no remote class for it yet): "
                                  "export a copy.enabled=false model")
            out.update({"architectures": [self.remote.architecture], "model_type": self.remote.model_type,
                        "auto_map": self.remote.auto_map, **copy_fields(m, copy)})
        return out


def copy_fields(m: ModelConfig, copy: CopyConfig) -> dict:
    """config.json's copy_* keys of a copy-on export (every backbone's remote class reads them)."""
    scaling = m.rope_scaling
    return {"copy_num_heads": copy.num_heads, "copy_head_dim": copy.head_dim, "copy_paste": copy.paste,
            "copy_mix": copy.mix, "copy_rope": copy.rope, "copy_rope_theta": m.rope_theta,
            # the copy head's own RoPE follows model.rope_scaling at its own head dim (cplm_dist.model.copy_head)
            "copy_rope_scaling": None if scaling is None else {"type": scaling.type, "factor": scaling.factor}}


def check_shapes(theirs: dict[str, tuple[str, object]], m: ModelConfig, where: str) -> None:
    """theirs: {our model field: (the HF config key, its value)}; one line naming the first that
    differs from the run's."""
    for ours, (key, value) in theirs.items():
        if value != getattr(m, ours):
            raise HFImportError(f"{where}: {key}={value} but model.{ours}={getattr(m, ours)}: set model.{ours}={value} "
                                "(the shapes must match the checkpoint)")


def check_tied(tied: bool, m: ModelConfig, where: str) -> None:
    """A model with its own LM head does not fit a tied run (a tied one fits an untied run: its
    LM head starts as a copy of the embedding)."""
    if m.tie_embeddings and not tied:
        raise HFImportError(f"{where}: tie_word_embeddings=false (its own LM head) but model.tie_embeddings=true: "
                            "set model.tie_embeddings=false")
