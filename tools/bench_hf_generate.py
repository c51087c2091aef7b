"""generate() of a copy-on transformers export with and without its KV cache: greedy, batch 1, a
prompt of --prompt tokens (a span said twice, so the copy head has something to copy) and
--new-tokens new ones (a benchmark: figures go to the console and JSON, never into a test).

    python tools/bench_hf_generate.py                                   # the tiny config, CPU
    python tools/bench_hf_generate.py --config cplm-135m --json out.json
    python tools/bench_hf_generate.py --config configs/quickstart.yaml --override copy.mix=joint
    python tools/bench_hf_generate.py --export hf/my-run                # an existing export directory
    python tools/bench_hf_generate.py --config configs/quickstart.yaml --peer   # and stock Llama, copy off

Without --export, the config's model (copy on, random weights) is built with cplm_dist and written
as tools/export_hf.py writes it (cplm_dist.interop.hf.directory.write_hf_dir), into a temporary directory; the
directory is then loaded as a user would (AutoModelForCausalLM, trust_remote_code=True). Each mode
runs --repeats times after one warm-up; the table shows the median, the positions the backbone was
fed in one generate (counted by a hook on it) and whether both modes chose the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def export(config: str, overrides: list[str], directory: Path, dtype: torch.dtype) -> None:
    """The config's copy-on model, random, exported into `directory` (as tools/export_hf.py does)."""
    from cplm_dist.config import load_config
    from cplm_dist.distributed import destroy_distributed, init_distributed
    from cplm_dist.interop.hf.directory import write_hf_dir
    from cplm_dist.model import build_model
    from cplm_dist.model.parallel.sharding import full_state_dict

    cfg = load_config(config, ["copy.enabled=true", *overrides])  # a later copy.enabled=false wins
    init_distributed(1)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    write_hf_dir(full_state_dict([model.state_dict()], model), cfg.model, cfg.copy, directory, dtype)
    destroy_distributed()


def time_generate(model, prompt: torch.Tensor, new_tokens: int, use_cache: bool, repeats: int) -> dict:
    """Median seconds of `repeats` greedy generates (after a warm-up), the positions fed to the
    backbone by one of them, and its tokens."""
    fed: list[int] = []
    hook = model.base_model.register_forward_pre_hook(lambda _m, _a, kw: fed.append(kw["input_ids"].shape[1]),
                                                      with_kwargs=True)
    kwargs = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
              "do_sample": False, "use_cache": use_cache}
    with torch.no_grad():
        tokens = model.generate(prompt, **kwargs)
        hook.remove()
        seconds = []
        for _ in range(repeats):
            if prompt.is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(prompt, **kwargs)
            if prompt.is_cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
    return {"seconds": statistics.median(seconds), "positions_fed": sum(fed), "forwards": len(fed),
            "tokens": tokens[0, prompt.shape[1]:].tolist()}


def stock_copy_off(args):
    """--peer: the same config copy off, exported (no remote code) and loaded as transformers'
    stock class of the backbone (LlamaForCausalLM for llama), its generation set as ours."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        export(args.config, [*args.override, "copy.enabled=false"], Path(tmp), DTYPES[args.dtype])
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=DTYPES[args.dtype])
    model = model.to(args.device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def check_copy_on_export(directory: Path) -> None:
    """--export is a copy-on export directory (config.json naming our remote class); else one line."""
    try:
        auto_map = json.loads((directory / "config.json").read_text()).get("auto_map", {})
    except (OSError, ValueError) as e:
        raise UsageError(f"--export {directory}: no readable config.json there ({type(e).__name__}): give a directory "
                         "written by tools/export_hf.py") from None
    if "AutoModelForCausalLM" not in auto_map:
        raise UsageError(f"--export {directory} is not a copy-on export (config.json has no auto_map to our remote "
                         "class): export a copy-on checkpoint, or leave out --export to build one")


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.export) if args.export else Path(tmp)
        if args.export:
            check_copy_on_export(directory)
        else:
            export(args.config, args.override, directory, DTYPES[args.dtype])
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=DTYPES[args.dtype])
    model = model.to(args.device).eval()
    model.generation_config.eos_token_id = None  # all --new-tokens, whatever is chosen
    model.generation_config.pad_token_id = 0
    vocab, limit = model.config.vocab_size, getattr(model.config, "max_position_embeddings", None)
    if limit is not None and args.prompt + args.new_tokens > limit:
        raise UsageError(f"--prompt {args.prompt} + --new-tokens {args.new_tokens} exceed the model's {limit} positions")
    span = torch.randint(1, vocab, (1, (args.prompt + 1) // 2), generator=torch.Generator().manual_seed(0))
    prompt = torch.cat([span, span], dim=1)[:, :args.prompt].to(args.device)
    modes = {name: time_generate(model, prompt, args.new_tokens, use_cache, args.repeats)
             for name, use_cache in (("cached", True), ("uncached", False))}
    if args.peer:
        modes["stock_copy_off"] = time_generate(stock_copy_off(args), prompt, args.new_tokens, True, args.repeats)
    return {"model": type(model).__name__, "config": args.export or args.config, "override": args.override,
            "params": sum(p.numel() for p in model.parameters()), "dtype": args.dtype, "device": args.device,
            "threads": torch.get_num_threads(), "prompt": args.prompt, "new_tokens": args.new_tokens,
            "repeats": args.repeats, "same_tokens": modes["cached"]["tokens"] == modes["uncached"]["tokens"],
            "speedup": modes["uncached"]["seconds"] / modes["cached"]["seconds"],
            **({"copy_on_vs_stock": modes["cached"]["seconds"] / modes["stock_copy_off"]["seconds"]} if args.peer else {}),
            "modes": {name: {k: v for k, v in m.items() if k != "tokens"} for name, m in modes.items()}}


def table(result: dict) -> str:
    lines = [f"{result['model']} ({result['config']}, {result['params'] / 1e6:.1f}M params, {result['dtype']}, "
             f"{result['device']}, {result['threads']} threads): prompt {result['prompt']}, {result['new_tokens']} new "
             f"tokens, greedy, batch 1, median of {result['repeats']}",
             f"{'mode':<9} {'seconds':>8} {'tokens/s':>9} {'forwards':>9} {'positions fed':>14}"]
    for name, m in result["modes"].items():
        lines.append(f"{name:<9} {m['seconds']:>8.3f} {result['new_tokens'] / m['seconds']:>9.1f} {m['forwards']:>9} "
                     f"{m['positions_fed']:>14}")
    lines.append(f"speedup {result['speedup']:.2f}x; same tokens: {'yes' if result['same_tokens'] else 'NO'}")
    if "copy_on_vs_stock" in result:
        lines.append(f"copy-on export / stock copy-off export (cached, seconds): {result['copy_on_vs_stock']:.3f}")
    return "\n".join(lines)


@exit_on_usage_error
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", help="a config name (tiny, cplm-135m, ...) or YAML path")
    p.add_argument("--override", action="append", default=[], help="a dotted config override, repeatable")
    p.add_argument("--export", help="an existing copy-on export directory instead of building one")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--peer", action="store_true", help="also the copy-off export of the same config as the backbone's "
                   "stock transformers class (cached): the copy head's cost through transformers")
    args = p.parse_args(argv)
    if args.prompt < 1 or args.new_tokens < 1 or args.repeats < 1:
        raise UsageError(f"--prompt {args.prompt}, --new-tokens {args.new_tokens}, --repeats {args.repeats}: each must be >= 1")
    if args.peer and args.export:
        raise UsageError("--peer builds both exports from --config: leave out --export")
    result = run(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
