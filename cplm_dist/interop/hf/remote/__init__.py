"""The transformers side of a copy-on export: `CPLMForCausalLM` (Llama, modeling_cplm),
`CPLMGPT2ForCausalLM` (GPT-2, modeling_cplm_gpt2) and `CPLMQwen3ForCausalLM` (Qwen3,
modeling_cplm_qwen3), their configs (configuration_cplm) and the copy head, mixture and KV cache
they share (copy_mixture). Which class an export uses is its backbone's adapter's (`remote`,
cplm_dist.config.backbones); cplm_dist.interop.hf.directory.write_hf_dir copies every file but this
one into the exported directory (loaded with trust_remote_code=True). These files import only
torch and transformers (and each other, relatively), so the exported model runs where cplm_dist
is not installed."""
