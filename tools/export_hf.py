"""Export a checkpoint as a Hugging Face directory: the backbone's stock transformers class (copy off) or our remote-code class (copy on).

    python tools/export_hf.py --checkpoint runs/my-run --out hf/my-run [--dtype bf16] [--max-shard-size 5GB]

From any saved tp (the shards are joined) and ZeRO stage 0-2 (ZeRO-3 at tp = 1; a sparse model
saved at ep = 1), any backbone
(through its record's HF adapter, cplm_dist.config.backbones: `backbone(m).hf`):

| model.arch | copy off (no remote code) | copy on (trust_remote_code=True) |
|---|---|---|
| llama | `LlamaForCausalLM` | `CPLMForCausalLM` (cplm_dist/interop/hf/remote/modeling_cplm.py) |
| gpt2 | `GPT2LMHeadModel` (GQA's K/V heads repeated; tied or not) | `CPLMGPT2ForCausalLM` (modeling_cplm_gpt2.py) |
| qwen3 | `Qwen3ForCausalLM` (q/k norms; tied or not) | `CPLMQwen3ForCausalLM` (modeling_cplm_qwen3.py) |
| qwen3 + model.moe | `Qwen3MoeForCausalLM` | `CPLMQwen3ForCausalLM` with Qwen3-MoE's sparse blocks (docs/moe.md) |
| llama + model.moe | `MixtralForCausalLM` (every layer sparse) | none yet (one line) |

Writes config.json, generation_config.json (the token ids below and use_cache), the weights as
save_pretrained writes them (model.safetensors, or shards of at most --max-shard-size with
model.safetensors.index.json; in --dtype), and the tokenizer as transformers reads it:
tokenizer.json and tokenizer_config.json (cplm_dist/interop/hf/tokenizer_files.py: SentencePiece
converted by transformers' own converter, tokenizer.model beside it), so that
`AutoTokenizer.from_pretrained(DIR)` gives the ids training used for every backbone, its eos (and
bos) the end-of-document token and its pad the tokenizer's. All into a new directory, made beside
--out and renamed into place when complete; an existing --out is kept unless --overwrite. Copy off: `<class>.from_pretrained(DIR)`. Copy on:
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` loads the class written beside
the weights (every file of cplm_dist/interop/hf/remote); its logits are the mixture's log-probabilities, so
`generate()` samples from the mixture, keeping a KV cache. All give our log-probabilities to 1e-5
and our greedy tokens (tests/test_hf.py).

Scaled RoPE (model.rope_scaling, docs/training.md "Context extension"): linear is written as
transformers' rope_type linear; ntk as the plain RoPE it exactly is, at rope_theta x
factor^(d/(d-2)) (transformers' "dynamic" is another function). config.json's "cplm_dist" entry
records the run's own rope_theta and rope_scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError
from cplm_dist.interop.hf.directory import DEFAULT_MAX_SHARD, parse_size

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export(checkpoint: str, out: Path, dtype: str, max_shard_size: int = DEFAULT_MAX_SHARD) -> Path:
    """The checkpoint's model (any saved tp, joined) exported into `out` (export_model)."""
    from cplm_dist.checkpoint import load_model

    model, cfg, info = load_model(checkpoint)
    return export_model(model, cfg, out, dtype, max_shard_size,
                        {"checkpoint": str(Path(info["root"]) / info["tag"]), "step": info["step"]})


def export_model(model, cfg, out: Path, dtype: str, max_shard_size: int = DEFAULT_MAX_SHARD, source: dict | None = None) -> Path:
    """A loaded model (tp 1, or its tp ranks' shards joined) as a HF directory at `out`: written
    beside it and renamed into place when complete (an existing `out` replaced). `source`: what
    config.json's "cplm_dist" entry says it came from."""
    from cplm_dist.checkpoint import tokenizer_files
    from cplm_dist.config import to_dict
    from cplm_dist.interop.hf.directory import write_hf_dir
    from cplm_dist.interop.hf.tokenizer_files import write_tokenizer_files
    from cplm_dist.model.parallel.sharding import full_state_dict

    full = full_state_dict([model.state_dict()], model)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        files = tokenizer_files(cfg)  # tokenizer.model, or tokenizer.json and its config
        tokens = (write_tokenizer_files(files, cfg.data.tokenizer_backend, tmp, cfg.model.max_seq_len) if files else {})
        write_hf_dir(full, cfg.model, cfg.copy, tmp, DTYPES[dtype], tokens=tokens, max_shard_size=max_shard_size,
                     extra={"cplm_dist": {**(source or {}), "rope_theta": cfg.model.rope_theta,
                                          "rope_scaling": to_dict(cfg)["model"]["rope_scaling"]}})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@exit_on_usage_error
def main(argv=None) -> int:
    from cplm_dist.checkpoint import load_checkpoint_config
    from cplm_dist.distributed import destroy_distributed, init_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a run directory, its checkpoints/ or one step-* directory")
    p.add_argument("--out", required=True, type=Path, help="the directory to write (made; must not exist unless --overwrite)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="of the weights written (bf16: half the files)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="the largest weights file (save_pretrained's max_shard_size: 5GB, 500MB, or bytes); a model "
                        "larger than it is written in shards with model.safetensors.index.json (default: 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    try:
        max_shard_size = parse_size(args.max_shard_size)
    except ValueError as e:
        raise UsageError(f"--max-shard-size {e}") from None
    if args.out.exists() and not args.overwrite:
        raise UsageError(f"--out {args.out} exists: choose a new directory or pass --overwrite")
    if not args.out.parent.is_dir():
        raise UsageError(f"--out {args.out}: its parent directory {args.out.parent} does not exist")
    load_checkpoint_config(args.checkpoint)  # a bad checkpoint: one line before anything starts
    init_distributed(1)
    try:
        out = export(args.checkpoint, args.out, args.dtype, max_shard_size)
    finally:
        destroy_distributed()
    print(f"exported {args.checkpoint} -> {out} ({json.loads((out / 'config.json').read_text())['architectures'][0]}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
