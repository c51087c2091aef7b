"""CPLMQwen3ForCausalLM: Qwen3 with the Copy-Paste head beside its LM head (the copy head reads the
final RMSNorm's output); the logits it returns are the log-probabilities of the copy/LM mixture, so
`generate()` samples from the mixture. The copy head, the mixes and the KV cache are
copy_mixture's, shared with modeling_cplm (the Llama one). Weights: Qwen3ForCausalLM's state-dict
names plus copy_head.* (q.weight, k.weight, and gate.weight/bias or sentinel by the mix).

A sparse export (config.json with num_experts > 0: Qwen3MoeConfig's keys) has transformers'
Qwen3MoeSparseMoeBlock as the MLP of the layers Qwen3-MoE's rule makes sparse (not in
mlp_only_layers, (i + 1) a multiple of decoder_sparse_step), so the copy-on class computes what a
stock Qwen3MoeForCausalLM computes; its weights are in the Hub's layout (mlp.gate,
mlp.experts.<e>.gate_proj / up_proj / down_proj), which transformers 5 fuses as it loads through
the conversion mapping registered here under the class's name (Qwen3-MoE's own; transformers 4
reads the layout as it is).
"""

from transformers import Qwen3ForCausalLM

from .configuration_cplm import CPLMQwen3Config
from .copy_mixture import CopyMixtureMixin

try:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
except ImportError:  # a transformers before Qwen3-MoE: dense exports still load
    Qwen3MoeSparseMoeBlock = None


def sparse_layers(config) -> list:
    """The layers Qwen3-MoE's decoder makes sparse (none without num_experts)."""
    if not getattr(config, "num_experts", 0):
        return []
    step, dense = getattr(config, "decoder_sparse_step", 1), getattr(config, "mlp_only_layers", None) or []
    return [i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0]


if Qwen3MoeSparseMoeBlock is not None:
    class SparseBlock(Qwen3MoeSparseMoeBlock):
        """transformers' block returning the hidden states alone (transformers 4's also returns the
        router logits), as the dense Qwen3 layer expects of its MLP."""

        def forward(self, hidden_states):
            out = super().forward(hidden_states)
            return out[0] if isinstance(out, tuple) else out

    try:  # transformers 5: the Hub's per-expert tensors fused into the block's on load, split on save
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping

        register_checkpoint_conversion_mapping("CPLMQwen3ForCausalLM", get_checkpoint_conversion_mapping("qwen3_moe"),
                                               overwrite=True)
    except ImportError:
        pass


class CPLMQwen3ForCausalLM(CopyMixtureMixin, Qwen3ForCausalLM):
    config_class = CPLMQwen3Config

    def __init__(self, config):
        super().__init__(config)
        layers = sparse_layers(config)
        if layers and Qwen3MoeSparseMoeBlock is None:
            raise ImportError("this CPLM Qwen3 has sparse layers (num_experts in config.json): it needs a transformers "
                              "with Qwen3-MoE (4.51 or later)")
        for i in layers:
            self.model.layers[i].mlp = SparseBlock(config)
        if layers:
            self.post_init()
