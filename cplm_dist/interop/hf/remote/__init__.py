"""The transformers side of a copy-on export: `CPLMForCausalLM` (Llama, modeling_cplm) and
`CPLMGPT2ForCausalLM` (GPT-2, modeling_cplm_gpt2), their configs (configuration_cplm) and the copy
head, mixture and KV cache they share (copy_mixture). cplm_dist.interop.hf.llama.write_hf_dir copies every
file but this one into the exported directory (loaded with trust_remote_code=True). These files
import only torch and transformers (and each other, relatively), so the exported model runs where
cplm_dist is not installed."""
