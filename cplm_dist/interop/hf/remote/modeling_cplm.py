"""CPLMForCausalLM: Llama with the Copy-Paste head beside its LM head (the copy head reads the
final RMSNorm's output); the logits it returns are the log-probabilities of the copy/LM mixture,
so `generate()` samples from the mixture. The copy head, the mixes and the KV cache (the
backbone's keys and values plus the copy head's keys and token ids, in one transformers Cache, so
`generate(use_cache=True)` feeds one token a step, beams included) are copy_mixture's, shared with
modeling_cplm_gpt2 and modeling_cplm_qwen3. Rows are assumed unpadded (generate refuses a mask with zeros).
"""

from transformers import LlamaForCausalLM

from .configuration_cplm import CPLMConfig
from .copy_mixture import CopyMixtureMixin


class CPLMForCausalLM(CopyMixtureMixin, LlamaForCausalLM):
    config_class = CPLMConfig
