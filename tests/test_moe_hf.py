"""Hugging Face both ways for a sparse model (model.moe): a random transformers Qwen3MoeForCausalLM
imports (model.init_from) with its own log-probabilities at ep 1, at ep 2 (each rank its own experts)
and at tp 2 with sequence parallelism; a copy-off sparse model exports as a stock
Qwen3MoeForCausalLM, a copy-on run (tools/export_hf.py) as the remote CPLMQwen3ForCausalLM whose
sparse layers are transformers' Qwen3MoeSparseMoeBlock, both with our log-probabilities; what
Qwen3-MoE does not compute is one line both ways. A sparse llama is a Mixtral both ways (copy
off). The dense side: tests/test_hf.py."""

import json
from pathlib import Path

import pytest
import torch

from cplm_dist.config import load_config
from tests.spawn import run_ranks
from tests.test_hf import _hf_model, _ids
from tests.test_train import argv, train

REPO = Path(__file__).resolve().parent.parent
# 3 layers, the first dense (mlp_only_layers [0]: model.moe.first_dense_layers=1), 4 experts of width 32, top 2
MOE = ["model.arch=qwen3", "model.num_layers=3", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
       "model.head_dim=16", "model.ffn_hidden_size=96", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.moe.ffn_hidden_size=32", "model.moe.first_dense_layers=1", "model.tie_embeddings=false"]
COPY_OFF = [*MOE, "copy.enabled=false"]


def _logprobs(model_dir: Path, ids: torch.Tensor, remote: bool = False) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(_hf_model(model_dir, remote)(input_ids=ids).logits.float(), dim=-1)


def _saved_with_live_router(make_model, directory, seed: int) -> None:
    """A random HF sparse model saved with norms away from 1 and a router that routes: transformers
    starts the router at zero (every expert tied), which would hide a wrong expert order."""
    torch.manual_seed(seed)
    model = make_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif ".gate.weight" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """A random transformers Qwen3-MoE (random norms and router too), saved with save_pretrained,
    and its log-probabilities of _ids(512)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    directory = tmp_path_factory.mktemp("moe") / "qwen3-moe"
    config = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
                            tie_word_embeddings=False)
    _saved_with_live_router(lambda: Qwen3MoeForCausalLM(config), directory, seed=5)
    return directory, _logprobs(directory, _ids(512))


def _import_worker(directory, tp, ep, export_to=None, overrides=COPY_OFF):
    """The model built at this tp / ep, initialised from the directory as training does; its
    log-probs; at ep 1 tp 1 also exported copy-off into `export_to` (write_hf_dir, as tools/export_hf.py)."""
    from cplm_dist.distributed import init_distributed
    from cplm_dist.interop.hf.directory import write_hf_dir
    from cplm_dist.interop.init_from import initialise_from
    from cplm_dist.model import build_model
    from cplm_dist.model.parallel.sharding import full_state_dict

    dims = init_distributed(tp, ep_size=ep)
    cfg = load_config("tiny", [*overrides, f"parallel.tp={tp}", f"parallel.ep={ep}", f"parallel.sequence_parallel={tp > 1}",
                               f"model.init_from={directory}"])
    model = build_model(cfg)
    assert initialise_from(model, cfg, dims.tp_rank, dims.tp_size).kind == "hf"
    experts = sorted({p.expert_id for p in model.parameters() if hasattr(p, "expert_id")})
    model.eval()
    with torch.no_grad():  # the training forward: a sequence-parallel model only trains (no decode state)
        lm_nll = model(_ids(512)).lm_nll[:, :-1]
    logprobs = None if cfg.parallel.sequence_parallel else model.next_token_logprobs(_ids(512))
    if export_to is not None:
        Path(export_to).mkdir()
        write_hf_dir(full_state_dict([model.state_dict()], model), cfg.model, cfg.copy, Path(export_to), torch.float32)
    return {"logprobs": logprobs, "lm_nll": lm_nll, "experts": experts}


def _nll(logprobs: torch.Tensor) -> torch.Tensor:
    """-log p of each next token of _ids(512) under `logprobs` (B, T, V)."""
    ids = _ids(512)
    return -logprobs[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_a_transformers_qwen3_moe_imports_at_ep_1_and_exports_as_one(hf_moe, tmp_path):
    """ep 1: its log-probs; exported again (copy off) it is a stock Qwen3MoeForCausalLM with them,
    its tensors the source's."""
    from safetensors.torch import load_file

    directory, want = hf_moe
    (r,) = run_ranks(_import_worker, 1, args=(directory, 1, 1, str(tmp_path / "out")))
    torch.testing.assert_close(r["logprobs"], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r["lm_nll"], _nll(want), rtol=1e-5, atol=1e-5)
    assert r["experts"] == [0, 1, 2, 3]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["mlp_only_layers"] == [0]
    torch.testing.assert_close(_logprobs(tmp_path / "out", _ids(512)), want, rtol=1e-5, atol=1e-5)
    source, exported = load_file(str(directory / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(source) == sorted(exported)
    for name, tensor in source.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("tp, ep", [(1, 2), (2, 1)], ids=["ep2", "tp2-sp"])
def test_a_transformers_qwen3_moe_imports_at_ep_2_and_tp_2(hf_moe, tp, ep):
    """2 ranks: at ep 2 each takes its own experts (by global id), at tp 2 (sequence parallel)
    each its shard of every expert; both give transformers' log-probs (at tp 2 through the training
    forward's NLL: a sequence-parallel model does not decode)."""
    directory, want = hf_moe
    ranks = run_ranks(_import_worker, 2, args=(directory, tp, ep))
    for rank, r in enumerate(ranks):
        torch.testing.assert_close(r["lm_nll"], _nll(want), rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
        if r["logprobs"] is not None:
            torch.testing.assert_close(r["logprobs"], want, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
    assert [r["experts"] for r in ranks] == ([[0, 1], [2, 3]] if ep == 2 else [[0, 1, 2, 3]] * 2)


# --- a copy-on sparse run, exported by tools/export_hf.py through the remote class --------------------


def _load_and_export_worker(checkpoint, out):
    """The run's model as evaluation loads it: its log-probs, and tools/export_hf.py's export of it."""
    from cplm_dist.checkpoint import load_model
    from cplm_dist.distributed import init_distributed
    from cplm_dist_tools.export_hf import export

    init_distributed(1)
    model, cfg, _ = load_model(checkpoint)
    span = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(6))
    ids = torch.cat([span, span], dim=1)  # repeats, so the copy head has matches
    export(checkpoint, Path(out), "fp32")
    return {"ids": ids, "logprobs": model.next_token_logprobs(ids)}


def test_a_copy_on_sparse_run_exports_through_the_remote_class(hf_moe, small_data, tmp_path):
    """A copy-on run started from the Qwen3-MoE (one step at a negligible lr), exported: the
    remote class (trust_remote_code) builds Qwen3MoeSparseMoeBlock in the sparse layers and gives
    our mixture's log-probs."""
    run, out = tmp_path / "run", tmp_path / "exported"
    assert train(1, argv(small_data, run, "train.train_steps=1", "train.save_interval=1", "optim.lr=1e-30",
                         "optim.min_lr=0", "optim.warmup_steps=0", "optim.weight_decay=0", "model.moe.aux_loss_coeff=0",
                         f"model.init_from={hf_moe[0]}", *MOE)) == [0]
    (ours,) = run_ranks(_load_and_export_worker, 1, args=(str(run), str(out)))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["CPLMQwen3ForCausalLM"] and config["num_experts"] == 4
    hf = _hf_model(out, remote=True)
    assert [type(layer.mlp).__name__ for layer in hf.model.layers] == ["Qwen3MLP", "SparseBlock", "SparseBlock"]
    with torch.no_grad():
        got = torch.log_softmax(hf(input_ids=ours["ids"]).logits.float(), dim=-1)
    torch.testing.assert_close(got, ours["logprobs"], rtol=1e-5, atol=1e-5)


# --- what Qwen3-MoE does not compute: one line each ------------------------------------------------


def test_what_qwen3_moe_does_not_compute_is_one_line(hf_moe, tmp_path):
    from cplm_dist.errors import ConfigError, HFImportError
    from cplm_dist.interop.hf.directory import check_hf_dir, write_configs

    directory, where = hf_moe[0], f"model.init_from={hf_moe[0]}"
    check_hf_dir(directory, load_config("tiny", COPY_OFF).model)
    cases = [
        (["model.moe.first_dense_layers=0"], "sparse layers [1, 2] (decoder_sparse_step=1, mlp_only_layers=[0]) but "
         "model.moe gives [0, 1, 2]: set model.moe.first_dense_layers=1 model.moe.layer_freq=1"),
        (["model.moe.top_k=3"], "num_experts_per_tok=2 but the run's model.moe.top_k is 3: set model.moe.top_k=2"),
        (["model.moe.normalize=false"], "norm_topk_prob=true but the run's model.moe.normalize is false: set "
         "model.moe.normalize=true"),
        (["model.moe.ffn_hidden_size=64"], "moe_intermediate_size=32 but the run's model.moe.ffn_hidden_size is 64: set "
         "model.moe.ffn_hidden_size=32"),
        (["model.moe.shared_ffn_hidden_size=32"], "model.moe.shared_ffn_hidden_size=32; Qwen3-MoE has no shared expert: "
         "set model.moe.shared_ffn_hidden_size=0"),
        (["model.moe.num_experts=0"], "its model_type is qwen3_moe (a mixture of experts), which a dense model.arch=qwen3 "
         "does not read: set model.arch=qwen3 model.moe.num_experts=4"),
    ]
    for overrides, line in cases:
        with pytest.raises(HFImportError) as e:
            check_hf_dir(directory, load_config("tiny", [*COPY_OFF, *overrides]).model)
        assert str(e.value) == f"{where}: {line}", overrides
    # a layout no first_dense_layers / layer_freq gives
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "model.safetensors").symlink_to(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [2]}))
    with pytest.raises(HFImportError, match=r"sparse layers \[0, 1\] .*which no model.moe.first_dense_layers and "
                                            r"layer_freq give .*: not importable$"):
        check_hf_dir(odd, load_config("tiny", COPY_OFF).model)
    # export: a sigmoid router is no Qwen3-MoE; a sparse gpt2 has no HF class
    with pytest.raises(ConfigError, match=r"^not exportable as Qwen3-MoE: model.moe.score=sigmoid; .*set model.moe.score=softmax$"):
        cfg = load_config("tiny", [*COPY_OFF, "model.moe.score=sigmoid"])
        write_configs(cfg.model, cfg.copy, tmp_path, torch.float32)
    with pytest.raises(ConfigError, match=r"^model.arch=gpt2 with model.moe has no Hugging Face class here: a sparse "
                                          r"model imports and exports as model.arch=llama \(Mixtral\) or qwen3 \(Qwen3-MoE\)$"):
        cfg = load_config("tiny", ["model.arch=gpt2", "model.moe.num_experts=4", "copy.enabled=false"])
        write_configs(cfg.model, cfg.copy, tmp_path, torch.float32)


# --- Mixtral: a sparse llama ----------------------------------------------------------------------

MIXTRAL = ["model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2", "model.moe.num_experts=4",
           "model.moe.top_k=2", "model.moe.ffn_hidden_size=32", "model.tie_embeddings=false", "copy.enabled=false"]


def test_a_transformers_mixtral_imports_and_exports_as_a_sparse_llama(tmp_path):
    """A random MixtralForCausalLM (block_sparse_moe, experts' w1 / w3 / w2) into model.arch=llama
    with model.moe, at ep 1: its log-probs; exported again: a stock Mixtral with them. A copy head
    has no Mixtral class: one line."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from cplm_dist.errors import ConfigError
    from cplm_dist.interop.hf.directory import write_configs

    config = MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
                           rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False)
    _saved_with_live_router(lambda: MixtralForCausalLM(config), tmp_path / "mixtral", seed=7)
    want = _logprobs(tmp_path / "mixtral", _ids(512))
    (r,) = run_ranks(_import_worker, 1, args=(tmp_path / "mixtral", 1, 1, str(tmp_path / "out"), MIXTRAL))
    torch.testing.assert_close(r["logprobs"], want, rtol=1e-5, atol=1e-5)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    torch.testing.assert_close(_logprobs(tmp_path / "out", _ids(512)), want, rtol=1e-5, atol=1e-5)
    cfg = load_config("tiny", [*MIXTRAL, "copy.enabled=true"])
    with pytest.raises(ConfigError, match=r"^a copy-on model does not export as Mixtral \(no remote class for it yet\)"):
        write_configs(cfg.model, cfg.copy, tmp_path, torch.float32)
