"""CPLMConfig: a Llama config plus the copy head (docs/copy_head.md of cplm_dist)."""

from transformers import LlamaConfig


class CPLMConfig(LlamaConfig):
    model_type = "cplm"

    def __init__(self, copy_num_heads: int = 1, copy_head_dim: int = 64, copy_paste: str = "next", copy_mix: str = "gate",
                 copy_rope: bool = False, **kwargs):
        self.copy_num_heads = copy_num_heads
        self.copy_head_dim = copy_head_dim
        self.copy_paste = copy_paste
        self.copy_mix = copy_mix
        self.copy_rope = copy_rope
        super().__init__(**kwargs)
