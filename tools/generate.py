"""Generate text from a checkpoint: greedy or sampled, from the mixed copy/LM distribution.

    python tools/generate.py --checkpoint runs/quickstart-20261130-030950 --prompt "def __init__(self"
    python tools/generate.py --checkpoint runs/x --prompt "Items: a, b" --temperature 0.8 --top-p 0.95 --mark-copies
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/generate.py --checkpoint runs/tp2-run --prompt "..."

With --mark-copies, tokens the copy head gave most of their probability are shown in [brackets].
Decoding runs the static-cache decoder with its compiled step (cplm_dist.model.static_decode;
--no-compile: eager); on tp ranks every rank samples the same token.
"""

from __future__ import annotations

import argparse
import sys

import torch

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError


@exit_on_usage_error
def main(argv=None) -> int:
    from cplm_dist.checkpoint import load_checkpoint_config, load_model
    from cplm_dist.data.tokenizer import check_tokenizer_fits_model, load_tokenizer
    from cplm_dist.distributed import destroy_distributed, evaluation_tp, init_distributed
    from cplm_dist.evaluation.generation import device_of, generate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mark-copies", action="store_true")
    p.add_argument("--tokenizer", help="default: the run's data.tokenizer")
    p.add_argument("--no-compile", action="store_true", help="decode eager (default: the compiled step where "
                   "torch.compile works; CPLM_DECODE_COMPILE=0 does the same)")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}, --temperature {args.temperature}, --top-k {args.top_k}, "
                         f"--top-p {args.top_p}: need max-new-tokens >= 1, temperature >= 0 (0: greedy), top-k >= 0 "
                         "(0: off) and 0 < top-p <= 1")
    _, info = load_checkpoint_config(args.checkpoint)
    dims = init_distributed(evaluation_tp(info["layout"]["tp"]))
    model, cfg, info = load_model(args.checkpoint)
    tok_path = args.tokenizer or cfg.data.tokenizer
    if not tok_path:
        raise UsageError("the run has no data.tokenizer: pass --tokenizer")
    tok = load_tokenizer(tok_path, cfg.data.tokenizer_backend)
    check_tokenizer_fits_model(tok, cfg.model.vocab_size)
    for i, prompt in enumerate(args.prompt):
        ids = tok.encode(prompt)
        if not ids or len(ids) + args.max_new_tokens > cfg.model.max_seq_len:
            raise UsageError(f"prompt {i}: {len(ids)} tokens + --max-new-tokens {args.max_new_tokens} must be in 1.."
                             f"{cfg.model.max_seq_len} (model.max_seq_len)")
        out = generate(model, torch.tensor([ids], device=device_of(model)), args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, eos_id=tok.eod, seed=args.seed, mark_copies=args.mark_copies,
                       compile=False if args.no_compile else None)
        tokens = out.tokens[0].tolist()
        if tok.eod in tokens:
            tokens = tokens[: tokens.index(tok.eod)]
        if args.mark_copies and out.copied is not None:
            pieces = [f"[{tok.decode([t])}]" if c else tok.decode([t]) for t, c in zip(tokens, out.copied[0].tolist())]
            text = "".join(pieces)
            share = f"  ({sum(out.copied[0].tolist()[: len(tokens)])}/{len(tokens)} tokens mostly copied)"
        else:
            text, share = tok.decode(tokens), ""
        if dims.is_first:
            print(f"--- prompt {i}{share}\n{prompt}{text}")
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
