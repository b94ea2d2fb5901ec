"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) through the real scheduler and model runner,
against transformers: embeddings pooled from the bidirectional encoder, and the class logits of
their sequence classifiers, with BERT's token types for sentence pairs."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    BertConfig,
    GteConfig,
    JinaEmbeddingsV3Config,
    ModernBertConfig,
    NomicBertConfig,
    RobertaConfig,
    XLMRobertaConfig,
)

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.scheduler import Scheduler
from gpu_worker.config import ModelConfig
from tests.gpu_worker.utils import make_runner, run_to_completion, two_tp_ranks

_CONFIGS = {"bert": BertConfig, "roberta": RobertaConfig, "xlm-roberta": XLMRobertaConfig,
            "modernbert": ModernBertConfig, "nomic": NomicBertConfig, "gte": GteConfig, "jina": JinaEmbeddingsV3Config}


def save_tiny_encoder(path, kind: str, num_labels: int = 0, seed: int = 0, per_token: bool = False, **overrides):
    """A random-weight encoder checkpoint: the bare model (AutoModel, saved with BERT's pooler) or,
    with ``num_labels``, its *ForSequenceClassification (``per_token``: *ForTokenClassification).
    Biases and LayerNorms are random too.
    ModernBERT: three layers (two windowed, of 8 tokens each side), with biases, so that all of them
    are read."""
    roberta = kind in ("roberta", "xlm-roberta")
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64 + (2 if roberta else 0), type_vocab_size=1 if roberta else 2,
              pad_token_id=1 if roberta else 0, num_labels=max(num_labels, 1))
    if kind in ("gte", "jina"):  # (gte-multilingual-base's and jina-embeddings-v3's one token type)
        kw["type_vocab_size"] = 1
    if kind == "modernbert":
        kw.update(num_hidden_layers=3, local_attention=16, global_attn_every_n_layers=3, norm_bias=True,
                  attention_bias=True, mlp_bias=True, classifier_bias=True, global_rope_theta=1000.0,
                  local_rope_theta=100.0)
        del kw["type_vocab_size"]
    kw.update(overrides)
    torch.manual_seed(seed)
    auto = (AutoModelForTokenClassification if per_token else
            AutoModelForSequenceClassification if num_labels else AutoModel)
    model = auto.from_config(_CONFIGS[kind](**kw), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("LayerNorm.weight") else 0.0, 0.2 if p.dim() > 1 else 0.3)
    model.save_pretrained(path)
    return path, model.eval()


def encoder_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_model_len: int = 64,
                      chunked: bool = False) -> Scheduler:
    """The scheduler as an engine sets it up for an encoder (whole prompts, no prefix cache); with
    ``chunked``, as it would be for a decoder."""
    return Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=max_model_len,
                                     enable_chunked_prefill=chunked),
                     CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=chunked),
                     log_stats=False)


def pooled_outputs(runner, prompts: dict[str, list[int]], pooling: str = "CLS",
                   type_starts: dict[str, int] | None = None, execute=None, **sched) -> dict[str, list[float]]:
    """Each prompt's pooled output through the real scheduler; with a runner, attended both ways (one
    prompt after another, the CPU's default, and in padded batches, CUDA's), which must agree."""
    if runner is None:
        return _pooled_outputs(prompts, pooling, type_starts, execute, sched)
    runner.encoder_batches_padded = True
    padded = _pooled_outputs(prompts, pooling, type_starts, execute or runner.execute_model, sched)
    runner.encoder_batches_padded = None
    outputs = _pooled_outputs(prompts, pooling, type_starts, execute or runner.execute_model, sched)
    for rid in prompts:
        torch.testing.assert_close(torch.tensor(padded[rid]), torch.tensor(outputs[rid]), atol=1e-5, rtol=1e-5)
    return outputs


def _pooled_outputs(prompts: dict[str, list[int]], pooling: str, type_starts: dict[str, int] | None, execute,
                    sched: dict) -> dict[str, list[float]]:
    scheduler = encoder_scheduler(**sched)
    for rid, prompt in prompts.items():
        params = SamplingParams(max_tokens=1, temperature=0.0, embed=True, embed_normalize=False,
                                embed_pooling=pooling,
                                compressed_token_type_ids=(type_starts or {}).get(rid))
        scheduler.add_request(Request(rid, prompt, params, eos_token_id=None))
    outputs = {}
    run_to_completion(scheduler, execute, on_output=lambda o: outputs.update({o.request_id: o.pooling_output}))
    return outputs


def assert_pooled_as_transformers(runner, hf, prompts: dict[str, list[int]], pooling: str) -> None:
    """Each prompt's pooled embedding, all run in one pass, equals transformers' encoder output pooled."""
    outputs = pooled_outputs(runner, prompts, pooling)
    for rid, prompt in prompts.items():
        with torch.no_grad():
            states = hf(torch.tensor([prompt])).last_hidden_state[0]
        expected = {"CLS": states[0], "MEAN": states.mean(0), "LAST": states[-1]}[pooling]
        torch.testing.assert_close(torch.tensor(outputs[rid]), expected, atol=1e-4, rtol=1e-4)


def random_prompts(count: int, seed: int, max_len: int = 40) -> dict[str, list[int]]:
    # (Ids from 5 up: RoBERTa numbers positions past its padding id 1, which must not occur.)
    rng = random.Random(seed)
    return {f"p{i}": [rng.randrange(5, 250) for _ in range(rng.randrange(1, max_len))] for i in range(count)}


@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta", "modernbert", "nomic", "gte", "jina"])
@pytest.mark.parametrize("pooling", ["CLS", "MEAN", "LAST"])
def test_embeddings_match_transformers(tmp_path, kind, pooling):
    """Several prompts of different lengths (one of a single token) in one pass, each attending to
    its own tokens both ways, pooled as asked, equal transformers' encoder output."""
    path, hf = save_tiny_encoder(tmp_path, kind)
    config = ModelConfig.from_pretrained(path)
    assert config.encoder_only and config.embedding_only and config.labels == ()
    assert config.architecture == {"bert": "BertModel", "modernbert": "ModernBertModel", "nomic": "NomicBertModel",
                                   "gte": "GteModel", "jina": "JinaEmbeddingsV3Model"}.get(kind, "RobertaModel")
    assert config.max_context_len == 64  # (RoBERTa's table holds 66 rows; positions start at row 2)
    runner = make_runner(path, num_blocks=64, block_size=4)
    # (The checkpoint's pooler is not what embeddings read.)
    assert getattr(runner.model.model, "pooler", None) is None
    # (Prompts up to 40 tokens: longer than ModernBERT's window of 17.)
    prompts = {**random_prompts(5, seed=3), "single": [42]}
    assert_pooled_as_transformers(runner, hf, prompts, pooling)


# (ModernBERT's defaults have no biases anywhere: the last case keeps them.)
_MODERNBERT_DEFAULTS = {"norm_bias": False, "attention_bias": False, "mlp_bias": False, "classifier_bias": False}


@pytest.mark.parametrize(("kind", "num_labels", "overrides"), [
    ("bert", 3, {}), ("bert", 1, {}), ("roberta", 2, {}), ("xlm-roberta", 1, {}),
    ("modernbert", 2, {}), ("modernbert", 1, {"classifier_pooling": "mean"}),
    ("modernbert", 3, _MODERNBERT_DEFAULTS), ("nomic", 2, {}), ("gte", 1, {})])
def test_classifier_logits_match_transformers(tmp_path, kind, num_labels, overrides):
    """BertForSequenceClassification (pooler + classifier over [CLS]), RoBERTa's classification head
    and ModernBERT's (head + classifier over its classifier_pooling); BERT's sentence pairs with
    token type 1 from the second text on (compressed_token_type_ids)."""
    path, hf = save_tiny_encoder(tmp_path, kind, num_labels=num_labels, **overrides)
    config = ModelConfig.from_pretrained(path)
    assert len(config.labels) == num_labels and config.encoder_only
    pooling = config.default_pooling_type
    assert pooling == ("MEAN" if overrides.get("classifier_pooling") == "mean" else "CLS")
    runner = make_runner(path, num_blocks=64, block_size=4)
    prompts = random_prompts(6, seed=4)
    rng = random.Random(5)
    type_starts = ({rid: rng.randrange(len(p) + 1) for rid, p in prompts.items() if len(p) > 2}
                   if kind in ("bert", "nomic") else {})
    outputs = pooled_outputs(runner, prompts, pooling, type_starts)
    for rid, prompt in prompts.items():
        types = torch.zeros(1, len(prompt), dtype=torch.long)
        if rid in type_starts:
            types[0, type_starts[rid]:] = 1
        with torch.no_grad():
            expected = hf(torch.tensor([prompt]), **({"token_type_ids": types} if kind != "modernbert" else {})
                          ).logits[0]
        torch.testing.assert_close(torch.tensor(outputs[rid]), expected, atol=1e-4, rtol=1e-4)
    if kind == "bert" and num_labels == 3:  # (types that matter: the same pair as all type 0 differs)
        rid = next(iter(type_starts))
        plain = pooled_outputs(runner, {rid: prompts[rid]}, "CLS")
        assert not torch.allclose(torch.tensor(plain[rid]), torch.tensor(outputs[rid]), atol=1e-3)


@pytest.mark.parametrize(("kind", "num_labels"), [("bert", 5), ("roberta", 3), ("xlm-roberta", 2),
                                                ("modernbert", 4), ("nomic", 3), ("gte", 2)])
def test_token_classifier_logits_match_transformers(tmp_path, kind, num_labels):
    """*ForTokenClassification (NER): every prompt token's class logits (ModernBERT's through its
    head), flattened, as transformers computes them."""
    path, hf = save_tiny_encoder(tmp_path, kind, num_labels=num_labels, per_token=True)
    config = ModelConfig.from_pretrained(path)
    assert config.token_classifier and len(config.labels) == num_labels
    runner = make_runner(path, num_blocks=64, block_size=4)
    assert getattr(runner.model.model, "pooler", None) is None
    prompts = {**random_prompts(5, seed=9), "single": [11]}
    outputs = pooled_outputs(runner, prompts, config.default_pooling_type)
    for rid, prompt in prompts.items():
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        got = torch.tensor(outputs[rid]).view(len(prompt), num_labels)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(5))
def test_a_pass_is_attended_in_padded_batches_of_similar_lengths(seed):
    """Every prompt row is read and written back once; a batch's padding stays within a quarter of
    its tokens (a prompt alone is never padded); padded keys are masked, and windows fold into it."""
    from gpu_worker.encoder_metadata import EncoderMetadata

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, size=int(rng.integers(2, 40)))
    qsl = np.concatenate([[0], np.cumsum(lengths)])
    meta = EncoderMetadata.build(qsl, torch.device("cpu"), padded=True)
    written = np.concatenate([b.real_rows.numpy() for b in meta.batches])
    assert sorted(written.tolist()) == list(range(int(qsl[-1])))
    for batch in meta.batches:
        real = batch.real_rows.numel()
        assert batch.batch == 1 or batch.batch * batch.length <= 1.25 * real
        assert batch.gather_rows[batch.real_slots].tolist() == batch.real_rows.tolist()
        if batch.key_mask is not None:
            assert int(batch.key_mask.sum()) == real
            windowed = batch.mask(2)
            if batch.length > 3:
                assert windowed.shape == (batch.batch, 1, batch.length, batch.length)
                assert not (windowed & ~batch.key_mask).any()
    assert EncoderMetadata.build(np.array([0, 7]), torch.device("cpu"), padded=True).batches == []
    # (On the CPU, by default, prompts are attended one after another where they lie.)
    spans = EncoderMetadata.build(qsl, torch.device("cpu"))
    assert spans.batches == [] and spans.spans == list(zip(qsl[:-1].tolist(), qsl[1:].tolist(), strict=True))


@pytest.mark.parametrize("pooling", ["MEAN", "CLS", "LAST"])
def test_embeddinggemma_attends_both_ways_as_transformers(tmp_path, pooling):
    """EmbeddingGemma: Gemma 3 with use_bidirectional_attention, run as an encoder (whole prompts,
    no KV cache): full layers see the whole prompt, windowed ones |i - j| < sliding_window // 2 + 1;
    grouped-query attention (one KV head for four query heads); local and global RoPE."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    config = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24,
                              sliding_window=12, sliding_window_pattern=3, max_position_embeddings=128,
                              use_bidirectional_attention=True, initializer_range=0.2,
                              architectures=["Gemma3TextModel"])
    torch.manual_seed(7)
    hf = Gemma3TextModel(config).eval()
    ours = _saved_with_random_norms(hf, tmp_path, norm_mean=0.0)  # (Gemma's norms scale by 1 + w)
    assert ours.encoder_only and ours.embedding_only and ours.sliding_window == 6
    assert ours.sliding_window_layers == (True, True, False)
    _assert_run_as_an_encoder_as_transformers(tmp_path, hf, pooling, seed=8)


def _saved_with_random_norms(hf, path, norm_mean: float) -> ModelConfig:
    """Save a decoder-block model with random norm weights (else left at their init, a norm applied
    wrongly could pass), and read its config as ours."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(norm_mean, 0.5)
    hf.save_pretrained(path)
    return ModelConfig.from_pretrained(path)


def _assert_run_as_an_encoder_as_transformers(path, hf, pooling: str, seed: int) -> None:
    """The saved model runs with no KV cache, and pools prompts as transformers' model does."""
    runner = make_runner(path, num_blocks=64, block_size=4)
    assert runner.kv_caches == []
    assert_pooled_as_transformers(runner, hf, {**random_prompts(5, seed=seed), "single": [9]}, pooling)


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_eurobert_attends_both_ways_as_transformers(tmp_path, pooling):
    """EuroBERT: the Llama block (RMSNorm, RoPE, gated SiLU MLP, grouped-query attention) attending
    both ways, run as an encoder; MEAN pooling by default."""
    from transformers import EuroBertConfig, EuroBertModel

    config = EuroBertConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                            initializer_range=0.2, architectures=["EuroBertModel"], pad_token_id=0, bos_token_id=1,
                            eos_token_id=2, mask_token_id=3)
    torch.manual_seed(3)
    hf = EuroBertModel(config).eval()
    ours = _saved_with_random_norms(hf, tmp_path, norm_mean=1.0)
    assert ours.encoder_only and ours.embedding_only and ours.default_pooling_type == "MEAN"
    assert ours.rope_theta == config.rope_parameters["rope_theta"]
    _assert_run_as_an_encoder_as_transformers(tmp_path, hf, pooling, seed=10)


def test_a_prompt_scheduled_in_chunks_is_refused(tmp_path):
    """An encoder cannot attend to keys of a chunk it does not see: the runner refuses a prompt the
    scheduler split (the engine never schedules one so; see EngineCore)."""
    path, _ = save_tiny_encoder(tmp_path, "bert")
    runner = make_runner(path, num_blocks=64, block_size=4)
    with pytest.raises(ValueError, match="an encoder runs a prompt whole in one pass"):
        pooled_outputs(runner, {"long": list(range(5, 30))}, budget=8, chunked=True)


def test_encoder_configs():
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4}
    bert = ModelConfig.from_dict({**base, "architectures": ["BertModel"]})
    assert (bert.max_context_len, bert.position_offset, bert.type_vocab_size, bert.layer_norm_eps) == (512, 0, 2, 1e-12)
    xlmr = ModelConfig.from_dict({**base, "architectures": ["XLMRobertaModel"], "max_position_embeddings": 8194,
                                  "pad_token_id": 1, "type_vocab_size": 1, "layer_norm_eps": 1e-5})
    # bge-m3: 8194 rows, positions from row 2: 8192 tokens.
    assert (xlmr.architecture, xlmr.max_context_len, xlmr.position_offset) == ("RobertaModel", 8192, 2)
    reranker = ModelConfig.from_dict({**base, "architectures": ["XLMRobertaForSequenceClassification"],
                                      "num_labels": 1, "max_position_embeddings": 514})
    assert reranker.labels == ("LABEL_0",) and reranker.cross_encoder_activation == "sigmoid"
    ms_marco = ModelConfig.from_dict({**base, "architectures": ["BertForSequenceClassification"], "num_labels": 1,
                                      "sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"})
    assert ms_marco.cross_encoder_activation == "none" and ms_marco.labels == ("LABEL_0",)
    # (A RoBERTa config may say "pad_token_id": null: transformers' default padding id 1.)
    assert ModelConfig.from_dict({**base, "architectures": ["RobertaModel"], "pad_token_id": None,
                                  "max_position_embeddings": 514}).max_context_len == 512
    with pytest.raises(ValueError, match="position_embedding_type must be 'absolute'"):
        ModelConfig.from_dict({**base, "architectures": ["BertModel"], "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="is_decoder / add_cross_attention"):
        ModelConfig.from_dict({**base, "architectures": ["BertModel"], "is_decoder": True})
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        ModelConfig.from_dict({**base, "architectures": ["BertModel"], "hidden_act": "relu"})
    # gte-modernbert-base's config (transformers 4.x keys), and 5.x's layer_types / rope_parameters.
    modern = {**base, "architectures": ["ModernBertModel"], "num_hidden_layers": 22, "global_attn_every_n_layers": 3,
              "local_attention": 128, "global_rope_theta": 160000.0, "local_rope_theta": 10000.0,
              "max_position_embeddings": 8192, "norm_eps": 1e-5, "norm_bias": False, "hidden_activation": "gelu",
              "classifier_pooling": "mean"}
    gte = ModelConfig.from_dict(modern)
    assert (gte.max_context_len, gte.sliding_window, gte.rope_theta, gte.local_rope_theta) == (8192, 64, 160000.0,
                                                                                                10000.0)
    assert [i for i, windowed in enumerate(gte.sliding_window_layers) if not windowed] == [0, 3, 6, 9, 12, 15, 18, 21]
    assert (gte.default_pooling_type, gte.norm_bias, gte.qkv_bias, gte.mlp_bias) == ("CLS", False, False, False)
    assert ModelConfig.from_dict({**modern, "architectures": ["ModernBertForSequenceClassification"],
                                  "num_labels": 1}).default_pooling_type == "MEAN"
    v5 = ModelConfig.from_dict({**base, "architectures": ["ModernBertModel"],
                                "layer_types": ["full_attention", "sliding_attention"],
                                "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5.0},
                                                    "sliding_attention": {"rope_type": "default", "rope_theta": 7.0}}})
    assert (v5.sliding_window_layers, v5.rope_theta, v5.local_rope_theta) == ((False, True), 5.0, 7.0)
    assert ModelConfig.from_dict({**modern, "local_rope_theta": None}).local_rope_theta == 160000.0
    with pytest.raises(ValueError, match="only default RoPE is served"):
        ModelConfig.from_dict({**modern, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="classifier_pooling must be 'cls' or 'mean'"):
        ModelConfig.from_dict({**modern, "classifier_pooling": "max"})
    with pytest.raises(ValueError, match="classifier_from_token is for causal LMs"):
        ModelConfig.from_dict({**base, "architectures": ["BertForSequenceClassification"],
                               "classifier_from_token": ["a", "b"]})


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "modernbert"])
def test_tp2_over_gloo_equals_tp1(tmp_path, kind, tp_hosts):
    """A BERT (ModernBERT) classifier split over two ranks (heads and MLP by width, ModernBERT's fused
    Wqkv and Wi split as read, an odd vocabulary padded): the same class logits, BERT's token types
    included, as on one; no rank keeps a KV cache."""
    import ray

    from gpu_worker.worker import Worker

    path, _ = save_tiny_encoder(tmp_path, kind, num_labels=3, vocab_size=251)
    prompts = random_prompts(5, seed=6)
    type_starts = {rid: len(p) // 2 for rid, p in prompts.items()} if kind == "bert" else {}
    kwargs = dict(device="cpu", dtype="float32", max_model_len=64, num_cpus=1)
    tp1 = Worker(0, 1, str(path), **kwargs)
    tp1.load_model()
    num_blocks = tp1.determine_num_blocks(4)  # (no memory asked for: an encoder's blocks cost none)
    tp1.initialize_cache(num_blocks, 4)
    expected = pooled_outputs(None, prompts, "CLS", type_starts, execute=tp1.execute_model, num_blocks=num_blocks)
    with two_tp_ranks(path, tp_hosts, **kwargs) as (ranks, execute):
        assert ray.get([w.determine_num_blocks.remote(4) for w in ranks]) == [num_blocks] * 2
        ray.get([w.initialize_cache.remote(num_blocks, 4) for w in ranks])
        assert ray.get([w.__ray_call__.remote(lambda w: len(w.runner.kv_caches)) for w in ranks]) == [0, 0]
        got = pooled_outputs(None, prompts, "CLS", type_starts, execute=execute, num_blocks=num_blocks)
    for rid in prompts:
        torch.testing.assert_close(torch.tensor(got[rid]), torch.tensor(expected[rid]), atol=1e-5, rtol=1e-5)


def save_tiny_bge_m3(path, **overrides):
    """A random XLM-RoBERTa saved as BGE-M3 is served (config.json naming BgeM3EmbeddingModel, as
    vLLM's --hf-overrides asks), with random sparse_linear.pt and colbert_linear.pt heads beside it;
    returns FlagEmbedding's outputs as a function of the prompt: (dense [CLS], lexical weights of
    the tokens between BOS and EOS, normalised ColBERT vectors of the tokens after BOS)."""
    import json

    path, hf = save_tiny_encoder(path, "xlm-roberta", **overrides)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["BgeM3EmbeddingModel"]}))
    torch.manual_seed(11)
    sparse, colbert = torch.nn.Linear(64, 1), torch.nn.Linear(64, 64)
    torch.save(sparse.state_dict(), path / "sparse_linear.pt")
    torch.save(colbert.state_dict(), path / "colbert_linear.pt")
    bos, eos = hf.config.bos_token_id, hf.config.eos_token_id

    @torch.no_grad()
    def reference(prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        states = hf(torch.tensor([prompt])).last_hidden_state[0]
        start = 1 if prompt[0] == bos else 0
        end = len(prompt) - 1 if prompt[-1] == eos else len(prompt)
        return (torch.nn.functional.normalize(states[0], dim=0), torch.relu(sparse(states[start:end]))[:, 0],
                torch.nn.functional.normalize(colbert(states[start:]), dim=1))

    return path, reference


def test_bge_m3_serves_lexical_weights_and_colbert_vectors(tmp_path):
    """BgeM3EmbeddingModel: its dense [CLS] embedding as any XLM-RoBERTa's; token_classify, each
    token's lexical weight relu(sparse_linear(h)) without BOS and EOS; token_embed, each token's
    ColBERT vector without BOS, normalised; as FlagEmbedding computes them."""
    path, reference = save_tiny_bge_m3(tmp_path)
    config = ModelConfig.from_pretrained(path)
    assert config.m3_heads and config.architecture == "RobertaModel" and not config.labels
    runner = make_runner(path, num_blocks=64, block_size=4)
    rng = random.Random(12)
    prompts = {f"p{i}": [0, *(rng.randrange(5, 250) for _ in range(rng.randrange(1, 30))), 2] for i in range(4)}
    prompts["bare"] = [7, 8, 9]  # (no BOS / EOS: every token's row is kept)
    prompts |= {"bos": [0], "bos-eos": [0, 2], "one": [9]}
    outputs = {}
    for task in (None, "token_classify", "token_embed"):
        scheduler = encoder_scheduler()
        for rid, prompt in prompts.items():
            params = SamplingParams(max_tokens=1, temperature=0.0, embed=True, embed_normalize=task != "token_classify",
                                    embed_pooling="CLS" if task is None else "ALL", pooling_task=task)
            scheduler.add_request(Request(rid, prompt, params, eos_token_id=None))
        outputs[task] = {}
        run_to_completion(scheduler, runner.execute_model,
                          on_output=lambda o, t=task: outputs[t].update({o.request_id: o.pooling_output}))
    for rid, prompt in prompts.items():
        dense, lexical, colbert = reference(prompt)
        torch.testing.assert_close(torch.tensor(outputs[None][rid]), dense, atol=1e-5, rtol=1e-5)
        # (The engine sends sparse_linear's output; the router's relu makes them lexical weights.)
        torch.testing.assert_close(torch.relu(torch.tensor(outputs["token_classify"][rid])), lexical, atol=1e-5,
                                   rtol=1e-5)
        torch.testing.assert_close(torch.tensor(outputs["token_embed"][rid]).view(-1, 64), colbert, atol=1e-5,
                                   rtol=1e-5)
    assert len(outputs["token_classify"]["p0"]) == len(prompts["p0"]) - 2
    assert outputs["token_classify"]["bos-eos"] == outputs["token_classify"]["bos"] == []
    assert len(outputs["token_embed"]["bos-eos"]) == 64 and len(outputs["token_classify"]["one"]) == 1
    (path / "colbert_linear.pt").unlink()
    with pytest.raises(ValueError, match=r"colbert_linear\.pt, which is missing"):
        make_runner(path, num_blocks=64, block_size=4)


def _resave_as_own_code(path, kind: str, hf, ntk_factor: float | None = None) -> None:
    """Re-save a transformers NomicBERT / GTE checkpoint as their own remote code saves them:
    NomicBERT's config keys (n_embd, ...) and tensors (emb_ln, encoder.layers.N.attn.Wqkv, mlp.fc11
    / fc12 / fc2, norm1 / norm2); GTE's NewModel (encoder.layer.N.attention.qkv_proj, mlp.up_gate_proj,
    attn_ln / mlp_ln), its RoPE as ``ntk_factor``'s fixed NTK scaling where given (the model being
    transformers' linear RoPE at base x factor, positions over factor ** (2 / head_dim))."""
    import json

    from safetensors.torch import save_file

    c = hf.config
    own: dict[str, torch.Tensor] = {}
    state = hf.state_dict()
    for name, tensor in state.items():
        if name.startswith("embeddings."):
            own[name.replace("embeddings.LayerNorm.", "emb_ln.") if kind == "nomic" else name] = tensor
    for i in range(c.num_hidden_layers):
        layer = {k.split(f"layers.{i}.", 1)[1]: v for k, v in state.items() if k.startswith(f"layers.{i}.")}
        qkv = [layer[f"self_attn.{p}_proj.weight"] for p in "qkv"]
        if kind == "nomic":
            prefix = f"encoder.layers.{i}."
            own |= {prefix + "attn.Wqkv.weight": torch.cat(qkv), prefix + "attn.out_proj.weight": layer[
                "self_attn.o_proj.weight"], prefix + "mlp.fc11.weight": layer["mlp.up_proj.weight"],
                prefix + "mlp.fc12.weight": layer["mlp.gate_proj.weight"], prefix + "mlp.fc2.weight": layer[
                "mlp.down_proj.weight"]}
            norms = {"post_attention_layernorm": "norm1", "post_mlp_layernorm": "norm2"}
        else:
            prefix = f"encoder.layer.{i}."
            own |= {prefix + "attention.qkv_proj.weight": torch.cat(qkv),
                    prefix + "attention.qkv_proj.bias": torch.cat([layer[f"self_attn.{p}_proj.bias"] for p in "qkv"]),
                    prefix + "mlp.up_gate_proj.weight": torch.cat([layer["mlp.up_proj.weight"],
                                                                   layer["mlp.gate_proj.weight"]])}
            own |= {prefix + f"attention.o_proj.{w}": layer[f"self_attn.o_proj.{w}"] for w in ("weight", "bias")}
            own |= {prefix + f"mlp.down_proj.{w}": layer[f"mlp.down_proj.{w}"] for w in ("weight", "bias")}
            norms = {"post_attention_layernorm": "attn_ln", "post_mlp_layernorm": "mlp_ln"}
        for ours, theirs in norms.items():
            own |= {prefix + f"{theirs}.{w}": layer[f"{ours}.{w}"] for w in ("weight", "bias")}
    (path / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in own.items()}, str(path / "model.safetensors"))
    if kind == "nomic":
        config = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "n_embd": c.hidden_size,
                  "n_head": c.num_attention_heads, "n_inner": c.intermediate_size, "n_layer": c.num_hidden_layers,
                  "layer_norm_epsilon": c.layer_norm_eps, "rotary_emb_base": c.rope_parameters["rope_theta"],
                  "n_positions": 8192, "max_trained_positions": 64, "vocab_size": c.vocab_size,
                  "type_vocab_size": c.type_vocab_size, "qkv_proj_bias": False, "mlp_fc1_bias": False,
                  "mlp_fc2_bias": False, "activation_function": "swiglu", "rotary_emb_fraction": 1.0,
                  "rotary_emb_interleaved": False, "prenorm": False, "causal": False, "pad_token_id": 0}
    else:
        config = {"architectures": ["NewModel"], "model_type": "new", "hidden_size": c.hidden_size,
                  "num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size,
                  "num_hidden_layers": c.num_hidden_layers, "layer_norm_eps": c.layer_norm_eps,
                  "rope_theta": c.rope_parameters["rope_theta"] / (ntk_factor or 1.0), "max_position_embeddings": 64,
                  "vocab_size": c.vocab_size, "type_vocab_size": c.type_vocab_size, "hidden_act": "gelu",
                  "position_embedding_type": "rope", "layer_norm_type": "layer_norm", "pad_token_id": 1}
        if ntk_factor:
            config["rope_scaling"] = {"type": "ntk", "factor": ntk_factor}
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("kind", ["nomic", "gte", "gte-ntk"])
def test_nomic_and_gte_checkpoints_of_their_own_code_load(tmp_path, kind):
    """nomic-embed-text's and gte's checkpoints as their remote code saved them (their own config
    keys and tensor names, fused q/k/v and up/gate) embed as transformers' models do, GTE's fixed NTK
    RoPE (gte-multilingual-base's base 20000, factor 8) included; the variants their code allows and
    we do not compute are refused."""
    import json

    ntk = 8.0 if kind == "gte-ntk" else None
    kind = kind.removesuffix("-ntk")
    # (GTE's NTK: base x factor, every frequency over factor ** (2 / head_dim); transformers' linear RoPE.)
    rope = {"rope_parameters": {"rope_type": "linear", "factor": ntk ** (2 / 16), "rope_theta": 20_000.0 * ntk}
            } if ntk else {}
    path, hf = save_tiny_encoder(tmp_path, kind, **rope)
    _resave_as_own_code(path, kind, hf, ntk)
    config = ModelConfig.from_pretrained(path)
    assert config.architecture == {"nomic": "NomicBertModel", "gte": "GteModel"}[kind]
    assert config.max_context_len == 64
    assert config.rope_theta == hf.config.rope_parameters["rope_theta"] / (ntk or 1.0)
    runner = make_runner(path, num_blocks=64, block_size=4)
    assert_pooled_as_transformers(runner, hf, {**random_prompts(4, seed=13), "single": [42]}, "MEAN")
    raw = json.loads((path / "config.json").read_text())
    refused = ([{"rotary_emb_fraction": 0.5}, {"prenorm": True}, {"rotary_emb_scale_base": 512}] if kind == "nomic"
               else [{"rope_scaling": {"type": "ntk", "factor": 2.0, "mixed_b": 0.5}},
                     {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, {"logn_attention_scale": True}])
    for bad in refused:
        with pytest.raises(ValueError, match="not served"):
            ModelConfig.from_dict({**raw, **bad})


JINA_TASKS = ["retrieval.query", "text-matching", "classification"]


def _resave_as_jina_own_code(path, hf, rank: int = 2, alpha: float = 3.0) -> dict[str, dict[str, torch.Tensor]]:
    """Re-save a transformers JinaEmbeddingsV3Model checkpoint as Jina's own code saves
    jina-embeddings-v3 (an XLMRobertaModel with rotary positions under ``roberta.``: ``emb_ln``,
    ``encoder.layers.N.mixer.Wqkv`` / ``out_proj``, ``norm1`` / ``norm2``, ``mlp.fc1`` / ``fc2``),
    every linear and embedding weight LoRA-parametrized with one random adaptation per task
    (``.parametrizations.weight.original``, ``.0.lora_A``, ``.0.lora_B``: a linear's A [tasks, rank,
    in] and B [tasks, out, rank], an embedding's A [tasks, rows, rank] and B [tasks, rank, width]).
    Returns, per task, transformers' state with that task's adaptation added to each weight."""
    import json

    from safetensors.torch import save_file

    c, state = hf.config, hf.state_dict()
    # Their name -> the names in transformers' state whose rows it stacks.
    theirs: dict[str, list[str]] = {}
    for name in state:
        if name.startswith(("embeddings.word_embeddings", "embeddings.token_type_embeddings", "pooler.")):
            theirs[name] = [name]
        elif name.startswith("embeddings.LayerNorm."):
            theirs[name.replace("embeddings.LayerNorm.", "emb_ln.")] = [name]
    for i in range(c.num_hidden_layers):
        ours, prefix = f"layers.{i}.", f"encoder.layers.{i}."
        for w in ("weight", "bias"):
            theirs[prefix + f"mixer.Wqkv.{w}"] = [ours + f"self_attn.{p}_proj.{w}" for p in "qkv"]
            theirs[prefix + f"mixer.out_proj.{w}"] = [ours + f"self_attn.o_proj.{w}"]
            theirs |= {prefix + f"mlp.{fc}.{w}": [ours + f"mlp.{fc}.{w}"] for fc in ("fc1", "fc2")}
            theirs[prefix + f"norm1.{w}"] = [ours + f"post_attention_layernorm.{w}"]
            theirs[prefix + f"norm2.{w}"] = [ours + f"post_mlp_layernorm.{w}"]
    own: dict[str, torch.Tensor] = {}
    per_task = {task: dict(state) for task in JINA_TASKS}
    gen = torch.Generator().manual_seed(21)
    for name, keys in theirs.items():
        tensor = torch.cat([state[k] for k in keys])
        if not name.endswith(".weight") or tensor.dim() != 2:
            own[f"roberta.{name}"] = tensor
            continue
        module = name.removesuffix(".weight")
        rows, cols = tensor.shape
        embedding = module.endswith("embeddings")
        a_shape, b_shape = ((rows, rank), (rank, cols)) if embedding else ((rank, cols), (rows, rank))
        a = torch.randn(len(JINA_TASKS), *a_shape, generator=gen) * 0.3
        b = torch.randn(len(JINA_TASKS), *b_shape, generator=gen) * 0.3
        own |= {f"roberta.{module}.parametrizations.weight.original": tensor,
                f"roberta.{module}.parametrizations.weight.0.lora_A": a,
                f"roberta.{module}.parametrizations.weight.0.lora_B": b}
        for t, task in enumerate(JINA_TASKS):
            delta = (a[t] @ b[t] if embedding else b[t] @ a[t]) * alpha / rank
            for key, part in zip(keys, delta.split([state[k].shape[0] for k in keys]), strict=True):
                per_task[task][key] = state[key] + part
    (path / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in own.items()}, str(path / "model.safetensors"))
    config = {"architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta", "position_embedding_type": "rotary",
              "rotary_emb_base": c.rope_parameters["rope_theta"], "hidden_size": c.hidden_size,
              "num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size,
              "num_hidden_layers": c.num_hidden_layers, "layer_norm_eps": c.layer_norm_eps, "hidden_act": "gelu",
              "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
              "type_vocab_size": c.type_vocab_size, "pad_token_id": 1, "use_flash_attn": True,
              "lora_adaptations": JINA_TASKS, "lora_rank": rank, "lora_alpha": alpha, "lora_dropout_p": 0.0,
              "task_instructions": {task: "" for task in JINA_TASKS}, "load_trained_adapters": True}
    (path / "config.json").write_text(json.dumps(config))
    return per_task


@pytest.mark.parametrize("task", ["text-matching", "retrieval.query", None])
def test_jina_v3s_own_checkpoint_embeds_with_its_task_adaptation_merged(tmp_path, task):
    """jina-embeddings-v3 as its own code saved it: the chosen task's LoRA adaptation (text-matching
    unless lora_task says otherwise; null: none) merged into every weight, the embedding tables'
    included, embeds as transformers' port does with those weights."""
    import json

    path, hf = save_tiny_encoder(tmp_path, "jina")
    per_task = _resave_as_jina_own_code(path, hf)
    if task != "text-matching":
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, "lora_task": task}))
    config = ModelConfig.from_pretrained(path)
    assert config.architecture == "JinaEmbeddingsV3Model" and config.default_pooling_type == "MEAN"
    assert config.task_lora == (None if task is None else (JINA_TASKS.index(task), 1.5))
    if task is not None:
        assert any(not torch.equal(v, hf.state_dict()[k]) for k, v in per_task[task].items())
        hf.load_state_dict(per_task[task])
    runner = make_runner(path, num_blocks=64, block_size=4)
    assert_pooled_as_transformers(runner, hf, {**random_prompts(4, seed=15), "single": [42]}, "MEAN")
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="lora_task must be one of"):
        ModelConfig.from_dict({**raw, "lora_task": "separation"})
    # (Without text-matching among them, vLLM's choice: the last.)
    other_tasks = {k: v for k, v in raw.items() if k != "lora_task"} | {"lora_adaptations": ["a", "b"]}
    assert ModelConfig.from_dict(other_tasks).task_lora == (1, 1.5)
    with pytest.raises(ValueError, match="holds none"):  # (transformers' port carries no adaptations)
        ModelConfig.from_dict({**hf.config.to_dict(), "architectures": ["JinaEmbeddingsV3Model"],
                               "lora_task": "text-matching"})


@pytest.mark.parametrize("kind", ["bert", "roberta", "modernbert"])
def test_token_classify_on_a_sequence_classifier_runs_its_classifier_on_every_token(tmp_path, kind):
    """vLLM's token_classify on a sequence classifier (ALL pooling): BERT's and ModernBERT's
    classifier alone on each token's final state (BERT's pooler and ModernBERT's head read the
    pooled state only), RoBERTa's classification head on each."""
    path, hf = save_tiny_encoder(tmp_path, kind, num_labels=3)
    runner = make_runner(path, num_blocks=64, block_size=4)
    prompts = random_prompts(3, seed=14)
    outputs = pooled_outputs(runner, prompts, "ALL")
    for rid, prompt in prompts.items():
        with torch.no_grad():
            if kind in ("bert", "modernbert"):
                base = hf.bert if kind == "bert" else hf.model
                expected = hf.classifier(base(torch.tensor([prompt])).last_hidden_state[0])
            else:  # (dense, tanh, out_proj on every token's state)
                states = hf.roberta(torch.tensor([prompt])).last_hidden_state[0]
                expected = hf.classifier.out_proj(torch.tanh(hf.classifier.dense(states)))
        torch.testing.assert_close(torch.tensor(outputs[rid]).view(len(prompt), 3), expected, atol=1e-4, rtol=1e-4)


def save_tiny_colbert(path, dim: int = 16, **overrides):
    """A random BERT saved as ColBERT's own code (HF_ColBERT) saves it: the encoder under ``bert.``
    and a bias-free ``linear`` projection to ``dim``; returns (path, transformers' BertModel, its
    projection weight)."""
    import json

    from safetensors.torch import load_file, save_file

    path, hf = save_tiny_encoder(path, "bert", **overrides)
    tensors = {f"bert.{k}": v for k, v in load_file(str(path / "model.safetensors")).items()}
    torch.manual_seed(17)
    tensors["linear.weight"] = weight = torch.randn(dim, 64) * 0.3
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["HF_ColBERT"], "dim": dim}))
    return path, hf, weight


def test_colbert_embeds_every_token_through_its_projection(tmp_path):
    """HF_ColBERT (colbertv2.0, answerai-colbert-small): each token's final state through the
    bias-free ``linear`` projection, normalised (vLLM's token_embed, the only output it serves)."""
    path, hf, weight = save_tiny_colbert(tmp_path)
    config = ModelConfig.from_pretrained(path)
    assert (config.colbert_dim, config.default_pooling_type, config.architecture) == (16, "ALL", "BertModel")
    runner = make_runner(path, num_blocks=64, block_size=4)
    prompts = {**random_prompts(4, seed=18), "single": [42]}
    scheduler = encoder_scheduler()
    for rid, prompt in prompts.items():
        params = SamplingParams(max_tokens=1, temperature=0.0, embed=True, embed_pooling="ALL",
                                pooling_task="token_embed")
        scheduler.add_request(Request(rid, prompt, params, eos_token_id=None))
    outputs = {}
    run_to_completion(scheduler, runner.execute_model,
                      on_output=lambda o: outputs.update({o.request_id: o.pooling_output}))
    for rid, prompt in prompts.items():
        with torch.no_grad():
            states = hf(torch.tensor([prompt])).last_hidden_state[0]
        expected = torch.nn.functional.normalize(states @ weight.T, dim=1)
        torch.testing.assert_close(torch.tensor(outputs[rid]).view(len(prompt), 16), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="vectors' width"):
        ModelConfig.from_dict({**config.raw, "dim": None})
    # colbertv2.0 / answerai-colbert keep the width outside config.json: read from the projection.
    import json

    (path / "config.json").write_text(json.dumps({k: v for k, v in config.raw.items() if k != "dim"}))
    assert ModelConfig.from_pretrained(path).colbert_dim == 16
