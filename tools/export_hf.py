"""Export a checkpoint as a Hugging Face directory: the backbone's stock transformers class (copy off) or our remote-code class (copy on).

    python tools/export_hf.py --checkpoint runs/my-run --out hf/my-run [--dtype bf16]

From any saved tp (the shards are joined) and ZeRO stage 0-2 (ZeRO-3 at tp = 1), any backbone
(through its record's HF adapter, cplm_dist.config.backbones: `backbone(m).hf`):

| model.arch | copy off (no remote code) | copy on (trust_remote_code=True) |
|---|---|---|
| llama | `LlamaForCausalLM` | `CPLMForCausalLM` (cplm_dist/interop/hf/remote/modeling_cplm.py) |
| gpt2 | `GPT2LMHeadModel` (GQA's K/V heads repeated; tied or not) | `CPLMGPT2ForCausalLM` (modeling_cplm_gpt2.py) |
| qwen3 | `Qwen3ForCausalLM` (q/k norms; tied or not) | `CPLMQwen3ForCausalLM` (modeling_cplm_qwen3.py) |

Writes config.json, generation_config.json (the run's tokenizer's bos/eos/pad ids, those it has,
and use_cache), model.safetensors and the run's tokenizer file (tokenizer.model for SentencePiece)
into a new directory, made beside --out and renamed into place when complete; an existing --out is
kept unless --overwrite. Copy off: `<class>.from_pretrained(DIR)`. Copy on:
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

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export(checkpoint: str, out: Path, dtype: str) -> Path:
    from cplm_dist.checkpoint import load_model, tokenizer_files
    from cplm_dist.config import to_dict
    from cplm_dist.interop.hf.directory import write_hf_dir
    from cplm_dist.model.parallel.sharding import full_state_dict

    model, cfg, info = load_model(checkpoint)
    full = full_state_dict([model.state_dict()], model)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        files = tokenizer_files(cfg)
        for name, file in files.items():  # tokenizer.model, or tokenizer.json and its config
            shutil.copy2(file, tmp / name)
        tokens = token_ids(tmp / next(iter(files)), cfg.data.tokenizer_backend) if files else {}
        write_hf_dir(full, cfg.model, cfg.copy, tmp, DTYPES[dtype], tokens=tokens,
                     extra={"cplm_dist": {"checkpoint": str(Path(info["root"]) / info["tag"]), "step": info["step"],
                                          "rope_theta": cfg.model.rope_theta, "rope_scaling": to_dict(cfg)["model"]["rope_scaling"]}})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def token_ids(path: Path, backend: str) -> dict[str, int]:
    """{bos,eos,pad}_token_id of the tokenizer at `path` (the copy beside the weights), those it
    has: eos is the end-of-document id training used."""
    from cplm_dist.data.tokenizer import load_tokenizer

    tok = load_tokenizer(path, backend)
    ids = {"bos_token_id": _bos_id(tok), "eos_token_id": tok.eod, "pad_token_id": tok.pad}
    return {k: v for k, v in ids.items() if v is not None and v >= 0}


def _bos_id(tok) -> int | None:
    """The beginning-of-sequence id: SentencePiece's own, or tokenizer_config.json's bos_token."""
    if getattr(tok, "sp", None) is not None:
        return tok.sp.bos_id()
    config = (tok.path if tok.path.is_dir() else tok.path.parent) / "tokenizer_config.json"
    value = json.loads(config.read_text()).get("bos_token") if config.is_file() else None
    value = value.get("content") if isinstance(value, dict) else value
    return tok.tok.token_to_id(value) if isinstance(value, str) else None


@exit_on_usage_error
def main(argv=None) -> int:
    from cplm_dist.checkpoint import load_checkpoint_config
    from cplm_dist.distributed import destroy_distributed, init_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a run directory, its checkpoints/ or one step-* directory")
    p.add_argument("--out", required=True, type=Path, help="the directory to write (made; must not exist unless --overwrite)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    if args.out.exists() and not args.overwrite:
        raise UsageError(f"--out {args.out} exists: choose a new directory or pass --overwrite")
    if not args.out.parent.is_dir():
        raise UsageError(f"--out {args.out}: its parent directory {args.out.parent} does not exist")
    load_checkpoint_config(args.checkpoint)  # a bad checkpoint: one line before anything starts
    init_distributed(1)
    try:
        out = export(args.checkpoint, args.out, args.dtype)
    finally:
        destroy_distributed()
    print(f"exported {args.checkpoint} -> {out} ({json.loads((out / 'config.json').read_text())['architectures'][0]}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
