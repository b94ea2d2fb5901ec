"""Per-token pooling on decoders (ALL and STEP: vLLM's token_classify / token_embed and reward
models) through the real scheduler and model runner, with prompts chunked across passes:
transformers' *ForTokenClassification, Qwen2.5-Math-RM's outcome reward model (a reward per token)
and Qwen2.5-Math-PRM's process reward model (two classes' probabilities at each step separator),
as their reference code computes them."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModel, AutoModelForTokenClassification

from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from gpu_worker.config import ModelConfig
from gpu_worker.pooler_config import PoolerConfig, resolve_pooler_config
from tests.gpu_worker.utils import make_config, make_runner, make_scheduler, run_to_completion
from tests.tiny_model import build_tiny_reward_model


def save_tiny_token_classifier(path, kind: str, num_labels: int = 3, **overrides):
    """A random-weight decoder *ForTokenClassification checkpoint (its score head's bias non-zero,
    so one we forgot to load would show)."""
    torch.manual_seed(3)
    model = AutoModelForTokenClassification.from_config(make_config(kind, num_labels=num_labels, **overrides),
                                                        dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
        if model.score.bias is not None:
            model.score.bias.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path, model.eval()


def pooled(runner, prompts: dict[str, list[int]], pooling: str, budget: int = 7, normalize: bool = False,
           sched=None, **params) -> dict[str, list[float]]:
    """Each prompt's pooled output, run as embedding requests through the real scheduler with a token
    budget small enough to chunk them (and the prefix cache on: per-token pooling must not read it)."""
    sched = sched or make_scheduler(num_blocks=128, block_size=4, max_num_batched_tokens=budget)
    for rid, prompt in prompts.items():
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, embed=True,
                                                              embed_normalize=normalize, embed_pooling=pooling,
                                                              **params), eos_token_id=None))
    outputs = {}
    run_to_completion(sched, runner.execute_model, on_output=lambda o: outputs.update({o.request_id: o.pooling_output}))
    return outputs


def random_prompts(count: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"p{i}": [rng.randrange(250) for _ in range(rng.randrange(1, 30))] for i in range(count)}


@pytest.mark.parametrize(("kind", "overrides"), [("llama", {}), ("qwen2", {}), ("mistral", {}),
                                                 ("qwen3", {"head_dim": 32, "token_classification_bias": False}),
                                                 ("gemma2", {"attn_logit_softcapping": 1.5})])
def test_decoder_token_classifier_logits_match_transformers(tmp_path, kind, overrides):
    """Every prompt token's class logits (ALL pooling, the token classifiers' default), gathered
    chunk by chunk, equal transformers' *ForTokenClassification's."""
    path, hf = save_tiny_token_classifier(tmp_path, kind, **overrides)
    config = ModelConfig.from_pretrained(path)
    assert config.token_classifier and config.embedding_only and config.default_pooling_type == "ALL"
    runner = make_runner(path, num_blocks=128, block_size=4)
    assert runner.model.lm_head is None
    assert (runner.model.score.bias is None) == (overrides.get("token_classification_bias") is False)
    prompts = random_prompts(5, seed=5)
    outputs = pooled(runner, prompts, "ALL")
    for rid, prompt in prompts.items():
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(torch.tensor(outputs[rid]).view(len(prompt), 3), expected, atol=1e-4, rtol=1e-4)


def test_outcome_reward_model_scores_every_token(tmp_path):
    """Qwen2ForRewardModel: one raw reward per prompt token (ALL pooling, no activation); its LM
    head is not read. The same prompt twice (a prefix-cache hit, were it read) scores alike."""
    reference = build_tiny_reward_model(tmp_path, "Qwen2ForRewardModel")
    config = ModelConfig.from_pretrained(tmp_path)
    # (One output takes vLLM's sigmoid by default: the router applies it; a request can switch it off.)
    assert (config.labels, config.default_pooling_type, config.classifier_activation, config.score_head) == (
        ("LABEL_0",), "ALL", "sigmoid", "relu_mlp")
    runner = make_runner(tmp_path, num_blocks=128, block_size=4)
    prompts = random_prompts(4, seed=6)
    prompts["again"] = prompts["p0"] = [7, *prompts["p0"], 9, 9, 9, 9, 9]
    outputs = pooled(runner, prompts, "ALL")
    for rid, prompt in prompts.items():
        torch.testing.assert_close(torch.tensor(outputs[rid]), reference(prompt)[:, 0], atol=1e-4, rtol=1e-4)
    # The last token's reward is the outcome reward (LAST pooling reads it alone).
    last = pooled(runner, prompts, "LAST")
    for rid, prompt in prompts.items():
        torch.testing.assert_close(torch.tensor(last[rid]), reference(prompt)[-1], atol=1e-4, rtol=1e-4)


def test_process_reward_model_scores_each_step_separator(tmp_path):
    """Qwen2ForProcessRewardModel: STEP pooling keeps the rows at the step separator (its default is
    the tokenizer's "<extra_0>"), wherever chunks cut the prompt; two class logits each."""
    from transformers import AutoTokenizer

    reference = build_tiny_reward_model(tmp_path, "Qwen2ForProcessRewardModel")
    tag = AutoTokenizer.from_pretrained(tmp_path).convert_tokens_to_ids("<extra_0>")
    config = ModelConfig.from_pretrained(tmp_path)
    assert (config.labels, config.default_pooling_type, config.classifier_activation, config.step_tag_id) == (
        ("LABEL_0", "LABEL_1"), "STEP", "softmax", tag)
    pooler = resolve_pooler_config(tmp_path, {}, default_type="STEP", default_step_tag_id=config.step_tag_id)
    assert pooler == PoolerConfig(pooling_type="STEP", step_tag_id=tag)
    runner = make_runner(tmp_path, num_blocks=128, block_size=4)
    rng = random.Random(7)
    prompts = {f"p{i}": [rng.choice([tag, rng.randrange(200)]) for _ in range(rng.randrange(3, 30))]
               for i in range(5)}
    prompts["untagged"] = [5, 6, 7]
    outputs = pooled(runner, prompts, "STEP", embed_step_tag_id=tag)
    assert outputs["untagged"] == []
    for rid, prompt in prompts.items():
        rows = [i for i, t in enumerate(prompt) if t == tag]
        expected = reference(prompt)[rows]
        torch.testing.assert_close(torch.tensor(outputs[rid]).view(len(rows), 2), expected, atol=1e-4, rtol=1e-4)
    # Preempted mid-prefill (a KV pool too small for all of them), each prompt starts its rows again.
    small = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=16, long_prefill_token_threshold=5)
    again = pooled(runner, prompts, "STEP", sched=small, embed_step_tag_id=tag)
    assert small._num_preemptions > 0
    for rid in prompts:
        torch.testing.assert_close(torch.tensor(again[rid]), torch.tensor(outputs[rid]), atol=1e-5, rtol=1e-5)
    # Without a step tag STEP keeps every row, cut to the columns asked (here the second class's).
    every = pooled(runner, prompts, "STEP", embed_returned_token_ids=[1])
    for rid, prompt in prompts.items():
        torch.testing.assert_close(torch.tensor(every[rid]), reference(prompt)[:, 1], atol=1e-4, rtol=1e-4)


def test_all_pooling_on_an_embedding_model_gives_each_tokens_state(tmp_path):
    """ALL pooling on a bare decoder: every prompt token's final hidden state, normalised row by row
    when asked; STEP keeps the tagged rows' chosen columns."""
    torch.manual_seed(8)
    hf = AutoModel.from_config(make_config("llama", architectures=["LlamaModel"]), dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    runner = make_runner(tmp_path, num_blocks=128, block_size=4)
    prompts = random_prompts(4, seed=9)
    raw = pooled(runner, prompts, "ALL")
    unit = pooled(runner, prompts, "ALL", budget=64, normalize=True)
    step = pooled(runner, prompts, "STEP", embed_step_tag_id=prompts["p0"][0], embed_returned_token_ids=[5, 0, 63])
    for rid, prompt in prompts.items():
        with torch.no_grad():
            states = hf(torch.tensor([prompt])).last_hidden_state[0]
        torch.testing.assert_close(torch.tensor(raw[rid]).view(len(prompt), 64), states, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(unit[rid]).view(len(prompt), 64),
                                   torch.nn.functional.normalize(states, dim=1), atol=1e-4, rtol=1e-4)
        rows = [i for i, t in enumerate(prompt) if t == prompts["p0"][0]]
        torch.testing.assert_close(torch.tensor(step[rid]).view(len(rows), 3), states[rows][:, [5, 0, 63]],
                                   atol=1e-4, rtol=1e-4)


def test_per_token_pooler_configs_are_checked(tmp_path):
    """step_tag_id and returned_token_ids belong to STEP pooling, and must be token ids."""
    assert resolve_pooler_config(tmp_path, {"pooling_type": "step", "returned_token_ids": [3, 1]}) == PoolerConfig(
        pooling_type="STEP", returned_token_ids=(3, 1))
    assert resolve_pooler_config(tmp_path, {"pooling_type": "ALL"}, default_step_tag_id=4).step_tag_id is None
    for bad, message in (({"pooling_type": "ALL", "step_tag_id": 3}, "read by STEP pooling, not ALL"),
                         ({"pooling_type": "STEP", "step_tag_id": -1}, "step_tag_id must be a token id"),
                         ({"pooling_type": "STEP", "returned_token_ids": []}, "non-empty list"),
                         ({"pooling_type": "STEP", "returned_token_ids": 3}, "must be a list")):
        with pytest.raises(ValueError, match=message):
            resolve_pooler_config(tmp_path, bad)
    for bad in ({"embed_pooling": "ALL", "embed_step_tag_id": 3}, {"embed_pooling": "STEP", "embed_step_tag_id": -2},
                {"embed_pooling": "STEP", "embed_returned_token_ids": []}):
        with pytest.raises(ValueError, match="embed_"):
            SamplingParams(max_tokens=1, embed=True, **bad)


def test_pooling_heads_run_in_fp32_beside_a_bf16_model(tmp_path):
    """A bf16 model (as served on GPUs) pools through fp32 heads: a decoder token classifier's rows,
    a reward model's MLP, an encoder sequence classifier's pooler and head, and per-token embeddings
    run without a dtype clash, each close to the fp32 model's outputs (bf16 keeps about 3 digits, so
    only the heads' dtype assert tells fp32 heads from bf16 ones)."""
    from gpu_worker.model_runner import ModelRunner
    from tests.gpu_worker.test_encoders import save_tiny_encoder

    def runner(path, dtype):
        built = ModelRunner(ModelConfig.from_pretrained(path), device="cpu", dtype=dtype)
        built.load_model(path)
        built.initialize_kv_cache(128, 4)
        return built

    prompts = random_prompts(3, seed=15)
    token_classifier, _ = save_tiny_token_classifier(tmp_path / "tok", "llama")
    build_tiny_reward_model(tmp_path / "orm", "Qwen2ForRewardModel")
    bert, _ = save_tiny_encoder(tmp_path / "bert", "bert", num_labels=2)
    torch.manual_seed(16)
    AutoModel.from_config(make_config("llama", architectures=["LlamaModel"])).save_pretrained(tmp_path / "embedder")
    for path, pooling in ((token_classifier, "ALL"), (tmp_path / "orm", "ALL"), (bert, "CLS"),
                          (tmp_path / "orm", "LAST"), (tmp_path / "embedder", "ALL")):
        bf16 = runner(path, torch.bfloat16)
        heads = [m for name, m in bf16.model.named_modules() if name in ("score", "classifier", "model.pooler")]
        assert all(p.dtype == torch.float32 for head in heads for p in head.parameters())
        assert heads or path.name == "embedder"
        budget = 256 if path == bert else 7  # (an encoder's prompts run whole)
        want = pooled(runner(path, torch.float32), prompts, pooling, budget)
        got = pooled(bf16, prompts, pooling, budget)
        for rid in prompts:  # (bf16 keeps about 3 significant digits through the layers)
            got_rid, want_rid = torch.tensor(got[rid]), torch.tensor(want[rid])
            assert got_rid.shape == want_rid.shape
            assert (got_rid - want_rid).norm() <= 0.05 * want_rid.norm(), (path.name, pooling, rid)
