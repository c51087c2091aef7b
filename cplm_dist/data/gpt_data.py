"""Train / valid / test datasets from the config's blend, through megatron-core's GPTDataset and
BlendedMegatronDatasetBuilder (document shuffling, sample packing across documents, weighted
blending and their on-disk index cache are theirs).

Ours are only the checks before megatron touches anything: the blend's globs and `weight: tokens`
are resolved (cplm_dist.data.blend), every prefix is validated
(cplm_dist.data.indexed_data), the tokenizer must fit the model's vocabulary, and each dataset
must have been made with that tokenizer's vocabulary.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from cplm_dist.config import Config, parse_split
from cplm_dist.config.curriculum import all_entries, stages_of
from cplm_dist.data.blend import resolve_blend
from cplm_dist.data.indexed_data import check_indexed_dataset, content_fingerprint, split_token_counts
from cplm_dist.data.node_local import copy_from_rank0, copy_plan
from cplm_dist.data.tokenizer import Tokenizer, check_tokenizer_fits_model, load_tokenizer
from cplm_dist.errors import DataError
from cplm_dist.megatron_compat import (BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig,
                                       convert_split_vector_to_split_matrix)

SPLITS = ("train", "valid", "test")


@dataclass
class Datasets:
    train: GPTDataset | None
    valid: GPTDataset | None
    test: GPTDataset | None
    tokenizer: Tokenizer


def tokenizer_for(cfg: Config) -> Tokenizer:
    if not cfg.data.tokenizer:
        raise DataError("data.tokenizer is not set: point it at the tokenizer the data was made with")
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_backend)
    check_tokenizer_fits_model(tok, cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tp)
    return tok


def check_data(cfg: Config, samples: tuple[int, int, int] = (0, 0, 0)) -> Tokenizer:
    """Everything about the data that can be wrong, checked before any of it is read; cfg's blend
    resolved in place (cplm_dist.data.blend: globs expanded, weights by tokens counted)."""
    d = cfg.data
    if not d.blend and not d.stages:
        raise DataError("data.blend is empty: add at least one {path: <prefix>, weight: 1.0} made by tools/preprocess_data.py")
    resolve_blend(cfg)
    tokenizer = tokenizer_for(cfg)
    fractions = parse_split(d.split)
    for name, n, frac in zip(SPLITS, samples, fractions):
        if n > 0 and frac == 0:
            raise DataError(f"{n} {name} samples requested but data.split={d.split!r} gives the {name} split no documents")
    bookends = convert_split_vector_to_split_matrix(fractions)
    for entry in {e.path: e for e in all_entries(cfg)}.values():  # every stage's (cplm_dist.config.curriculum)
        summary = check_indexed_dataset(entry.path, vocab_size=cfg.model.vocab_size, tokenizer_sha256=tokenizer.fingerprint)
        if d.document_mask and summary.append_eod is False:
            raise DataError(f"data.document_mask=true but dataset {entry.path} was made without end-of-document ids "
                            "(tools/preprocess_data.py --no-eod: append_eod false in its .meta.json), so no document "
                            "boundary can be found: re-run tools/preprocess_data.py without --no-eod, or set data.document_mask=false")
        # megatron repeats a split's documents until the samples are there: a split holding less
        # than one sample would make it loop forever
        for name, n, (docs, tokens) in zip(SPLITS, samples, split_token_counts(entry.path, bookends)):
            if n > 0 and tokens < d.seq_length + 1:
                raise DataError(f"dataset {entry.path}: data.split={d.split!r} gives its {name} split {docs} of its "
                                f"{summary.sequences} documents ({tokens} tokens), less than one sample of "
                                f"data.seq_length+1={d.seq_length + 1} tokens: give {name} a larger share of "
                                "data.split, lower data.seq_length, or add documents")
    return tokenizer


def check_index_cache(cache: Path) -> None:
    """megatron reads its index cache with numpy.load(allow_pickle=True): a cache shipped beside a
    dataset must hold plain integer arrays, never pickled Python objects (which would run code)."""
    import numpy as np

    for path in sorted(cache.glob("*.npy")) if cache.is_dir() else ():
        try:
            with open(path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                _, _, dtype = read_header(f)
        except (ValueError, OSError, SyntaxError):
            dtype = None
        if dtype is None or dtype.hasobject or dtype.kind not in "iu":
            raise DataError(f"index cache {path} is not an integer array ({dtype}): the run did not write it and it "
                            f"may hold pickled code; delete {cache} (it is rebuilt from the data)")


def build_datasets(cfg: Config, samples: tuple[int, int, int], tokenizer: Tokenizer | None = None,
                   stage: int | None = None) -> Datasets:
    """(train, valid, test) with exactly `samples` samples each (0 -> that split is None), from
    the blend of data stage `stage` (cplm_dist.config.curriculum; default the last, whose blend validation
    reads; data.blend is the one stage), shuffled by data.seed + the stage's index.

    Call on every rank after the process group exists; rank 0 builds megatron's index cache
    first and the others read it (from a copy on their own host when data.cache_dir is
    node-local). `tokenizer`: what check_data(cfg, samples) returned, when the caller already
    checked the data (so that nothing is loaded or scanned twice); else it is run here.
    """
    if tokenizer is None:
        tokenizer = check_data(cfg, samples)
    resolve_blend(cfg)  # a no-op after check_data
    if not dist.is_initialized():
        raise RuntimeError("build_datasets needs a process group (megatron's builder synchronises ranks): "
                           "call cplm_dist.distributed.init_distributed first")
    d = cfg.data
    logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)
    stages = stages_of(cfg)
    stage = len(stages) - 1 if stage is None else stage
    blend = stages[stage].blend
    paths = [e.path for e in blend]
    weights = [e.weight for e in blend] if len(paths) > 1 else None
    # megatron keys its cache on paths, seed, split, lengths and tokenizer, not on the contents: a
    # dataset rebuilt in place (preprocess --overwrite) would reuse stale indices. One cache
    # directory per content fingerprint of the blend keeps them apart.
    fingerprint = hashlib.sha256("".join(content_fingerprint(p) for p in paths).encode()).hexdigest()[:16]
    cache = str(Path(d.cache_dir or Path(paths[0]).parent / "index-cache") / fingerprint)
    check_index_cache(Path(cache))
    config = GPTDatasetConfig(
        random_seed=d.seed + stage,
        sequence_length=d.seq_length,
        blend=(paths, weights),
        split=d.split,
        path_to_cache=cache,
        tokenizer=tokenizer,
        # data.document_mask: positions restart after each end-of-document id (the model derives the
        # block-causal mask from them: megatron's own (T, T) mask a sample is never made)
        reset_position_ids=d.document_mask,
        reset_attention_mask=False,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=False,  # causal attention is built into the model
        mid_level_dataset_surplus=0.005,
    )
    # A weighted blend needs an explicit size for every split (0, not None).
    sizes = [int(n) for n in samples]
    try:
        # a node-local cache (data.cache_dir on a host's own disk): rank 0 builds it, each other
        # host gets a copy (its first rank writes it), then every rank loads (cplm_dist.data.node_local)
        writers = copy_plan(Path(cache)) if dist.get_world_size() > 1 else {}
        if writers:
            BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: dist.get_rank() == 0, config).build()
            copy_from_rank0(Path(cache), writers)
        built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    except (AssertionError, IndexError, ValueError) as e:
        raise DataError(f"could not build datasets from data.blend ({type(e).__name__}: {e}); "
                        "a split may hold too few documents for data.split / data.seq_length") from None
    return Datasets(*[ds if n > 0 else None for ds, n in zip(built, samples)], tokenizer=tokenizer)
