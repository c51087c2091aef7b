"""The configs of a copy-on export: a backbone's transformers config plus the copy head's fields
(docs/copy_head.md of cplm_dist), the same copy_* keys for every backbone (config.json as
cplm_dist.config.backbones.hf_adapter.copy_fields writes them).

    CPLMConfig        LlamaConfig + copy_*   model_type "cplm"        (modeling_cplm.CPLMForCausalLM)
    CPLMGPT2Config    GPT2Config + copy_*    model_type "cplm_gpt2"   (modeling_cplm_gpt2.CPLMGPT2ForCausalLM)
    CPLMQwen3Config   Qwen3Config + copy_*   model_type "cplm_qwen3"  (modeling_cplm_qwen3.CPLMQwen3ForCausalLM)
"""

from transformers import GPT2Config, LlamaConfig, Qwen3Config

# copy_* field -> default. copy_rope_theta None: the backbone's rope_theta; copy_rope_scaling:
# {type: linear | ntk, factor} or None (the copy head's own RoPE, at its own head dim)
COPY_FIELDS = {"copy_num_heads": 1, "copy_head_dim": 64, "copy_paste": "next", "copy_mix": "gate", "copy_rope": False,
               "copy_rope_theta": None, "copy_rope_scaling": None}
CHOICES = {"copy_paste": ("next", "self"), "copy_mix": ("gate", "joint", "sentinel", "joint_gate")}


def set_copy_fields(config, kwargs: dict) -> None:
    """Move the copy_* keys out of `kwargs` onto `config` (defaults for the missing ones), before
    the backbone config's own __init__ takes the rest; an unknown mix or paste is one line."""
    for name, default in COPY_FIELDS.items():
        setattr(config, name, kwargs.pop(name, default))
    for name, allowed in CHOICES.items():
        if getattr(config, name) not in allowed:
            raise ValueError(f"{name}={getattr(config, name)!r} is not one of {', '.join(allowed)}")


class CPLMConfig(LlamaConfig):
    model_type = "cplm"

    def __init__(self, **kwargs):
        set_copy_fields(self, kwargs)
        super().__init__(**kwargs)


class CPLMGPT2Config(GPT2Config):
    model_type = "cplm_gpt2"

    def __init__(self, **kwargs):
        set_copy_fields(self, kwargs)
        super().__init__(**kwargs)


class CPLMQwen3Config(Qwen3Config):
    model_type = "cplm_qwen3"

    def __init__(self, **kwargs):
        set_copy_fields(self, kwargs)
        super().__init__(**kwargs)
