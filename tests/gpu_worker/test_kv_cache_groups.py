"""The hybrid KV cache manager's layout: which layers share which tensors, and when it is off."""

from __future__ import annotations

import dataclasses

import pytest

from engine_core.config import EngineConfig, SpeculativeConfig
from engine_core.core.kv_cache_utils import AttentionWindow
from engine_core.kv_transfer import KVTransferConfig
from gpu_worker.attn_metadata import ChunkedWindow
from gpu_worker.config import ModelConfig
from gpu_worker.kv_cache_groups import group_attention_layers, groups_cost_more, hybrid_kv_cache_grouping
from tests.gpu_worker.utils import save_tiny_model


def test_gemma3s_pattern_groups_the_full_layers_and_splits_the_windowed_ones_alike():
    """Gemma 3 1B: 26 layers, every sixth full (4 full, 22 windowed): groups of 4 layers (the full
    layers' count), the last windowed group of 2, and 4 shared tensors."""
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    grouping = group_attention_layers(windows)
    assert grouping.group_size == 4
    assert grouping.windows == (None, *[512] * 6)
    assert grouping.layers[0] == (5, 11, 17, 23)
    assert grouping.layers[1:] == ((0, 1, 2, 3), (4, 6, 7, 8), (9, 10, 12, 13), (14, 15, 16, 18),
                                   (19, 20, 21, 22), (24, 25))
    assert grouping.engine_windows == (None, *[AttentionWindow(512)] * 6)


def test_alternating_layers_make_two_groups_and_near_counts_one_group_each():
    gpt_oss = group_attention_layers([128, None] * 12)
    assert (gpt_oss.group_size, gpt_oss.windows, gpt_oss.layers) == (
        12, (None, 128), (tuple(range(1, 24, 2)), tuple(range(0, 24, 2))))
    # (Nine full layers and eight windowed: within a quarter, one group of nine each, as vLLM groups them.)
    near = group_attention_layers([None] * 9 + [64] * 8)
    assert (near.group_size, len(near.layers)) == (9, 2)
    apart = group_attention_layers([None] * 5 + [64] * 3)
    assert (apart.group_size, apart.layers) == (3, ((0, 1, 2), (3, 4), (5, 6, 7)))
    llama4 = group_attention_layers([ChunkedWindow(8192)] * 3 + [None])
    assert llama4.engine_windows == (None, *[AttentionWindow(8192, chunked=True)] * 3)


@pytest.mark.parametrize("windows", [[None] * 4, [64] * 4, [None, 64, 32, None]],
                         ids=["full", "every_layer_windowed", "two_windows"])
def test_one_group_where_the_layers_do_not_mix_one_window_with_full_attention(windows):
    assert group_attention_layers(windows) is None


def test_the_hybrid_manager_is_off_where_asked(tmp_path):
    path = save_tiny_model(tmp_path, "gemma2", sliding_window=5)
    config = ModelConfig.from_pretrained(path)
    base = EngineConfig(model=str(path))
    grouping_on, reason = hybrid_kv_cache_grouping(config, base)
    assert grouping_on is not None and grouping_on.windows == (None, 5) and reason == ""
    grouping, reason = hybrid_kv_cache_grouping(config, dataclasses.replace(base, disable_hybrid_kv_cache_manager=True))
    assert grouping is None and "--disable-hybrid-kv-cache-manager" in reason
    # KV offloading and disaggregation keep the groups: the tier keeps each group's blocks under the group's
    # keys, a transfer carries each group's blocks of the window.
    for change in ({"kv_offloading_size": 1.0}, {"kv_transfer_config": KVTransferConfig(kv_role="kv_both")}):
        assert hybrid_kv_cache_grouping(config, dataclasses.replace(base, **change)) == (grouping_on, ""), change
    # Drafters keep the groups: n-gram drafts keep no KV cache, a draft model's or an MTP layer's sits on
    # group 0's blocks.
    for spec in (SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1),
                 SpeculativeConfig(method="draft_model", model=str(path), num_speculative_tokens=2),
                 SpeculativeConfig(method="mtp", num_speculative_tokens=1)):
        assert hybrid_kv_cache_grouping(config, dataclasses.replace(base, speculative_config=spec))[0] is not None
    mistral = ModelConfig.from_pretrained(save_tiny_model(tmp_path / "m", "mistral", sliding_window=5))
    assert hybrid_kv_cache_grouping(mistral, base) == (None, "")


def test_pipeline_stages_each_keep_a_share_of_every_group():
    """Gemma 3 1B's pattern over two stages of 13 layers: each group takes two layers from each stage, so
    each stage keeps two shared tensors (four over both, as one stage keeps) and no group's block leaves a
    stage's pages unused but the last windowed group's."""
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    grouping = group_attention_layers(windows, [(0, 13), (13, 26)])
    assert grouping.group_size == 2
    assert grouping.layers == ((5, 11, 17, 23), (0, 1, 13, 14), (2, 3, 15, 16), (4, 6, 18, 19), (7, 8, 20, 21),
                               (9, 10, 22, 24), (12, 25))
    first, second = grouping.for_stage(0, 13), grouping.for_stage(13, 26)
    assert first.layers == ((5, 11), (0, 1), (2, 3), (4, 6), (7, 8), (9, 10), (12,))
    assert second.layers == ((4, 10), (0, 1), (2, 3), (5, 6), (7, 8), (9, 11), (12,))
    assert first.windows == second.windows == grouping.windows and first.group_size == 2
    assert first.layer_windows() == windows[:13] and second.layer_windows() == windows[13:]
    # (One stage: the grouping as before.)
    assert group_attention_layers(windows, [(0, 26)]) == group_attention_layers(windows)


def test_the_groups_give_way_where_a_max_length_request_would_hold_more_memory_over_them(tmp_path):
    """A block is a page of every stage's shared tensors (and of a drafter's cache, which lies on every
    block id): the groups stay only where a max-length request, decoding, holds no more memory over them
    than in one group."""
    # Gemma 3's pattern in 12 layers: 2 full, 10 windowed of 128 keys, groups of 2 layers (6 groups).
    config = ModelConfig.from_pretrained(save_tiny_model(tmp_path, "gemma3", num_hidden_layers=12,
                                                         sliding_window=128, sliding_window_pattern=6,
                                                         max_position_embeddings=2048))
    grouping, _ = hybrid_kv_cache_grouping(config, EngineConfig(model=str(tmp_path)))
    assert grouping.group_size == 2 and len(grouping.windows) == 6

    def costlier(max_model_len: int, drafter_layers: int | None = -1, grouped=grouping,
                 stage_layers: int | None = None) -> str:
        drafter = None if drafter_layers == -1 else (config, drafter_layers)
        # (A decoding pass verifying 3 drafts, with 3 lookahead slots, where there is a drafter.)
        return groups_cost_more(grouped, config, max_model_len, 16, 7 if drafter else 1, 1, stage_layers, drafter)

    # 2 pages a block over 50 + 5 x 9 blocks against 12 over 50.
    assert costlier(800) == ""
    # Within the window nothing is released: 6 x 2 pages a position against 12 (equal: the groups stay) ...
    assert costlier(128) == ""
    # ... but with a one-layer drafter (an EAGLE head) beside every block, 6 x 3 against 13.
    assert costlier(128, 1) == ("over its 6 KV cache groups a 128-token request would hold 1.38x the memory it "
                                "holds in one group (a drafter's KV cache sits beside every block of every group)")
    assert costlier(800, 1) == ""  # (3 pages a block over 100 blocks against 13 over 50)
    # The model as its own draft model: 14 pages a block over 100 blocks against 24 over 50, which a
    # request long past the window outgrows (14 over 510 against 24 over 460).
    assert "1.17x" in costlier(800, None)
    assert costlier(7360, None) == ""
    # Two stages (each worker's memory: the largest stage's layers set the one group's blocks): Gemma 3's
    # two full layers, one a stage, and five windowed on each: a tensor a stage, so a block is a page
    # against 6, and within the window 6 x 1 pages a position against 6 again.
    staged = group_attention_layers([config.layer_sliding_window(i) for i in range(12)], [(0, 6), (6, 12)])
    assert (staged.group_size, len(staged.windows)) == (1, 6)
    assert costlier(800, grouped=staged, stage_layers=6) == costlier(128, grouped=staged, stage_layers=6) == ""
    # Both full layers on the second stage (a partition of 1 and 11): a full group each, and nine windowed
    # groups, within the window 11 x 1 pages a position against 11: the groups stay.
    uneven = group_attention_layers([config.layer_sliding_window(i) for i in range(12)], [(0, 1), (1, 12)])
    assert uneven.layers[:3] == ((5,), (11,), (0, 1)) and (uneven.group_size, len(uneven.windows)) == (1, 11)
    assert costlier(128, grouped=uneven, stage_layers=11) == costlier(256, grouped=uneven, stage_layers=11) == ""
    # A stage of full layers and one of windowed ones: each group's three-layer share on one stage alone,
    # two full groups a position: 3 pages a block over 2 x 50 + 2 x 9 blocks against 6 over 50.
    apart = group_attention_layers([None] * 6 + [128] * 6, [(0, 6), (6, 12)])
    assert apart.layers == ((0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11)) and apart.group_size == 3
    assert costlier(800, grouped=apart, stage_layers=6) == ("over its 4 KV cache groups a 800-token request would "
                                                            "hold 1.18x the memory it holds in one group")
    # (Over one stage the same layers make two groups of six: 6 pages over 50 + 9 blocks against 12 over 50.)
    assert costlier(800, grouped=group_attention_layers([None] * 6 + [128] * 6)) == ""


def test_the_engine_plans_the_groups_over_its_pipeline_stages(tmp_path):
    path = save_tiny_model(tmp_path, "gemma3", num_hidden_layers=6, sliding_window_pattern=3)
    config = ModelConfig.from_pretrained(path)
    # (Layers 2 and 5 full; a partition of 1 and 5 puts both on the second stage.)
    grouping, _ = hybrid_kv_cache_grouping(config, EngineConfig(model=str(path), pipeline_parallel_size=2,
                                                                pp_layer_partition=(1, 5)))
    assert grouping.layers == ((2,), (5,), (0, 1), (3,), (4,)) and grouping.group_size == 1
    even, _ = hybrid_kv_cache_grouping(config, EngineConfig(model=str(path), pipeline_parallel_size=2))
    assert even.layers == ((2, 5), (0, 3), (1, 4))
    # (A partition the model cannot have is the engine's other checks' to refuse: no grouping here.)
    assert hybrid_kv_cache_grouping(config, EngineConfig(model=str(path), pipeline_parallel_size=2,
                                                         pp_layer_partition=(2, 2)))[0] is None
