"""CPLMQwen3ForCausalLM: Qwen3 with the Copy-Paste head beside its LM head (the copy head reads the
final RMSNorm's output); the logits it returns are the log-probabilities of the copy/LM mixture, so
`generate()` samples from the mixture. The copy head, the mixes and the KV cache are
copy_mixture's, shared with modeling_cplm (the Llama one). Weights: Qwen3ForCausalLM's state-dict
names plus copy_head.* (q.weight, k.weight, and gate.weight/bias or sentinel by the mix).
"""

from transformers import Qwen3ForCausalLM

from .configuration_cplm import CPLMQwen3Config
from .copy_mixture import CopyMixtureMixin


class CPLMQwen3ForCausalLM(CopyMixtureMixin, Qwen3ForCausalLM):
    config_class = CPLMQwen3Config
