"""Sequence classifiers (transformers' *ForSequenceClassification: classifiers, reward models,
cross-encoders) through the real scheduler and model runner: the class logits of each prompt's last
token, as transformers computes them, through chunked prefill and beside other requests."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from gpu_worker.config import ModelConfig
from gpu_worker.model_runner import ModelRunner
from tests.gpu_worker.utils import make_config, make_runner, make_scheduler, run_to_completion


def save_tiny_classifier(path, kind: str, **overrides):
    """A random-weight *ForSequenceClassification checkpoint (its pad id out of the prompts' range,
    so transformers pools the last token, as we do)."""
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(make_config(kind, pad_token_id=255, **overrides),
                                                           dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path, model.eval()


def _pooled_outputs(runner, prompts: dict[str, list[int]], num_blocks: int, budget: int) -> dict[str, list[float]]:
    """Each prompt's pooled output (a classifier's class logits), run as embedding requests through
    the real scheduler with a token budget small enough to chunk them."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget)
    for rid, prompt in prompts.items():
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, embed=True,
                                                              embed_normalize=False), eos_token_id=None))
    outputs = {}
    run_to_completion(sched, runner.execute_model,
                      on_output=lambda o: outputs.update({o.request_id: o.pooling_output}))
    return outputs


@pytest.mark.parametrize(("kind", "overrides", "labels"), [
    ("llama", {"id2label": {0: "negative", 1: "neutral", 2: "positive"},
               "label2id": {"negative": 0, "neutral": 1, "positive": 2}}, ("negative", "neutral", "positive")),
    ("qwen3", {"num_labels": 1, "head_dim": 32}, ("LABEL_0",)),  # a cross-encoder / reward model: one output
    ("gemma2", {"num_labels": 2, "attn_logit_softcapping": 1.5}, ("LABEL_0", "LABEL_1")),
], ids=["llama-3-classes", "qwen3-one-output", "gemma2"])
def test_class_logits_match_transformers(tmp_path, kind, overrides, labels):
    path, hf = save_tiny_classifier(tmp_path, kind, **overrides)
    config = ModelConfig.from_pretrained(path)
    assert config.labels == labels and config.embedding_only
    runner = make_runner(path, num_blocks=64, block_size=4)
    assert runner.model.lm_head is None and runner.model.score.weight.shape == (len(labels), 64)
    rng = random.Random(2)
    prompts = {f"c{i}": [rng.randrange(250) for _ in range(rng.randrange(2, 20))] for i in range(5)}
    outputs = _pooled_outputs(runner, prompts, num_blocks=64, budget=7)
    for rid, prompt in prompts.items():
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(torch.tensor(outputs[rid]), expected, atol=1e-4, rtol=1e-4)


def test_classifier_configs():
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 256}
    plain = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForSequenceClassification"]})
    assert plain.architecture == "Qwen2ForCausalLM" and plain.labels == ("LABEL_0", "LABEL_1")
    named = ModelConfig.from_dict({**base, "architectures": ["MistralForSequenceClassification"],
                                   "id2label": {"1": "yes", "0": "no"}})
    assert named.labels == ("no", "yes") and named.embedding_only
    # What turns logits into probabilities, as transformers' loss reads problem_type.
    assert plain.classifier_activation == "softmax"
    one = {**base, "architectures": ["LlamaForSequenceClassification"], "num_labels": 1}
    assert ModelConfig.from_dict(one).classifier_activation == "sigmoid"
    # (A softmax over one logit is always 1: one output takes a sigmoid whatever the problem type.)
    assert ModelConfig.from_dict({**one, "problem_type": "single_label_classification"}
                                 ).classifier_activation == "sigmoid"
    # /score's activation for a cross-encoder: the sentence-transformers one its config names, else a sigmoid.
    assert ModelConfig.from_dict(one).cross_encoder_activation == "sigmoid"
    assert ModelConfig.from_dict({**one, "sentence_transformers": {
        "activation_fn": "torch.nn.modules.linear.Identity"}}).cross_encoder_activation == "none"
    assert ModelConfig.from_dict({**one, "problem_type": "regression"}).cross_encoder_activation == "sigmoid"
    assert ModelConfig.from_dict({**one, "sbert_ce_default_activation_function": "torch.nn.Tanh"}
                                 ).cross_encoder_activation == "tanh"
    with pytest.raises(ValueError, match=r"cross-encoder activation 'torch\.nn\.Softplus' is not served"):
        ModelConfig.from_dict({**one, "sbert_ce_default_activation_function": "torch.nn.Softplus"})
    assert ModelConfig.from_dict({**one, "problem_type": "regression"}).classifier_activation == "none"
    assert ModelConfig.from_dict({**base, "architectures": ["LlamaForSequenceClassification"], "num_labels": 4,
                                  "problem_type": "multi_label_classification"}).classifier_activation == "sigmoid"
    with pytest.raises(ValueError, match="problem_type must be"):
        ModelConfig.from_dict({**one, "problem_type": "ranking"})
    with pytest.raises(ValueError, match=r"id2label must name the classes 0\.\.n-1"):
        ModelConfig.from_dict({**base, "architectures": ["LlamaForSequenceClassification"],
                               "id2label": {"0": "a", "2": "c"}})


@pytest.mark.parametrize(("tokens", "tied"), [(["n", "y"], True), (["n", "y"], False),
                                              (["a", "b", "c"], False)],
                         ids=["two-tokens-tied", "two-tokens-untied", "three-tokens"])
def test_a_causal_lm_serves_as_a_classifier_from_token_rows(tmp_path, tokens, tied):
    """vLLM's classifier_from_token (through --hf-overrides): Qwen3-Reranker is a causal LM whose
    score is P("yes") against "no" at the last token. As a one-output classifier its logit is the
    difference of the two tokens' LM logits (so its sigmoid is that probability); with other than
    two tokens, a class per token, its LM logit. (The tiny vocabulary has "n" and "y", not the words.)"""
    from transformers import AutoModelForCausalLM

    from tests.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(make_config("qwen3", vocab_size=len(tokenizer), head_dim=32,
                                                      tie_word_embeddings=tied), dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens}
    config = ModelConfig.from_pretrained(tmp_path, overrides)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    assert config.classifier_token_ids == tuple(ids) and config.embedding_only
    assert config.labels == (("LABEL_0",) if len(tokens) == 2 else tuple(tokens))
    runner = ModelRunner(config, device="cpu", dtype=torch.float32)
    runner.load_model(tmp_path)
    runner.initialize_kv_cache(32, 4)
    prompts = {"p0": [5, 9, 17, 3, 40, 41, 8], "p1": [7, 7, 2]}
    outputs = _pooled_outputs(runner, prompts, num_blocks=32, budget=6)
    for rid, prompt in prompts.items():
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, -1]
        expected = (logits[ids[1]] - logits[ids[0]]).unsqueeze(0) if len(tokens) == 2 else logits[ids]
        torch.testing.assert_close(torch.tensor(outputs[rid]), expected, atol=1e-4, rtol=1e-4)
    # vLLM's methods: two tokens as a class each (no_post_processing); the token list needs a
    # classifier architecture.
    per_token = ModelConfig.from_pretrained(tmp_path, {**overrides, "method": "no_post_processing"})
    assert per_token.labels == tuple(tokens) and per_token.classifier_token_ids == tuple(ids)
    with pytest.raises(ValueError, match="from_2_way_softmax needs two tokens"):
        ModelConfig.from_pretrained(tmp_path, {**overrides, "classifier_from_token": ["a", "b", "c"],
                                               "method": "from_2_way_softmax"})
    with pytest.raises(ValueError, match="classifier_from_token needs a sequence-classification architecture"):
        ModelConfig.from_pretrained(tmp_path, {"classifier_from_token": tokens})
    with pytest.raises(ValueError, match="'zzz-not-a-token' is not a token"):
        ModelConfig.from_pretrained(tmp_path, {**overrides, "classifier_from_token": ["n", "zzz-not-a-token"]})
