"""CPLMGPT2ForCausalLM: GPT-2 with the Copy-Paste head beside its LM head (the copy head reads the
output of ln_f); the logits it returns are the log-probabilities of the copy/LM mixture, so
`generate()` samples from the mixture. The copy head, the mixes and the KV cache are
copy_mixture's, shared with modeling_cplm (the Llama one). Weights: GPT2LMHeadModel's state-dict
names plus copy_head.* (q.weight, k.weight, and gate.weight/bias or sentinel by the mix).
"""

from transformers import GPT2LMHeadModel

from .configuration_cplm import CPLMGPT2Config
from .copy_mixture import CopyMixtureMixin


class CPLMGPT2ForCausalLM(CopyMixtureMixin, GPT2LMHeadModel):
    config_class = CPLMGPT2Config
