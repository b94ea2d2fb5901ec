"""The offline LLM API on real engines: tiny random models, and SmolLM2 once."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster import LLM, SamplingParams
from engine_core.engine_core import RequestRefusedError
from engine_core.outputs import EngineCoreRequest
from engine_core.sampling_params import SamplingParams as EngineSamplingParams

PROMPTS = [
    "Hello",
    "Paris is the capital of",
    "def main():\n    return 42\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "東京は日本の首都です。",
    "Berlin is the capital of Germany. Paris is",
    "naïve café 😀",
    "user assistant system What is the capital of France? " * 2,
]


def hf_greedy(model_dir, prompts, max_tokens):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    outs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        g = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                           pad_token_id=tok.pad_token_id)
        outs.append(g[0, ids.shape[1]:].tolist())
    return outs


def test_greedy_generate_equals_transformers_with_chunked_prefill_and_preemption(tiny_model_dir):
    max_tokens = 24
    # 16-token budget forces chunked prefill; 12 blocks of 16 for 8 growing requests forces preemption.
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=12, max_num_batched_tokens=16, max_num_seqs=8,
              max_model_len=128)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.get_stats()[0]
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(tiny_model_dir, PROMPTS, max_tokens)
    assert [o.prompt for o in outputs] == PROMPTS  # deterministic order
    assert stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert stats.max_step_num_scheduled_tokens <= 16
    assert stats.num_free_blocks == stats.num_blocks
    for o in outputs:
        m = o.metrics
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_a_moe_model_on_two_expert_parallel_ranks_generates_as_transformers(ray_cluster, tmp_path):
    """Qwen2-MoE (routed experts, a gated shared expert, one dense layer) through an engine whose
    two workers each hold half of the experts whole (enable_expert_parallel), with chunked prefill
    and batched decodes. (Width-split experts: tests/gpu_worker/test_worker.py, over the same gloo.)"""
    import ray

    from tests.tiny_model import build_tiny_moe

    path = build_tiny_moe(tmp_path / "moe")
    # (With a custom logits processor: both ranks must order the batch's logits rows alike.)
    llm = LLM(model=str(path), tensor_parallel_size=2, enable_expert_parallel=True, num_gpu_blocks=64,
              max_num_batched_tokens=16, max_num_seqs=8, max_model_len=128,
              logits_processors=["tests.logits_processors:TargetTokenProcessor"])
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        targeted = llm.generate(PROMPTS, [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                         extra_args={"target_token": 7 + i} if i % 3 == 0 else None)
                                          for i in range(len(PROMPTS))], use_tqdm=False)
        workers = ray.get(llm._handles[0].actor.__ray_call__.remote(lambda self: self.service.engine.executor.workers))

        def held_experts(worker):
            experts = worker.runner.model.model.layers[1].mlp.experts
            return experts.first_expert, experts.num_local_experts

        assert ray.get([w.__ray_call__.remote(held_experts) for w in workers]) == [(0, 4), (4, 4)]
    finally:
        llm.shutdown()
    expected = hf_greedy(path, PROMPTS, 12)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.outputs[0].token_ids for o in targeted] == [[7 + i] * 12 if i % 3 == 0 else expected[i]
                                                          for i in range(len(PROMPTS))]


def test_a_gemma2_engine_generates_as_transformers(tmp_path):
    """Gemma 2 through an engine: windowed and full layers alternating (the KV cache keeps every key),
    soft caps binding, chunked prefill, preemption and the prefix cache, against transformers' eager
    attention (which applies the caps)."""
    from tests.tiny_model import build_tiny_gemma2

    path = build_tiny_gemma2(tmp_path / "gemma2")
    llm = LLM(model=str(path), num_gpu_blocks=12, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=128)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(PROMPTS + PROMPTS[:2], params, use_tqdm=False)
        stats = llm.get_stats()[0]
    finally:
        llm.shutdown()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(path)
    expected = []
    for prompt in PROMPTS + PROMPTS[:2]:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
        expected.append(out[0, ids.shape[1]:].tolist())
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_blocks


def test_an_e5_mistral_style_embedding_model_pools_as_its_sentence_transformers_files_say(tmp_path, tiny_model_dir):
    """A bare MistralModel checkpoint (no LM head) with sentence-transformers files asking for MEAN
    pooling and no Normalize: the engine runs it for embeddings only (runner auto), pools the mean
    of every prompt token's final hidden state through chunked prefill, leaves it unnormalised unless
    asked, and refuses to generate. --pooler-config overrides the files; --runner pooling makes a
    causal LM embedding-only; --runner generate refuses a model without a head."""
    from transformers import AutoModel

    from tests.tiny_model import build_tiny_embedder

    path = build_tiny_embedder(tmp_path / "e5")
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)

    def states(prompt):
        with torch.no_grad():
            return model(tok(prompt, return_tensors="pt").input_ids).last_hidden_state[0]

    llm = LLM(model=str(path), num_gpu_blocks=64, max_num_batched_tokens=8, max_model_len=128)
    try:
        outs = llm.embed(PROMPTS[:4], use_tqdm=False)
        normalised = llm.embed(PROMPTS[:1], use_tqdm=False, normalize=True)
        with pytest.raises(ValueError, match=r"is an embedding model .* does not generate"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    for out, prompt in zip(outs, PROMPTS[:4], strict=True):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), states(prompt).mean(0), atol=1e-4, rtol=1e-4)
    mean = states(PROMPTS[0]).mean(0)
    torch.testing.assert_close(torch.tensor(normalised[0].outputs.embedding), mean / mean.norm(), atol=1e-5,
                               rtol=1e-5)

    llm = LLM(model=str(path), num_gpu_blocks=64, pooler_config={"pooling_type": "CLS", "normalize": True})
    try:
        cls = llm.embed(PROMPTS[1:2], use_tqdm=False)[0].outputs.embedding
    finally:
        llm.shutdown()
    first = states(PROMPTS[1])[0]
    torch.testing.assert_close(torch.tensor(cls), first / first.norm(), atol=1e-5, rtol=1e-5)

    with pytest.raises(ValueError, match=r"runner 'generate'.* an embedding model without an LM head"):
        LLM(model=str(path), num_gpu_blocks=64, runner="generate")
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, runner="pooling")
    try:
        assert len(llm.embed(PROMPTS[:1], use_tqdm=False)[0].outputs.embedding) == 64
        with pytest.raises(ValueError, match="does not generate"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()


def test_a_generative_model_with_a_pooling_we_do_not_serve_still_starts(tmp_path, tiny_model_dir, caplog):
    """sentence-transformers files asking for max pooling: a model served to generate starts, with a
    warning, and refuses embeddings with the reason; served for embeddings only, it is refused."""
    import shutil

    from tests.gpu_worker.test_pooler_config import write_sentence_transformers

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    write_sentence_transformers(model, {"pooling_mode_max_tokens": True}, True)
    llm = LLM(model=str(model), num_gpu_blocks=64)
    try:
        assert len(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
        with pytest.raises(ValueError, match=r"does not serve embeddings: .*pooling_mode_max_tokens"):
            llm.embed(PROMPTS[:1], use_tqdm=False)
    finally:
        llm.shutdown()
    assert "pooling_mode_max_tokens, which is not served" in caplog.text
    with pytest.raises(ValueError, match="pooling_mode_max_tokens, which is not served"):
        LLM(model=str(model), num_gpu_blocks=64, runner="pooling")


def test_a_cross_encoder_classifies_and_scores_pairs_as_transformers(tmp_path):
    """A one-output LlamaForSequenceClassification: LLM.classify gives the sigmoid of its logit
    (softmax for several classes), LLM.score scores each text pair tokenised together; it neither
    embeds nor generates."""
    from transformers import AutoModelForSequenceClassification

    from tests.tiny_model import build_tiny_classifier

    path = build_tiny_classifier(tmp_path / "reranker")
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)

    def logit(ids):
        with torch.no_grad():
            return float(model(torch.tensor([ids])).logits[0, 0])

    llm = LLM(model=str(path), num_gpu_blocks=64, max_num_batched_tokens=8, max_model_len=128)
    try:
        classified = llm.classify(PROMPTS[:3], use_tqdm=False)
        scored = llm.score("Which city is in France?", ["Paris is.", "Berlin is not."], use_tqdm=False)
        with pytest.raises(ValueError, match=r"sequence classifier: use LLM\.classify"):
            llm.embed(PROMPTS[:1], use_tqdm=False)
        with pytest.raises(ValueError, match="does not generate"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    for out, prompt in zip(classified, PROMPTS[:3], strict=True):
        assert out.outputs.num_classes == 1
        assert out.outputs.probs[0] == pytest.approx(float(torch.sigmoid(torch.tensor(logit(tok(prompt).input_ids)))),
                                                     abs=1e-5)
    for out, doc in zip(scored, ["Paris is.", "Berlin is not."], strict=True):
        ids = tok("Which city is in France?", text_pair=doc).input_ids
        assert out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(float(torch.sigmoid(torch.tensor(logit(ids)))), abs=1e-5)


def test_a_causal_lm_reranks_through_hf_overrides_as_qwen3_reranker_is_served(tiny_model_dir):
    """vLLM's recipe for Qwen3-Reranker: --hf-overrides makes the causal LM a one-output classifier
    from its "no" / "yes" rows, so a pair's score is P(yes) over {no, yes} at its last token. (The
    tiny vocabulary has "n" and "y".) As vLLM, such an LLM reads a pair as one text, the two joined
    (its use_pad_token false: no pair template, whose second BOS a Llama tokenizer adds); with
    use_pad_token true, through the pair template."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    no, yes = tok.convert_tokens_to_ids("n"), tok.convert_tokens_to_ids("y")
    # (Split mid-word, so that the text joined and the pair template give different tokens.)
    query, docs = "Which city is in France? Par", ["is is.", "lin is not."]
    overrides = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["n", "y"]}
    for use_pad_token in (None, True):
        llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, hf_overrides=overrides if use_pad_token is None
                  else {**overrides, "use_pad_token": use_pad_token})
        try:
            scored = llm.score(query, docs, use_tqdm=False)
        finally:
            llm.shutdown()
        for out, doc in zip(scored, docs, strict=True):
            ids = tok(query + doc).input_ids if use_pad_token is None else tok(query, text_pair=doc).input_ids
            assert out.prompt_token_ids == ids
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]
            assert out.outputs.score == pytest.approx(float(torch.softmax(logits[[no, yes]], -1)[1]), abs=1e-5)
    assert tok(query + docs[0]).input_ids != tok(query, text_pair=docs[0]).input_ids  # (the two readings differ)


def test_embed_gives_the_last_tokens_final_hidden_state_beside_generation(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # (Marked as trained for shorter embeddings, as vLLM needs for dimensions.)
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, max_num_batched_tokens=16,
              hf_overrides={"is_matryoshka": True})
    try:
        outputs = llm.embed(PROMPTS, use_tqdm=False)
        raw = llm.embed([tok.encode(PROMPTS[1])], use_tqdm=False, normalize=False, dimensions=10)
        with pytest.raises(ValueError, match="prompt 0 has 2000 tokens; max_model_len is"):
            llm.embed([[5] * 2000], use_tqdm=False)
        with pytest.raises(ValueError, match=r"dimensions \(65\) is larger than the model's embeddings \(64"):
            llm.embed(PROMPTS[:1], use_tqdm=False, dimensions=65)
        # vLLM's LLM.score with an embedding model: cosine similarities, one against many or pairwise.
        one_to_many = llm.score(PROMPTS[0], PROMPTS[1:4], use_tqdm=False)
        pairwise = llm.score(PROMPTS[:2], [PROMPTS[0], tok.encode(PROMPTS[2])], use_tqdm=False)
        with pytest.raises(ValueError, match="one text, or as many as the second"):
            llm.score(PROMPTS[:2], PROMPTS[:3], use_tqdm=False)
        with pytest.raises(ValueError, match="at least one prompt on each side"):
            llm.score(PROMPTS[0], [], use_tqdm=False)
        # Generation afterwards is untouched, and nothing was left in the engine.
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)] == \
            hf_greedy(tiny_model_dir, PROMPTS[:2], 4)
        stats = llm.get_stats()[0]
    finally:
        llm.shutdown()
    assert stats.num_free_blocks == stats.num_blocks
    refs = []
    for out, prompt in zip(outputs, PROMPTS, strict=True):
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
        refs.append(ref / ref.norm())
        assert out.prompt_token_ids == ids
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref / ref.norm(), atol=1e-4, rtol=1e-4)
        if prompt == PROMPTS[1]:
            torch.testing.assert_close(torch.tensor(raw[0].outputs.embedding), ref[:10], atol=1e-4, rtol=1e-4)
    assert [o.outputs.score for o in one_to_many] == pytest.approx([float(refs[0] @ refs[j]) for j in (1, 2, 3)],
                                                                   abs=1e-4)
    assert [o.outputs.score for o in pairwise] == pytest.approx([1.0, float(refs[1] @ refs[2])], abs=1e-4)
    assert pairwise[0].outputs.score == 1.0  # a prompt against itself, exactly
    assert one_to_many[0].prompt_token_ids == tok.encode(PROMPTS[0]) + tok.encode(PROMPTS[1])


def test_generate_accepts_token_ids_and_per_prompt_params(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64)
    try:
        outs = llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                                  SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)],
                            use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
        assert outs[0].prompt_token_ids == [5, 6, 7] and outs[0].prompt is None
        seeded = [llm.generate("Hello", SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
        assert seeded[0] == seeded[1]
        with pytest.raises(ValueError, match="sampling_params"):
            llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    finally:
        llm.shutdown()


def test_prompt_dicts_and_bad_prompts_as_vllm_takes_them(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    try:
        plain = llm.generate(["Hello", [5, 6, 7]], params, use_tqdm=False)
        dicts = llm.generate([{"prompt": "Hello"}, {"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
        for bad, error in (([[]], "prompt 0 is empty"), ([[5, 10**6]], "token ids must be integers"),
                           ([[-1]], "token ids must be integers"), ([[5] * 1024], "leaves no room"),
                           ([{"text": "x"}], "prompt dict needs"), ([3.5], "a prompt is text"),
                           ([{"prompt": "x", "multi_modal_data": {"image": "a.png"}}],
                            "images must be PIL images"),
                           ([{"prompt": "x", "mm_processor_kwargs": {"num_crops": 4}}],
                            "mm_processor_kwargs cannot be served")):
            with pytest.raises((ValueError, TypeError), match=error):
                llm.generate(bad, params, use_tqdm=False)
        # Nothing of the refused calls stayed in the engine: it serves on with every block free.
        assert llm.generate([5, 6, 7], params, use_tqdm=False)[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
        assert llm.get_stats()[0].num_free_blocks == llm.get_stats()[0].num_blocks
    finally:
        llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("Hello", params, use_tqdm=False)


def test_every_eos_id_of_the_generation_config_stops_and_stays_out_of_the_text(tmp_path, tiny_model_dir):
    import shutil

    from transformers import GenerationConfig

    prompt = [5, 6, 7, 8]
    reference = LLM(model=str(tiny_model_dir), num_gpu_blocks=64)
    try:
        free = reference.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].token_ids
    finally:
        reference.shutdown()
    # A second EOS id (as Llama 3's end of turn): the first greedy token after the first that is new.
    model_dir = tmp_path / "two-eos"
    shutil.copytree(tiny_model_dir, model_dir)
    config = GenerationConfig.from_pretrained(model_dir)
    stop = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    assert config.eos_token_id not in free[:stop + 1]
    # Listed first, as Llama 3.1's generation config lists <|end_of_text|> before the tokenizer's
    # <|eot_id|>: the tokenizer's stays the request's EOS (vLLM), the other is a stop id it names.
    tokenizer_eos = config.eos_token_id
    config.eos_token_id = [free[stop], tokenizer_eos]
    config.save_pretrained(model_dir)
    llm = LLM(model=str(model_dir), num_gpu_blocks=64)
    try:
        params = SamplingParams(max_tokens=6, temperature=0)
        [out] = llm.generate(prompt, params, use_tqdm=False)
        assert params.stop_token_ids == []  # the caller's parameters are not changed
    finally:
        llm.shutdown()
    completion = out.outputs[0]
    assert completion.token_ids == free[:stop + 1] and completion.finish_reason == "stop"
    assert llm.tokenizer.eos_token_id == tokenizer_eos and completion.stop_reason == free[stop]
    assert completion.text == llm.tokenizer.decode(free[:stop], skip_special_tokens=True)
    # A generation config whose one EOS is not the tokenizer's (a fine-tune whose tokenizer ends turns
    # with another token): it stops the answer too.
    config.eos_token_id = free[stop]
    config.save_pretrained(model_dir)
    llm = LLM(model=str(model_dir), num_gpu_blocks=64)
    try:
        [out] = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == free[:stop + 1] and out.outputs[0].stop_reason == free[stop]


def test_chat_uses_the_chat_template(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64)
    try:
        out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4, temperature=0),
                       use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert out.prompt.startswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    assert 1 <= len(out.outputs[0].token_ids) <= 4


def test_chat_takes_vllms_template_options(tiny_model_dir):
    """chat_template, tools (to the template), chat_template_kwargs and continue_final_message."""
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64)
    template = ("{% if tools %}[{{ tools[0].function.name }}|{{ mood }}]{% endif %}{% for m in messages %}"
                "<{{ m['role'] }}>{{ m['content'] }}{% if not (continue_final_message and loop.last) %}</>{% endif %}"
                "{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    params = SamplingParams(max_tokens=2, temperature=0)
    try:
        opened = llm.chat(conversation, params, use_tqdm=False, add_generation_prompt=False,
                          continue_final_message=True, chat_template=template, tools=tools,
                          chat_template_kwargs={"mood": "calm"})[0]
        closed = llm.chat(conversation, params, use_tqdm=False, add_generation_prompt=False)[0]
        with pytest.raises(ValueError, match="cannot both be true"):
            llm.chat(conversation, params, continue_final_message=True)
        # A template that loops over a message's parts gets them (auto), text or parts alike.
        parts_template = "{% for m in messages %}{% for p in m['content'] %}({{ p['text'] }}){% endfor %}{% endfor %}"
        mixed = [{"role": "user", "content": "Hi"}, {"role": "user", "content": [{"type": "text", "text": "there"}]}]
        parts = llm.chat(mixed, params, use_tqdm=False, chat_template=parts_template)[0]
        as_text = llm.chat(mixed, params, use_tqdm=False, chat_template=template,
                           chat_template_content_format="string")[0]
        as_parts = llm.chat(mixed[:1], params, use_tqdm=False, chat_template=template,
                            chat_template_content_format="openai")[0]
        with pytest.raises(ValueError, match="chat_template_content_format"):
            llm.chat(mixed, params, chat_template_content_format="parts")
        with pytest.raises(ValueError, match="takes no images"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)
    finally:
        llm.shutdown()
    assert opened.prompt == "[get_weather|calm]<user>Hi</><assistant>Hello, I am"
    assert closed.prompt.endswith("<|im_start|>assistant\nHello, I am<|im_end|>\n")
    assert parts.prompt == "(Hi)(there)"
    assert as_text.prompt == "<user>Hi</><user>there</>"
    assert as_parts.prompt == "<user>[{'type': 'text', 'text': 'Hi'}]</>"


def test_an_fp8_kv_cache_holds_four_times_the_blocks_of_fp32_and_serves(tiny_model_dir):
    """The flag's way through LLM, the engine config and the executor to the worker (what an fp8
    cache answers is tested against a reference in tests/gpu_worker/test_kv_cache_dtype.py)."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    budget = 1 << 20
    blocks = {}
    for name in ("auto", "fp8"):
        llm = LLM(model=str(tiny_model_dir), kv_cache_memory_bytes=budget, kv_cache_dtype=name, max_model_len=256)
        try:
            outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
            assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6]
            blocks[name] = llm._engine.scheduler.cache_config.num_blocks
        finally:
            llm.shutdown()
    assert blocks["fp8"] == 4 * blocks["auto"]


def test_max_cpu_loras_keeps_one_adapter_in_memory_and_answers_as_peft(tiny_model_dir, tmp_path):
    """Two adapters alternating under --max-cpu-loras 1: the engine's worker reads the dropped one
    again when a request needs it, and every answer is PEFT's."""
    from cluster import LoRARequest
    from tests.lora_adapters import peft_greedy, save_adapter

    prompts = ["Hello world", "Paris is the capital of"]
    loras = [LoRARequest(name, i + 1, str(save_adapter(tiny_model_dir, tmp_path / name, seed=30 + i)))
             for i, name in enumerate("ab")]
    expected = [peft_greedy(tiny_model_dir, prompts, 6, seed=30 + i) for i in range(2)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, max_model_len=256, enable_lora=True, max_cpu_loras=1)
    try:
        manager = llm._engine.executor.worker.runner.lora
        for _ in range(2):
            for i, lora in enumerate(loras):
                got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False,
                                                                      lora_request=lora)]
                assert got == expected[i]
                assert manager.loaded_adapters() == [lora.lora_int_id]
        assert manager.max_cpu == 1 and manager.num_loads >= 4
    finally:
        llm.shutdown()


def test_bad_scheduler_flag_names_the_flag_and_engine(tiny_model_dir):
    with pytest.raises(ValueError, match="engine 1: max_num_seqs"):
        LLM(model=str(tiny_model_dir), num_engines=2, engine_overrides=[{}, {"max_num_seqs": 0}])
    with pytest.raises(ValueError, match="engine 0: engine_niceness"):
        LLM(model=str(tiny_model_dir), num_engines=2, engine_overrides=[{"engine_niceness": 20}, {}])


def test_pipeline_parallel_size_reaches_the_engines_which_run_on_ray(tiny_model_dir, monkeypatch):
    """vLLM's pipeline_parallel_size is an argument like tensor_parallel_size: TP x PP workers per
    engine, on Ray (the launcher stubbed: no engine starts)."""
    import cluster.launcher

    started = []
    monkeypatch.setattr(cluster.launcher, "ensure_ray", lambda *args, **kwargs: None)
    monkeypatch.setattr(cluster.launcher, "start_engines", lambda configs, namespace: started.extend(configs) or [])
    llm = LLM(model=str(tiny_model_dir), tensor_parallel_size=2, pipeline_parallel_size=2, num_gpu_blocks=16)
    llm.shutdown()
    assert llm.use_ray and [(c.pipeline_parallel_size, c.world_size) for c in started] == [(2, 4)]
    with pytest.raises(ValueError, match="engine 0: executor_backend must be 'ray' or 'auto' when"):
        LLM(model=str(tiny_model_dir), pipeline_parallel_size=2, executor_backend="uni")


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2_dir):
    llm = LLM(model="SmolLM2-135M-Instruct", num_gpu_blocks=256, max_model_len=2048)
    try:
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert "Paris" in out.outputs[0].text


def test_n_samples_and_stop_strings_as_vllm_scripts_use_them(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64)
    try:
        [free] = llm.generate("Paris is", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                              use_tqdm=False)
        text = free.outputs[0].text
        stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip())
        cut = text.index(stop)
        [out] = llm.generate("Paris is", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]),
                             use_tqdm=False)
        sample = out.outputs[0]
        assert (sample.text, sample.finish_reason, sample.stop_reason) == (text[:cut], "stop", stop)
        [kept] = llm.generate("Paris is", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=stop,
                                                         include_stop_str_in_output=True), use_tqdm=False)
        assert kept.outputs[0].text == text[:cut + len(stop)]
        # n samples per prompt, indexed, each seeded with seed + index (so different, and reproducible).
        params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
        runs = [llm.generate(["Hello", "Paris is"], params, use_tqdm=False) for _ in range(2)]
        assert [len(o.outputs) for o in runs[0]] == [3, 3]
        assert [s.index for s in runs[0][0].outputs] == [0, 1, 2]
        tokens = [[s.token_ids for s in o.outputs] for o in runs[0]]
        assert tokens == [[s.token_ids for s in o.outputs] for o in runs[1]]
        assert len({tuple(t) for t in tokens[0]}) > 1
        assert llm.get_stats()[0].num_free_blocks == llm.get_stats()[0].num_blocks  # stopped samples were aborted
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


def test_logit_bias_allowed_token_ids_and_bad_words_shape_what_the_engine_samples(tiny_model_dir):
    """On the real tiny model, in a batch with unconstrained requests: each constraint holds for its
    own request only."""
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, max_model_len=128)
    try:
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        free = llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
        first, second = free[0].outputs[0].token_ids[:2]
        forced = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logit_bias={42: 100})
        allowed = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=[5, 9, 77])
        banned_first = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, bad_words_token_ids=[[first]])
        banned_pair = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                     bad_words_token_ids=[[first, second]])
        outs = llm.generate([PROMPTS[0]] * 4 + [PROMPTS[1]],
                            [forced, allowed, banned_first, banned_pair, greedy], use_tqdm=False)
        word = llm.tokenizer.decode(free[0].outputs[0].token_ids[:1]).strip()
        by_word = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                           bad_words=[word]), use_tqdm=False)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, logit_bias={len(llm.tokenizer): 1.0}))
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens[0] == [42] * 8
    assert set(tokens[1]) <= {5, 9, 77} and len(set(tokens[1])) > 1
    assert tokens[2][0] != first
    # The pair is banned only where it would be completed: the first token is free, the second not.
    assert tokens[3][0] == first and tokens[3][1] != second
    assert tokens[4] == free[1].outputs[0].token_ids  # an unconstrained neighbour is untouched
    assert word and by_word[0].outputs[0].token_ids[0] != first  # the word, as the tokenizer splits it


def _whitespace_bias(tokenizer) -> dict[int, float]:
    """-100 on every whitespace-only token: a random model, free to pick JSON's optional whitespace,
    would otherwise spend its whole budget on it."""
    return {t: -100.0 for t in range(len(tokenizer))
            if (text := tokenizer.decode([t])) and not text.strip() and t not in tokenizer.all_special_ids}


def test_structured_output_holds_through_chunked_prefill_and_preemption(tiny_model_dir):
    """Every structured request's text fits its grammar and ends by the grammar's EOS, in a batch
    with unconstrained requests, a 16-token budget (chunked prefill) and too few blocks (preemption)."""
    import json
    import re

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
              "required": ["color", "n"], "additionalProperties": False}
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=14, max_num_batched_tokens=16, max_num_seqs=8,
              max_model_len=160)
    try:
        quiet = _whitespace_bias(llm.tokenizer)
        # Any JSON object: strings end only by a quote, so quotes and braces are favoured too.
        closing = {**quiet, **{llm.tokenizer.convert_tokens_to_ids(t): 5.0 for t in ('"', "}")}}
        specs = [{"regex": "[a-c]{3}-[0-9]{2}"}, {"choice": ["alpha", "beta gamma", "x.y"]},
                 {"json": schema}, {"json_object": True}, {"grammar": 'root ::= "yes" | "no" | "maybe"'}]
        biases = [None, None, quiet, closing, None]
        params = [SamplingParams(max_tokens=96, temperature=1.0, seed=i, structured_output=spec, logit_bias=bias)
                  for i, (spec, bias) in enumerate(zip(specs, biases, strict=True))]
        free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        prompts = [PROMPTS[3]] * len(specs) + PROMPTS[3:6]
        outs = llm.generate(prompts, params + [free] * 3, use_tqdm=False)
        stats = llm.get_stats()[0]
        with pytest.raises(ValueError, match="invalid regex"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, structured_output={"regex": "(a"}))
    finally:
        llm.shutdown()
    assert stats.num_preemptions > 0
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:len(specs)]), texts
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", texts[0])
    assert texts[1] in ("alpha", "beta gamma", "x.y")
    value = json.loads(texts[2])
    assert set(value) == {"color", "n"} and value["color"] in ("red", "green") and isinstance(value["n"], int)
    assert isinstance(json.loads(texts[3]), dict)
    assert texts[4] in ("yes", "no", "maybe")
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs[len(specs):])


def test_logprobs_and_prompt_logprobs_are_vllm_logprob_objects_matching_transformers(tiny_model_dir):
    """vLLM scripts read ``output.logprobs[i][token].logprob`` / ``.rank`` / ``.decoded_token``,
    ``cumulative_logprob`` and ``RequestOutput.prompt_logprobs``: each checked against HF's
    log-softmax, ranks included."""
    from cluster import Logprob

    prompt = PROMPTS[1]
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=32, max_model_len=128)
    try:
        [out] = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True,
                                                    logprobs=3, prompt_logprobs=2), use_tqdm=False)
        [plain] = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    finally:
        llm.shutdown()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    sample = out.outputs[0]
    ids = out.prompt_token_ids + sample.token_ids
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    def check(row: dict, position: int, token: int, k: int) -> None:
        expected = reference[position]
        assert next(iter(row)) == token and len(row) in (k, k + 1)
        for tid, lp in row.items():
            assert isinstance(lp, Logprob) and lp.decoded_token == tok.decode([tid])
            assert abs(lp.logprob - expected[tid].item()) < 1e-3
            assert lp.rank == int((expected > expected[tid]).sum()) + 1

    n = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    for p in range(1, n):  # position p - 1 predicts prompt token p
        check(out.prompt_logprobs[p], p - 1, out.prompt_token_ids[p], 2)
    assert len(sample.logprobs) == 6
    for i, row in enumerate(sample.logprobs):
        check(row, n - 1 + i, sample.token_ids[i], 3)
    total = sum(row[t].logprob for row, t in zip(sample.logprobs, sample.token_ids, strict=True))
    assert abs(sample.cumulative_logprob - total) < 1e-6
    assert plain.prompt_logprobs is None and plain.outputs[0].logprobs is None
    assert plain.outputs[0].cumulative_logprob is None


def test_bert_embeds_and_cross_encodes_as_transformers(tmp_path):
    """A BERT encoder (all-MiniLM-style: MEAN pooling, normalised) and a BERT cross-encoder
    (ms-marco-style: one output over [CLS], token type 1 for the second text): the engine turns
    chunked prefill and the prefix cache off for them, and the results equal transformers'."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    from tests.tiny_model import build_tiny_bert

    path = build_tiny_bert(tmp_path / "minilm", pooling_mode="pooling_mode_mean_tokens", normalize=True)
    # (Its sentence-transformers max_seq_length is the default max_model_len, as in vLLM.)
    (path / "sentence_bert_config.json").write_text('{"max_seq_length": 100, "do_lower_case": false}')
    # A budget set below max_model_len is refused; one left unset grows to it (vLLM's default).
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_model_len \(100\)"):
        LLM(model=str(path), num_gpu_blocks=64, max_num_batched_tokens=8)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    # (The third repeats the first, over a full KV block: a prefix-cache hit would start it mid-prompt.)
    texts = ["Hello world, the quick brown fox. " * 3, "Paris is the capital of France."]
    texts.append(texts[0])
    llm = LLM(model=str(path), max_num_batched_tokens=256)
    try:
        scheduler = llm._engine.scheduler
        assert not scheduler.scheduler_config.enable_chunked_prefill
        assert not scheduler.kv_cache_manager.enable_caching
        assert scheduler.scheduler_config.max_model_len == 100 and llm._engine.model_info.pooling.token_types
        # A streaming session cannot continue an encoder's prompt: refused at admission.
        with pytest.raises(RequestRefusedError, match="serves no streaming session"):
            llm._engine.check_servable(EngineCoreRequest(
                request_id="s", prompt_token_ids=[2, 5, 3], resumable=True,
                sampling_params=EngineSamplingParams(max_tokens=1, embed=True)))
        outs = llm.embed(texts, use_tqdm=False)
        with pytest.raises(ValueError, match="does not generate"):
            llm.generate(texts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    for out, text in zip(outs, texts, strict=True):
        ids = tok(text).input_ids
        assert out.prompt_token_ids == ids and ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
        with torch.no_grad():
            mean = model(torch.tensor([ids])).last_hidden_state[0].mean(0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), mean / mean.norm(), atol=1e-5, rtol=1e-5)

    # bge-m3-like: more positions than the default budget, which grows to hold a whole prompt.
    path = build_tiny_bert(tmp_path / "long", max_positions=4096)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=str(path))
    try:
        assert llm._engine.scheduler.scheduler_config.token_budget == 4096
        long_ids = tok("hello world " * 1500).input_ids
        [out] = llm.embed([long_ids], use_tqdm=False)
    finally:
        llm.shutdown()
    with torch.no_grad():
        cls = model(torch.tensor([long_ids])).last_hidden_state[0, 0]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), cls / cls.norm(), atol=1e-5, rtol=1e-5)

    path = build_tiny_bert(tmp_path / "ms-marco", num_labels=1)
    # Its head reads [CLS], as transformers runs it: another pooling is refused.
    with pytest.raises(ValueError, match="reads CLS pooling; drop pooling_type"):
        LLM(model=str(path), pooler_config={"pooling_type": "MEAN"})
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    query, docs = "what is the capital of france?", ["Paris is the capital of France.", "Berlin is in Germany."]
    llm = LLM(model=str(path))
    try:
        scored = llm.score(query, docs, use_tqdm=False)
    finally:
        llm.shutdown()
    for out, doc in zip(scored, docs, strict=True):
        pair = tok(query, text_pair=doc, return_tensors="pt")
        assert out.prompt_token_ids == pair.input_ids[0].tolist() and 1 in pair.token_type_ids[0].tolist()
        with torch.no_grad():
            logit = model(**pair).logits[0, 0]
        assert out.outputs.score == pytest.approx(float(torch.sigmoid(logit)), abs=1e-5)


def test_token_types_are_refused_by_a_model_without_them(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=16, max_model_len=128, runner="pooling")
    try:
        assert not llm._engine.model_info.pooling.token_types
        with pytest.raises(RequestRefusedError, match="takes no token types"):
            llm._engine.add_request(EngineCoreRequest(
                request_id="t", prompt_token_ids=[5, 6, 7],
                sampling_params=EngineSamplingParams(max_tokens=1, embed=True, compressed_token_type_ids=1)))
    finally:
        llm.shutdown()


def test_a_labse_style_model_projects_its_pooled_embedding_through_its_dense_modules(tmp_path):
    """LaBSE (BERT, CLS pooling, Dense 768 -> 768 with tanh, Normalize) and longer
    chains: the pooled state goes through each Dense module (here 64 -> 32 tanh, then 32 -> 16 with
    no bias or activation, from an older pytorch_model.bin), then is normalised; the model reports
    16-value embeddings."""
    from transformers import AutoModel

    from tests.gpu_worker.test_pooler_config import add_dense
    from tests.tiny_model import build_tiny_bert

    path = build_tiny_bert(tmp_path / "labse", pooling_mode="pooling_mode_cls_token", normalize=True)
    w1, b1 = add_dense(path, 2, 64, 32)
    w2, _ = add_dense(path, 3, 32, 16, activation="Identity", bias=False, weights="bin", seed=1)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(model=str(path))
    try:
        assert llm._engine.model_info.hidden_size == 16
        outs = llm.embed(PROMPTS[:3], use_tqdm=False)
        raw = llm.embed(PROMPTS[:1], use_tqdm=False, normalize=False)[0].outputs.embedding
        # (LaBSE was not trained for shorter embeddings: vLLM refuses dimensions.)
        with pytest.raises(ValueError, match="does not support matryoshka representation"):
            llm.embed(PROMPTS[:1], use_tqdm=False, dimensions=8)
    finally:
        llm.shutdown()
    for i, (out, prompt) in enumerate(zip(outs, PROMPTS[:3], strict=True)):
        with torch.no_grad():
            cls = model(**tok(prompt, return_tensors="pt")).last_hidden_state[0, 0]
        projected = torch.tanh(cls @ w1.T + b1) @ w2.T
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), projected / projected.norm(),
                                   atol=1e-5, rtol=1e-5)
        if i == 0:
            torch.testing.assert_close(torch.tensor(raw), projected, atol=1e-5, rtol=1e-5)


def test_an_embeddinggemma_style_model_embeds_as_its_sentence_transformers_pipeline(tmp_path):
    """EmbeddingGemma's pipeline: bidirectional Gemma 3 (an encoder: whole prompts, no prefix
    cache), MEAN pooling, two Dense projections without activation (64 -> 128 -> 32 here), Normalize."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    from tests.gpu_worker.test_pooler_config import add_dense
    from tests.tiny_model import _write_sentence_transformers_files, build_tokenizer

    tokenizer = build_tokenizer()
    path = tmp_path / "embeddinggemma"
    torch.manual_seed(5)
    model = Gemma3TextModel(Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=3,
        max_position_embeddings=256, use_bidirectional_attention=True, architectures=["Gemma3TextModel"])).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _write_sentence_transformers_files(path, "pooling_mode_mean_tokens", normalize=True)
    w1, _ = add_dense(path, 2, 64, 128, activation="Identity", bias=False)
    w2, _ = add_dense(path, 3, 128, 32, activation="Identity", bias=False, seed=1)
    llm = LLM(model=str(path))
    try:
        assert not llm._engine.scheduler.kv_cache_manager.enable_caching and llm._engine.model_info.hidden_size == 32
        outs = llm.embed(PROMPTS[:4], use_tqdm=False)
    finally:
        llm.shutdown()
    for out, prompt in zip(outs, PROMPTS[:4], strict=True):
        with torch.no_grad():
            mean = model(torch.tensor([tokenizer.encode(prompt)])).last_hidden_state[0].mean(0)
        projected = mean @ w1.T @ w2.T
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), projected / projected.norm(),
                                   atol=1e-5, rtol=1e-5)


def test_without_chunked_prefill_an_unset_budget_holds_a_whole_context_on_the_workers_too(tmp_path):
    """A decoder served without chunked prefill and no --max-num-batched-tokens: the budget grows to
    the model's 4096 positions (vLLM's default), for the scheduler and the workers alike (so that a
    profiled pass is the size of the passes that run)."""
    from tests.tiny_model import build_tiny_llama

    path = build_tiny_llama(tmp_path / "long", max_positions=4096)
    llm = LLM(model=str(path), enable_chunked_prefill=False, num_gpu_blocks=260)
    try:
        assert llm._engine.scheduler_config.token_budget == 4096
        assert llm._engine.executor.worker.runner.max_num_batched_tokens == 4096
    finally:
        llm.shutdown()


def test_a_bert_token_classifier_tags_every_token_through_encode(tmp_path):
    """BertForTokenClassification (NER): LLM.encode gives each prompt token's class probabilities
    (softmax of transformers' logits); LLM.classify refers to it; on an embedding model encode is
    its embedding."""
    from transformers import AutoModelForTokenClassification

    from tests.tiny_model import build_tiny_bert

    # (Its sentence-transformers files' MEAN pooling does not apply: the head classifies every token.)
    path = build_tiny_bert(tmp_path / "ner", num_labels=5, per_token=True, pooling_mode="pooling_mode_mean_tokens")
    model = AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["Paris is the capital of France.", "Hello world"]
    llm = LLM(model=str(path))
    try:
        tagged = llm.encode(texts, use_tqdm=False)
        with pytest.raises(ValueError, match=r"classifies every token .*: LLM\.encode"):
            llm.classify(texts, use_tqdm=False)
    finally:
        llm.shutdown()
    for out, text in zip(tagged, texts, strict=True):
        ids = tok(text).input_ids
        with torch.no_grad():
            expected = torch.softmax(model(torch.tensor([ids])).logits[0], dim=-1)
        assert out.prompt_token_ids == ids
        torch.testing.assert_close(out.outputs.data.to(torch.float32), expected, atol=1e-5, rtol=1e-5)

    path = build_tiny_bert(tmp_path / "embedder", pooling_mode="pooling_mode_mean_tokens")
    llm = LLM(model=str(path))
    try:
        encoded = llm.encode(texts[:1], use_tqdm=False)[0].outputs.data
        assert isinstance(encoded, torch.Tensor)  # (vLLM's PoolingOutput.data is a tensor)
        assert encoded.tolist() == pytest.approx(llm.embed(texts[:1], use_tqdm=False)[0].outputs.embedding, abs=1e-6)
        # vLLM's token_embed task: every token's final state, each normalised as the model normalises.
        [per_token] = llm.encode(texts[:1], use_tqdm=False, pooling_task="token_embed")
        with pytest.raises(ValueError, match="the model is an embedding model"):
            llm.encode(texts[:1], use_tqdm=False, pooling_task="token_classify")
    finally:
        llm.shutdown()
    from transformers import AutoModel

    with torch.no_grad():
        states = AutoModel.from_pretrained(path, dtype=torch.float32)(torch.tensor([per_token.prompt_token_ids]))
    torch.testing.assert_close(per_token.outputs.data.to(torch.float32),
                               torch.nn.functional.normalize(states.last_hidden_state[0], dim=1), atol=1e-5, rtol=1e-5)


def test_reward_models_score_each_step_and_token_through_reward(ray_cluster, tmp_path):
    """Qwen2ForProcessRewardModel through LLM on two TP ranks, its prompts chunked: LLM.reward gives
    the two classes' probabilities at each "<extra_0>" (the softmax of its reference's logits there),
    and refers LLM.classify and LLM.embed to itself; Qwen2ForRewardModel (one rank) gives every
    token's raw reward."""
    from tests.tiny_model import build_tiny_reward_model

    texts = ["Step one: add the numbers.<extra_0>Step two: carry the one.<extra_0>", "Hello world<extra_0>",
             "No steps here"]
    for architecture in ("Qwen2ForProcessRewardModel", "Qwen2ForRewardModel"):
        path = tmp_path / architecture
        reference = build_tiny_reward_model(path, architecture)
        tok = AutoTokenizer.from_pretrained(path)
        tp = 2 if architecture == "Qwen2ForProcessRewardModel" else 1
        llm = LLM(model=str(path), tensor_parallel_size=tp, max_num_batched_tokens=8, long_prefill_token_threshold=5)
        try:
            rewarded = llm.reward(texts, use_tqdm=False)
            for refused in (llm.classify, llm.embed):
                with pytest.raises(ValueError, match="classifies every token"):
                    refused(texts, use_tqdm=False)
            with pytest.raises(ValueError, match="classifies every token"):
                llm.score(texts[0], texts[1:], use_tqdm=False)
        finally:
            llm.shutdown()
        for out, text in zip(rewarded, texts, strict=True):
            ids = tok(text).input_ids
            assert out.prompt_token_ids == ids
            if architecture == "Qwen2ForProcessRewardModel":
                steps = [i for i, t in enumerate(ids) if t == tok.convert_tokens_to_ids("<extra_0>")]
                expected = torch.softmax(reference(ids)[steps], dim=-1)
                assert bool(steps) == bool(out.outputs.data.numel())  # ("No steps here": no rows)
            else:  # (vLLM's sigmoid over one output)
                expected = torch.sigmoid(reference(ids))
                assert len(out.outputs.data) == len(ids)
            got = out.outputs.data.to(torch.float32).view(-1, expected.shape[1])
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_bge_m3_gives_dense_sparse_and_colbert_outputs_through_encode(tmp_path):
    """An XLM-RoBERTa served as BGE-M3 (--hf-overrides naming BgeM3EmbeddingModel, as vLLM serves
    it): LLM.embed its dense embedding, LLM.encode with vLLM's token_classify its lexical weights and
    with token_embed its ColBERT vectors, as FlagEmbedding computes them from the tokenizer's ids."""
    import json

    from tests.gpu_worker.test_encoders import save_tiny_bge_m3
    from tests.tiny_model import build_wordpiece_tokenizer

    tok = build_wordpiece_tokenizer()
    path, reference = save_tiny_bge_m3(tmp_path, vocab_size=len(tok), bos_token_id=tok.cls_token_id,
                                       eos_token_id=tok.sep_token_id)
    tok.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["XLMRobertaModel"]}))
    texts = ["Paris is the capital of France.", "hello world"]
    llm = LLM(model=str(path), hf_overrides={"architectures": ["BgeM3EmbeddingModel"]})
    try:
        dense = llm.embed(texts, use_tqdm=False)
        lexical = llm.encode(texts, use_tqdm=False, pooling_task="token_classify")
        colbert = llm.encode(texts, use_tqdm=False, pooling_task="token_embed")
    finally:
        llm.shutdown()
    for d, s, c, text in zip(dense, lexical, colbert, texts, strict=True):
        want_dense, want_lexical, want_colbert = reference(tok(text).input_ids)
        torch.testing.assert_close(torch.tensor(d.outputs.embedding), want_dense, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s.outputs.data, want_lexical, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c.outputs.data, want_colbert, atol=1e-5, rtol=1e-5)


COLBERT_QUERY, COLBERT_DOCS = "what is the capital of france", ["paris is the capital of france", "hello world"]


def _assert_colbert_outputs(vectors, scores, hf, tok, weight, query, docs) -> None:
    """The query's vectors from LLM.encode are its tokens' states (transformers') through the
    projection ``weight``, normalised; each LLM.score is MaxSim over such vectors."""

    def token_vectors(text: str) -> torch.Tensor:
        with torch.no_grad():
            states = hf(torch.tensor([tok(text).input_ids])).last_hidden_state[0]
        return torch.nn.functional.normalize(states @ weight.T, dim=1)

    torch.testing.assert_close(vectors.outputs.data, token_vectors(query), atol=1e-5, rtol=1e-5)
    for out, doc in zip(scores, docs, strict=True):
        expected = (token_vectors(query) @ token_vectors(doc).T).max(dim=1).values.sum()
        assert out.outputs.score == pytest.approx(float(expected), abs=1e-4)


def test_a_colbert_model_scores_by_maxsim_through_score(tmp_path):
    """HF_ColBERT through LLM: LLM.score is each pair's MaxSim over the two texts' normalised token
    vectors (BERT's states through its projection), as ColBERT scores; LLM.encode gives the vectors."""
    from tests.gpu_worker.test_encoders import save_tiny_colbert
    from tests.tiny_model import build_wordpiece_tokenizer

    tok = build_wordpiece_tokenizer()
    path, hf, weight = save_tiny_colbert(tmp_path, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    tok.save_pretrained(path)
    query, docs = COLBERT_QUERY, COLBERT_DOCS
    llm = LLM(model=str(path))
    try:
        scores = llm.score(query, docs, use_tqdm=False)
        [vectors] = llm.encode([query], use_tqdm=False)
        with pytest.raises(ValueError, match="pools every token"):
            llm.embed([query], use_tqdm=False)
    finally:
        llm.shutdown()
    _assert_colbert_outputs(vectors, scores, hf, tok, weight, query, docs)
    with pytest.raises(ValueError, match="a ColBERT model pools every token"):
        LLM(model=str(path), pooler_config={"pooling_type": "CLS"})


def test_a_pylate_modernbert_colbert_projects_each_token_through_its_dense_module(tmp_path):
    """GTE-ModernColBERT-style (PyLate): a ModernBERT whose sentence-transformers files list a Dense
    module and no Pooling, served with --hf-overrides naming ColBERTModernBertModel (vLLM's recipe):
    each token's state through the Dense projection, normalised; MaxSim scores."""
    import json

    from safetensors.torch import save_file

    from tests.gpu_worker.test_encoders import save_tiny_encoder
    from tests.tiny_model import build_wordpiece_tokenizer

    tok = build_wordpiece_tokenizer()
    path, hf = save_tiny_encoder(tmp_path, "modernbert", vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                 cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id)
    tok.save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Dense").mkdir()
    (path / "1_Dense" / "config.json").write_text(json.dumps({
        "in_features": 64, "out_features": 24, "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity"}))
    torch.manual_seed(19)
    weight = torch.randn(24, 64) * 0.3
    save_file({"linear.weight": weight}, str(path / "1_Dense" / "model.safetensors"))
    query, docs = COLBERT_QUERY, COLBERT_DOCS
    llm = LLM(model=str(path), hf_overrides={"architectures": ["ColBERTModernBertModel"]})
    try:
        [vectors] = llm.encode([query], use_tqdm=False)
        scores = llm.score(query, docs, use_tqdm=False)
    finally:
        llm.shutdown()
    _assert_colbert_outputs(vectors, scores, hf, tok, weight, query, docs)


def test_generate_without_parameters_uses_the_models_generation_config(tmp_path, tiny_model_dir):
    """vLLM's get_default_sampling_params: the model's generation_config.json sampling (greedy and
    5 tokens here), its max_new_tokens as max_tokens; generation_config="vllm" leaves it out."""
    import json
    import shutil

    model_dir = tmp_path / "greedy-model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0,
                                                                  "max_new_tokens": 5, "top_k": 20}))
    prompt = [5, 6, 7, 8]
    llm = LLM(model=str(model_dir), num_gpu_blocks=64)
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens, defaults.top_k, defaults.top_p) == (0.0, 5, 20, 1.0)
        [plain] = llm.generate(prompt, use_tqdm=False)
        [greedy] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
        assert plain.outputs[0].token_ids == greedy.outputs[0].token_ids
        assert len(plain.outputs[0].token_ids) <= 5
    finally:
        llm.shutdown()
    neutral = LLM(model=str(model_dir), num_gpu_blocks=64, generation_config="vllm",
                  override_generation_config={"max_new_tokens": 3})
    try:
        defaults = neutral.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (1.0, 3, 0)
    finally:
        neutral.shutdown()
    with pytest.raises(ValueError, match="engine 0: override_generation_config: top_p must be in"):
        LLM(model=str(model_dir), num_gpu_blocks=64, override_generation_config={"top_p": 0})


def test_a_generation_config_value_no_request_could_send_is_left_out_and_embedders_never_read_it(
        tmp_path, tiny_model_dir):
    import json
    import shutil

    model_dir = tmp_path / "odd-config"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**config, "top_p": 0, "top_k": 20.0,
                                                                  "temperature": 0.3}))
    llm = LLM(model=str(model_dir), num_gpu_blocks=64)  # (vLLM starts too)
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.3, 1.0, 0)
    finally:
        llm.shutdown()
    embedder = LLM(model=str(model_dir), num_gpu_blocks=64, runner="pooling",
                   override_generation_config={"temperature": 0.5})
    try:
        assert embedder._model_info().default_sampling_params == {}
    finally:
        embedder.shutdown()


def test_max_logprobs_bounds_a_requests_logprobs_and_minus_one_asks_for_the_vocabulary(tiny_model_dir):
    """vLLM's max_logprobs (default 20): more is refused before anything runs; with -1 a request may
    ask for every token's logprob (logprobs=-1), which agree with the top-20 ones."""
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64)
    try:
        for params in (SamplingParams(max_tokens=2, logprobs=21), SamplingParams(max_tokens=2, prompt_logprobs=-1)):
            with pytest.raises(ValueError, match="which is greater than max allowed: 20"):
                llm.generate([5, 6, 7], params, use_tqdm=False)
        assert llm.get_stats()[0].num_free_blocks == llm.get_stats()[0].num_blocks
    finally:
        llm.shutdown()
    wide = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, max_logprobs=-1)
    try:
        vocab = wide._model_info().vocab_size
        greedy = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
        [every] = wide.generate([5, 6, 7], SamplingParams(**greedy, logprobs=-1, prompt_logprobs=-1), use_tqdm=False)
        [top] = wide.generate([5, 6, 7], SamplingParams(**greedy, logprobs=20), use_tqdm=False)
    finally:
        wide.shutdown()
    assert every.outputs[0].token_ids == top.outputs[0].token_ids
    for all_rows, top_rows in zip(every.outputs[0].logprobs, top.outputs[0].logprobs, strict=True):
        assert len(all_rows) == vocab  # (the sampled token is one of them)
        assert sorted(r.rank for r in all_rows.values()) == list(range(1, vocab + 1))
        for token, logprob in top_rows.items():
            assert all_rows[token].logprob == pytest.approx(logprob.logprob, abs=1e-5)
    assert all(len(row) == vocab for row in every.prompt_logprobs[1:])


def test_prompt_logprobs_are_the_same_scored_a_few_rows_at_a_time(tiny_model_dir, monkeypatch):
    """A long prompt's logprobs are scored in slices of max_num_seqs rows (what the memory profile
    covers): the same values as in one go. Prompt logprobs beyond what one answer may carry are
    refused before anything runs."""
    import engine_core.engine_core as engine_core

    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=5)
    answers = []
    for max_num_seqs in (256, 3):
        llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, max_num_seqs=max_num_seqs)
        try:
            answers.append(llm.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs)
            if max_num_seqs == 3:
                monkeypatch.setattr(engine_core, "MAX_PROMPT_LOGPROB_VALUES", 6 * 38)
                with pytest.raises(ValueError, match="prompt_logprobs of 5 over a prompt of 40 tokens is 234 values"):
                    llm.generate(prompt, params, use_tqdm=False)
                assert llm.get_stats()[0].num_free_blocks == llm.get_stats()[0].num_blocks
        finally:
            llm.shutdown()
    whole, sliced = answers
    assert len(whole) == len(prompt) and whole[0] is None
    for a, b in zip(whole[1:], sliced[1:], strict=True):
        assert a.keys() == b.keys() and len(a) >= 5
        assert all(a[t].rank == b[t].rank and a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)


def test_another_tokenizer_directory_writes_the_prompts(tmp_path, tiny_model_dir):
    """vLLM's --tokenizer (a GGUF model's original tokenizer, say): its chat template writes the
    prompts, the engine knows where it is, and one the model cannot serve stops the start."""
    from tests.tiny_model import build_tokenizer

    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    tokenizer.save_pretrained(tokenizer_dir)
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, tokenizer=str(tokenizer_dir))
    try:
        out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2, temperature=0),
                       use_tqdm=False)[0]
        assert out.prompt == "<<Hi>>" and llm._model_info().tokenizer_dir == str(tokenizer_dir.resolve())
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match=r"tokenizer .*: not a directory"):  # (before anything loads)
        LLM(model=str(tiny_model_dir), num_gpu_blocks=64, tokenizer=str(tmp_path / "missing"))
    larger = tmp_path / "larger"
    build_tokenizer(vocab_size=500).save_pretrained(larger)
    with pytest.raises(ValueError, match=r"engine 0: tokenizer .*: its \d+ tokens are more than the model's"):
        LLM(model=str(tiny_model_dir), num_gpu_blocks=64, tokenizer=str(larger))


def test_a_prompts_cache_salt_keeps_its_prefix_cache_blocks_its_own(tiny_model_dir):
    """vLLM's cache_salt in a prompt dict: the same prompt under another salt (or none) finds no
    cached block, under the same salt it does; the answers are the same."""
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, block_size=4, max_model_len=128)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    prompt = list(range(5, 30))
    try:
        def run(salt: str | None):
            out = llm.generate({"prompt_token_ids": prompt, **({"cache_salt": salt} if salt else {})}, params,
                               use_tqdm=False)[0]
            return out.num_cached_tokens, out.outputs[0].token_ids

        first = run("tenant-a")
        assert first[0] == 0
        assert run("tenant-b")[0] == 0 and run(None)[0] == 0
        again = run("tenant-a")
        assert again[0] == 24 and again[1] == first[1]  # every full block of the prompt, the answer unchanged
        assert run(None)[0] == 24
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate({"prompt": "Hello", "cache_salt": ""}, params, use_tqdm=False)
    finally:
        llm.shutdown()


def test_beam_search_returns_the_best_beams_with_their_true_likelihoods(tiny_model_dir):
    """vLLM's LLM.beam_search on a real engine: each beam's cumulative logprob is its continuation's
    log-likelihood as the engine scores the whole sequence (prompt logprobs), the beams are distinct
    and best first, and a search one beam wide is greedy decoding."""
    from cluster import BeamSearchParams

    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=128, block_size=4, max_model_len=128)
    prompt = [5, 6, 7, 8, 9]
    try:
        found = {width: llm.beam_search([{"prompt_token_ids": prompt, "cache_salt": "beams"}],
                                        BeamSearchParams(beam_width=width, max_tokens=4, ignore_eos=True))[0]
                 for width in (1, 3)}
        beams = found[3].sequences
        assert len(beams) == 3 and len({tuple(b.tokens) for b in beams}) == 3
        assert all(b.tokens[:5] == prompt and len(b.tokens) == 9 and b.finish_reason == "length" for b in beams)
        cums = [b.cum_logprob for b in beams]
        assert cums == sorted(cums, reverse=True)  # (one length: the score orders by cumulative logprob)
        greedy = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        assert found[1].sequences[0].tokens[5:] == greedy[0].outputs[0].token_ids
        scored = llm.generate([b.tokens for b in beams], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)
        for beam, out in zip(beams, scored, strict=True):
            likelihood = sum(out.prompt_logprobs[i][beam.tokens[i]].logprob for i in range(5, 9))
            assert beam.cum_logprob == pytest.approx(likelihood, abs=1e-3)
            assert [next(iter(step)) for step in beam.logprobs] == beam.tokens[5:]
            assert beam.text == llm.tokenizer.decode(beam.tokens)
        with pytest.raises(ValueError, match="at least 1"):
            llm.beam_search([prompt], BeamSearchParams(beam_width=0, max_tokens=4))
    finally:
        llm.shutdown()


def test_custom_logits_processors_steer_only_the_requests_that_ask_through_preemption(tiny_model_dir):
    from tests.logits_processors import NoEchoAdapter, OnlyTheBestProcessor

    max_tokens = 24
    # The preemption test's pressure (chunked prefill, preemption) keeps the batch changing under the processors.
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=12, max_num_batched_tokens=16, max_num_seqs=8,
              max_model_len=128, logits_processors=["tests.logits_processors:TargetTokenProcessor", NoEchoAdapter,
                                                    OnlyTheBestProcessor])
    try:
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                 extra_args={"target_token": 100 + i} if i % 2 == 0 else None)
                  for i in range(len(PROMPTS))]
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.get_stats()[0].num_preemptions > 0, "the KV pool was meant to force preemption"
        # Random sampling that keeps only the best logit (argmax-invariant: after the temperature) is greedy.
        greedy = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        best = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=8, temperature=1.0,
                                                        extra_args={"only_the_best": True}), use_tqdm=False)
        no_echo = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                       extra_args={"no_echo": True}), use_tqdm=False)
        with pytest.raises(ValueError, match="target_token must be a non-negative integer"):
            llm.generate(PROMPTS[:1], SamplingParams(extra_args={"target_token": -1}), use_tqdm=False)
        stats = llm.get_stats()[0]
    finally:
        llm.shutdown()
    expected = hf_greedy(tiny_model_dir, PROMPTS, max_tokens)
    for i, out in enumerate(outputs):
        tokens = out.outputs[0].token_ids
        assert tokens == ([100 + i] * max_tokens if i % 2 == 0 else expected[i]), i
    assert [o.outputs[0].token_ids for o in best] == [o.outputs[0].token_ids for o in greedy]
    for out in no_echo:
        tokens = out.outputs[0].token_ids
        assert not set(tokens) & set(out.prompt_token_ids)
        assert all(a != b for a, b in itertools.pairwise(tokens))
    assert stats.num_free_blocks == stats.num_blocks


def test_a_pooling_model_takes_no_custom_logits_processors(tiny_model_dir):
    with pytest.raises(ValueError, match="a pooling model samples nothing"):
        LLM(model=str(tiny_model_dir), num_gpu_blocks=16, runner="pooling",
            logits_processors=["tests.logits_processors:TargetTokenProcessor"])


def test_loaded_processors_change_no_other_request_while_the_batch_is_reordered(tiny_model_dir):
    """With processors loaded, every step's rows are in the batch's index order, not the runner's:
    requests that do not turn a processor on (logprobs, a grammar, penalties, stop ids, sampling with
    a seed, different lengths, so the batch changes as they end) get exactly what they get without."""
    from gpu_worker.logits_processor_batch import LogitsProcessorBatch

    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(3)] + [
        SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, structured_output={"regex": "[a-z ]{5,15}"}),
        SamplingParams(max_tokens=12, temperature=0.9, seed=5, logprobs=1, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[40, 41, 42, 43], logprobs=0),
    ]
    reorders = []
    arrange = LogitsProcessorBatch.arrange

    def counting(self, states):
        order = arrange(self, states)
        reorders.append(order != list(range(len(order))))
        return order

    answers = []
    for processors in ([], ["tests.logits_processors:TargetTokenProcessor"]):
        llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, max_num_seqs=8, logits_processors=processors)
        try:
            LogitsProcessorBatch.arrange = counting
            answers.append(llm.generate(PROMPTS, params, use_tqdm=False))
        finally:
            LogitsProcessorBatch.arrange = arrange
            llm.shutdown()
    assert any(reorders), "the batch was meant to be reordered"
    for a, b in zip(*answers, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert (y.token_ids, y.finish_reason, y.text) == (x.token_ids, x.finish_reason, x.text)
        assert (y.logprobs is None) == (x.logprobs is None)
        for px, py in zip(x.logprobs or [], y.logprobs or [], strict=True):
            assert list(px) == list(py)
            assert [p.logprob for p in py.values()] == pytest.approx([p.logprob for p in px.values()], abs=1e-5)


def test_kv_offloading_brings_evicted_prefixes_back_from_host_memory(tiny_model_dir):
    """--kv-offloading-size: a prompt whose blocks the KV cache evicted finds them in the host tier
    (cached tokens, no recompute) and answers as transformers does; without the tier it recomputes.
    Under preemption and chunked prefill the answers stay transformers' too."""
    from engine_core.core.block_pool import BLOCKS_STORED, TIER_STORED

    first = "The quick brown fox jumps over the lazy dog. " * 6
    others = [f"Story number {i}: once upon a time there was a kingdom far away, with hills. " for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    found = {}
    for size in (None, 0.001):
        llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=12, max_model_len=128, kv_offloading_size=size)
        try:
            before = llm.generate([first], params, use_tqdm=False)
            llm.generate(others, params, use_tqdm=False)  # (their blocks push the first prompt's out)
            # What prefix-aware routers are told the engine holds: its host tier's blocks too.
            snapshot = dict(llm._engine.kv_snapshot())
            if size is not None:
                assert snapshot[TIER_STORED] == llm._engine.scheduler.kv_cache_manager.offload.hashes()
                assert len(snapshot[TIER_STORED]) >= 3 and not set(snapshot[TIER_STORED]) & set(snapshot[BLOCKS_STORED])
            else:
                assert TIER_STORED not in snapshot
            again = llm.generate([first], params, use_tqdm=False)
            stats = llm.get_stats()[0]
        finally:
            llm.shutdown()
        assert again[0].outputs[0].token_ids == before[0].outputs[0].token_ids == hf_greedy(tiny_model_dir, [first],
                                                                                            8)[0]
        found[size] = (again[0].num_cached_tokens, stats)
    assert found[None][0] == 0 and found[None][1].num_offload_blocks == 0
    cached, stats = found[0.001]
    assert cached >= 48 and stats.kv_offload_loaded_blocks >= 3 and stats.kv_offload_stored_blocks > 0
    assert stats.external_prefix_cache_queries > stats.external_prefix_cache_hits >= 48
    assert found[None][1].external_prefix_cache_queries == 0
    assert stats.num_offload_blocks > 0 and stats.num_free_blocks == stats.num_blocks
    # A small tier under preemption: blocks come and go between the two tiers while answers hold.
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=12, max_num_batched_tokens=16, max_num_seqs=8,
              max_model_len=128, kv_offloading_size=0.0002)
    try:
        greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(PROMPTS + PROMPTS[::-1], greedy, use_tqdm=False)
        stats = llm.get_stats()[0]
    finally:
        llm.shutdown()
    expected = hf_greedy(tiny_model_dir, PROMPTS, 24)
    assert [o.outputs[0].token_ids for o in outputs] == expected + expected[::-1]
    assert stats.num_preemptions > 0 and stats.kv_offload_loaded_blocks > 0


def test_a_pass_cut_short_leaves_no_uncomputed_block_in_the_prefix_cache_or_the_host_tier(tiny_model_dir):
    """Ctrl-C (or an error) inside a pass: the blocks it had registered were never computed (nor its
    host-tier copies made), so the offline LLM forgets the prefix cache rather than serve them."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=12, max_model_len=128, kv_offloading_size=0.001)
    try:
        executor = llm._engine.executor
        real = executor.execute_model

        def interrupted(scheduler_output):
            executor.execute_model = real
            raise KeyboardInterrupt

        executor.execute_model = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.generate([prompt], params, use_tqdm=False)
        manager = llm._engine.scheduler.kv_cache_manager
        assert not manager.block_pool.cached_block_hash_to_block and manager.offload.hashes() == []
        again = llm.generate([prompt], params, use_tqdm=False)[0]
        stats = llm.get_stats()[0]
    finally:
        llm.shutdown()
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == hf_greedy(tiny_model_dir, [prompt], 6)[0]
    assert stats.num_free_blocks == stats.num_blocks


def test_a_pooling_or_windowed_model_takes_no_kv_offloading(tiny_model_dir, tmp_path):
    from tests.cluster.test_spec_decode import _windowed_copy

    windowed = _windowed_copy(tiny_model_dir, tmp_path / "windowed", 16)
    with pytest.raises(ValueError, match="a sliding-window model releases"):
        LLM(model=str(windowed), num_gpu_blocks=16, kv_offloading_size=0.001)
    with pytest.raises(ValueError, match="kv_offloading_size must be unset without the prefix cache"):
        LLM(model=str(tiny_model_dir), num_gpu_blocks=16, kv_offloading_size=0.001, enable_prefix_caching=False)


def test_an_answers_text_reads_as_after_the_prompt_and_keeps_its_stop_token_when_asked():
    """The text of a sample no stop string ended: with a SentencePiece vocabulary a decode of the
    generated ids alone lost the first word's space ("Paris." for " Paris."); a stop token stays in
    the text under include_stop_str_in_output, as over HTTP (vLLM)."""
    from cluster.llm import _Pending
    from tests.router.tokenizer_factory import sentencepiece_style_tokenizer

    tok = sentencepiece_style_tokenizer()
    llm = object.__new__(LLM)  # (only the tokenizer is needed to build a text)
    llm.tokenizer = tok
    prompt = tok.encode("Paris is", add_special_tokens=False)
    answer = tok.encode("the capital.", add_special_tokens=False)
    period = answer[-1]
    for include_stop, expected in ((False, " the capital"), (True, " the capital.")):
        p = _Pending("Paris is", prompt, False, include_stop=include_stop)
        p.token_ids, p.finish_reason, p.stop_reason = answer, "stop", period  # (stop_token_ids=[period])
        assert llm._text(p) == expected
    p = _Pending("Paris is", prompt, False)
    p.token_ids, p.finish_reason = answer, "length"
    assert llm._text(p) == " the capital."


def test_chat_takes_its_parameters_in_vllms_order():
    """Positional calls written for vLLM's LLM.chat bind the same here (lora_request fourth: it
    used to bind to add_generation_prompt and run the base model)."""
    import inspect

    names = list(inspect.signature(LLM.chat).parameters)[1:]
    assert names[:6] == ["messages", "sampling_params", "use_tqdm", "lora_request", "chat_template",
                         "chat_template_content_format"]
    assert names[6:] == ["add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs"]


def test_offline_sampling_params_refuse_what_vllms_refuse_and_read_seed_minus_one_as_none():
    with pytest.raises(ValueError, match="greedy"):
        SamplingParams(n=2, temperature=0)
    with pytest.raises(ValueError, match="empty string"):
        SamplingParams(stop=["end", ""])
    assert SamplingParams(n=2, seed=-1).seed is None


def test_vllms_text_and_prompt_fields_of_sampling_params(tiny_model_dir):
    """max_tokens=None runs to the context's end; truncate_prompt_tokens keeps the prompt's last
    tokens; detokenize=False gives token ids and no text; skip_special_tokens=False keeps the EOS's
    text under include_stop_str_in_output; structured_outputs is vLLM's name for the constraint."""
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    assert SamplingParams(structured_outputs={"choice": ["a"], "regex": None}).structured_output == {"choice": ["a"]}
    vllm_style = SimpleNamespace(json=None, regex="[ab]", choice=None, grammar=None, json_object=None,
                                 disable_any_whitespace=False)
    assert SamplingParams(structured_outputs=vllm_style).structured_output == {"regex": "[ab]"}
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, max_model_len=40)
    try:
        prompt = list(range(5, 35))
        [whole] = llm.generate(prompt, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True),
                               use_tqdm=False)
        assert len(whole.outputs[0].token_ids) == 40 - 30 and whole.outputs[0].finish_reason == "length"
        [cut] = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, truncate_prompt_tokens=8),
                             use_tqdm=False)
        assert cut.prompt_token_ids == prompt[-8:]
        [longest] = llm.generate(list(range(5, 60)), SamplingParams(max_tokens=None, truncate_prompt_tokens=-1),
                                 use_tqdm=False)
        assert len(longest.prompt_token_ids) == 39 and len(longest.outputs[0].token_ids) <= 1
        # vLLM code passes unused keys as None: served; a set multi_modal_data is refused.
        assert llm.generate({"prompt_token_ids": prompt, "multi_modal_data": None}, SamplingParams(max_tokens=1),
                            use_tqdm=False)[0].prompt_token_ids == prompt
        [ids_only] = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0, detokenize=False),
                                  use_tqdm=False)
        assert ids_only.outputs[0].text == "" and len(ids_only.outputs[0].token_ids) == 3
        eos = llm.get_tokenizer().eos_token_id
        kept = SamplingParams(max_tokens=3, temperature=0, stop_token_ids=[eos], min_tokens=0,
                              logit_bias={eos: 100.0}, include_stop_str_in_output=True, skip_special_tokens=False)
        [with_eos] = llm.generate(prompt, kept, use_tqdm=False)
        assert with_eos.outputs[0].token_ids == [eos]
        assert with_eos.outputs[0].text == llm.get_tokenizer().decode([eos])
        assert llm.reset_prefix_cache() is True
    finally:
        llm.shutdown()


def test_a_sample_whose_seed_comes_to_minus_one_stays_seeded(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, max_model_len=64)
    try:
        params = SamplingParams(n=2, seed=-2, max_tokens=6, temperature=1.0, ignore_eos=True)
        first = [c.token_ids for c in llm.generate([5, 6, 7], params, use_tqdm=False)[0].outputs]
        again = [c.token_ids for c in llm.generate([5, 6, 7], params, use_tqdm=False)[0].outputs]
    finally:
        llm.shutdown()
    assert first == again  # (both samples seeded: sample 1's seed is -1, not "no seed")


def test_vllms_llm_arguments_and_calls_a_script_makes_are_taken(tiny_model_dir):
    """vLLM's LLM() arguments with nothing to do here (enforce_eager, trust_remote_code, swap_space,
    ...) are taken, those for what is not built only at their neutral value; generate takes a
    priority per prompt, logprobs=True reads as 1, chat_template_kwargs may repeat an explicit
    argument, use_tqdm may be a tqdm class, and reset_prefix_cache takes vLLM's arguments."""
    import functools

    from tqdm.auto import tqdm

    with pytest.raises(ValueError, match="quantization: only None here"):
        LLM(model=str(tiny_model_dir), quantization="awq")
    with pytest.raises(TypeError, match="does not take: no_such_flag"):
        LLM(model=str(tiny_model_dir), no_such_flag=1)
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, enforce_eager=True, trust_remote_code=True, swap_space=4,
              quantization=None, seed=None, tokenizer_mode="auto", pipeline_parallel_size=1,
              distributed_executor_backend="uni", scheduling_policy="priority")
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=True)
        drawn = []
        bar = functools.partial(tqdm, leave=False)

        def counting_bar(*args, **kwargs):
            drawn.append(kwargs.get("desc"))
            return bar(*args, **kwargs)

        outs = llm.generate(PROMPTS[:2], params, use_tqdm=counting_bar, priority=[1, 0])
        assert drawn == ["Processed prompts"]
        assert all(o.outputs[0].finished() and len(o.outputs[0].logprobs[0]) == 1 for o in outs)
        with pytest.raises(ValueError, match="priority has 1 values for 2 prompts"):
            llm.generate(PROMPTS[:2], params, use_tqdm=False, priority=[1])
        chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False,
                        chat_template_kwargs={"add_generation_prompt": False, "anything": 1})
        assert chat[0].outputs[0].token_ids
        assert llm.reset_prefix_cache(reset_running_requests=False, reset_connector=False)
    finally:
        llm.shutdown()


def test_vllms_pooling_params_and_truncation_reach_the_pooling_calls(tmp_path):
    """vLLM's PoolingParams (dimensions, normalize, use_activation, truncate_prompt_tokens) and
    truncate_prompt_tokens, on embed, classify and encode (whose second argument is the params, as
    vLLM's): a truncated text keeps its first tokens and its tokenizer's [CLS] ... [SEP]."""
    from cluster import PoolingParams
    from tests.tiny_model import build_tiny_bert

    text = "the quick brown fox jumps over the lazy dog and runs far away"
    tok = AutoTokenizer.from_pretrained(build_tiny_bert(tmp_path / "embedder", pooling_mode="pooling_mode_mean_tokens"))
    llm = LLM(model=str(tmp_path / "embedder"))
    try:
        full = llm.embed([text], use_tqdm=False)[0]
        cut = llm.embed([text], use_tqdm=False, truncate_prompt_tokens=6)[0]
        assert cut.prompt_token_ids == tok(text, truncation=True, max_length=6).input_ids != full.prompt_token_ids
        assert cut.prompt_token_ids[-1] == tok.sep_token_id
        same = llm.embed([text], use_tqdm=False, pooling_params=PoolingParams(truncate_prompt_tokens=6))[0]
        assert same.outputs.embedding == cut.outputs.embedding
        raw = llm.encode([text], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.data
        assert abs(float(raw.norm()) - 1.0) > 1e-3  # (not normalised)
        with pytest.raises(TypeError, match="second argument is pooling_params"):
            llm.encode([text], False)
    finally:
        llm.shutdown()
    build_tiny_bert(tmp_path / "classifier", num_labels=3)
    llm = LLM(model=str(tmp_path / "classifier"))
    try:
        probs = llm.classify([text], use_tqdm=False)[0].outputs.probs
        raw_params = PoolingParams(use_activation=False)
        logits = llm.classify([text], use_tqdm=False, pooling_params=raw_params)[0].outputs.probs
        assert sum(probs) == pytest.approx(1.0) and torch.softmax(torch.tensor(logits), -1).tolist() == pytest.approx(
            probs, abs=1e-6)
    finally:
        llm.shutdown()
