"""CPLMConfig: a Llama config plus the copy head (docs/copy_head.md of cplm_dist)."""

from transformers import LlamaConfig


class CPLMConfig(LlamaConfig):
    model_type = "cplm"

    def __init__(self, copy_num_heads: int = 1, copy_head_dim: int = 64, copy_paste: str = "next", copy_mix: str = "gate",
                 copy_rope: bool = False, copy_rope_theta: float | None = None, copy_rope_scaling: dict | None = None,
                 **kwargs):
        self.copy_num_heads = copy_num_heads
        self.copy_head_dim = copy_head_dim
        self.copy_paste = copy_paste
        self.copy_mix = copy_mix
        self.copy_rope = copy_rope
        self.copy_rope_theta = copy_rope_theta  # the copy head's RoPE base (None: the backbone's rope_theta)
        self.copy_rope_scaling = copy_rope_scaling  # {type: linear | ntk, factor} or None
        super().__init__(**kwargs)
