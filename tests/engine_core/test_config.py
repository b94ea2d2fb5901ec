import pytest

from engine_core.config import CacheConfig, SchedulerConfig


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"max_num_scheduled_tokens": 0}, "max_num_scheduled_tokens"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    ({"max_num_partial_prefills": 0}, "max_num_partial_prefills"),
    ({"max_long_partial_prefills": 0}, "max_long_partial_prefills"),
    ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 3}, "max_long_partial_prefills"),
    ({"policy": "lifo"}, "policy"),
    # Without chunked prefill, a prompt longer than the budget could never be admitted.
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 256}, "max_num_batched_tokens"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 4096, "max_num_scheduled_tokens": 64,
      "max_model_len": 256}, "max_num_batched_tokens"),
    # Partial prefills need chunked prefill, and a long-prefill threshold a prompt can reach (vLLM's checks).
    ({"max_num_partial_prefills": 4, "enable_chunked_prefill": False}, "max_num_partial_prefills must be 1 when"),
    ({"max_num_partial_prefills": 2, "long_prefill_token_threshold": 4096, "max_model_len": 2048},
     "long_prefill_token_threshold must be <= max_model_len"),
])
def test_bad_scheduler_flags_raise_value_error_naming_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize(("kwargs", "flag"), [({"block_size": 0}, "block_size"), ({"num_blocks": 0}, "num_blocks")])
def test_bad_cache_flags_raise_value_error_naming_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        CacheConfig(**kwargs)


def test_max_num_scheduled_tokens_outranks_max_num_batched_tokens():
    assert SchedulerConfig(max_num_batched_tokens=2048).token_budget == 2048
    # It may exceed max_num_batched_tokens: it outranks it.
    assert SchedulerConfig(max_num_batched_tokens=2048, max_num_scheduled_tokens=4096).token_budget == 4096
    assert SchedulerConfig(max_num_batched_tokens=2048, max_num_scheduled_tokens=100).token_budget == 100


def test_long_prefill_threshold_defaults_to_4_percent_of_max_model_len_with_partial_prefills():
    assert SchedulerConfig(max_model_len=10000).long_prefill_token_threshold == 0
    cfg = SchedulerConfig(max_model_len=10000, max_num_partial_prefills=2)
    assert cfg.long_prefill_token_threshold == 400
    # An explicit threshold is kept.
    assert SchedulerConfig(max_model_len=10000, max_num_partial_prefills=2,
                           long_prefill_token_threshold=7).long_prefill_token_threshold == 7


def test_defaults_match_the_documented_api():
    cfg = SchedulerConfig()
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_num_scheduled_tokens, cfg.max_model_len,
            cfg.enable_chunked_prefill, cfg.long_prefill_token_threshold, cfg.max_num_partial_prefills,
            cfg.max_long_partial_prefills, cfg.policy) == (256, 2048, None, 2048, True, 0, 1, 1, "fcfs")
    cache = CacheConfig()
    assert cache.block_size == 16 and cache.enable_prefix_caching


def test_without_chunked_prefill_the_budget_must_hold_a_whole_context():
    cfg = SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=256)
    assert cfg.token_budget == 256


def test_an_unset_budget_holds_a_whole_prompt_when_prompts_run_whole():
    """vLLM's default budget: 2048 tokens, or max_model_len where prompts cannot be split (chunked
    prefill off, an encoder), derived again for another context length; a budget set below a whole
    prompt is refused for a model whose prompts run whole."""
    assert SchedulerConfig(max_model_len=8192).max_num_batched_tokens == 2048
    assert SchedulerConfig(max_model_len=8192, enable_chunked_prefill=False).max_num_batched_tokens == 8192
    whole = SchedulerConfig(max_model_len=None, max_num_partial_prefills=2).with_max_model_len(8192).for_whole_prompts()
    assert (whole.token_budget, whole.enable_chunked_prefill, whole.long_prefill_token_threshold,
            whole.max_num_partial_prefills) == (8192, False, 0, 1)
    assert whole.with_max_model_len(512).token_budget == 2048
    assert SchedulerConfig(max_model_len=512).for_whole_prompts().token_budget == 2048
    assert SchedulerConfig(max_num_batched_tokens=300, max_model_len=256).for_whole_prompts().token_budget == 300
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(1024\) must be >= max_model_len \(8192\)"):
        SchedulerConfig(max_num_batched_tokens=1024, max_model_len=8192).for_whole_prompts()
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) must be >= max_model_len \(8192\)"):
        SchedulerConfig(max_num_scheduled_tokens=64, max_model_len=8192).for_whole_prompts()


def test_another_context_length_derives_the_threshold_again():
    derived = SchedulerConfig(max_model_len=32768, max_num_partial_prefills=2)
    assert derived.long_prefill_token_threshold == 1310
    capped = derived.with_max_model_len(2048)
    assert (capped.max_model_len, capped.long_prefill_token_threshold) == (2048, 81)
    explicit = SchedulerConfig(max_model_len=32768, max_num_partial_prefills=2, long_prefill_token_threshold=500)
    assert explicit.with_max_model_len(2048).long_prefill_token_threshold == 500
    assert "_threshold_derived" not in derived.as_dict()


def test_max_model_len_can_be_left_to_the_model():
    cfg = SchedulerConfig(max_model_len=None, max_num_partial_prefills=2)
    assert cfg.max_model_len is None  # what is derived from it waits for the model's length
    resolved = cfg.with_max_model_len(2048)
    assert (resolved.max_model_len, resolved.long_prefill_token_threshold) == (2048, 81)
    whole = SchedulerConfig(max_model_len=None, max_num_batched_tokens=64, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):  # (so do the checks that need it)
        whole.with_max_model_len(2048)


def test_logprobs_mode_takes_vllms_four_modes():
    from engine_core.config import LOGPROBS_MODES, EngineConfig

    assert EngineConfig(model="m").logprobs_mode == "raw_logprobs"
    for mode in LOGPROBS_MODES:
        assert EngineConfig(model="m", logprobs_mode=mode).logprobs_mode == mode
    with pytest.raises(ValueError, match="engine 0: logprobs_mode must be one of raw_logprobs, raw_logits, "
                                         "processed_logprobs, processed_logits, got 'processed'"):
        EngineConfig(model="m", logprobs_mode="processed")
