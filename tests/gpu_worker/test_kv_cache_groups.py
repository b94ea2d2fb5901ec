"""The hybrid KV cache manager's layout: which layers share which tensors, and when it is off."""

from __future__ import annotations

import dataclasses

import pytest

from engine_core.config import EngineConfig, SpeculativeConfig
from engine_core.core.kv_cache_utils import AttentionWindow
from gpu_worker.attn_metadata import ChunkedWindow
from gpu_worker.config import ModelConfig
from gpu_worker.kv_cache_groups import group_attention_layers, hybrid_kv_cache_grouping
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


def test_the_hybrid_manager_is_off_where_a_feature_moves_or_copies_every_layers_blocks(tmp_path):
    path = save_tiny_model(tmp_path, "gemma2", sliding_window=5)
    config = ModelConfig.from_pretrained(path)
    base = EngineConfig(model=str(path))
    grouping, reason = hybrid_kv_cache_grouping(config, base)
    assert grouping is not None and grouping.windows == (None, 5) and reason == ""
    for change, why in [({"disable_hybrid_kv_cache_manager": True}, "--disable-hybrid-kv-cache-manager"),
                        ({"kv_offloading_size": 1.0}, "KV offloading"),
                        ({"pipeline_parallel_size": 2}, "pipeline parallelism")]:
        grouping, reason = hybrid_kv_cache_grouping(config, dataclasses.replace(base, **change))
        assert grouping is None and why in reason, change
    # Drafters keep the groups: n-gram drafts keep no KV cache, a draft model's or an MTP layer's sits on
    # group 0's blocks.
    for spec in (SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1),
                 SpeculativeConfig(method="draft_model", model=str(path), num_speculative_tokens=2),
                 SpeculativeConfig(method="mtp", num_speculative_tokens=1)):
        assert hybrid_kv_cache_grouping(config, dataclasses.replace(base, speculative_config=spec))[0] is not None
    mistral = ModelConfig.from_pretrained(save_tiny_model(tmp_path / "m", "mistral", sliding_window=5))
    assert hybrid_kv_cache_grouping(mistral, base) == (None, "")


def test_a_drafter_keeps_the_groups_unless_its_pages_beside_every_block_outweigh_them(tmp_path):
    """A drafter's KV cache lies on group 0's block ids, a page beside each block of every group: the groups
    stay where a max-length request still holds less memory over them than in one group."""
    from gpu_worker.kv_cache_groups import drafter_outweighs_groups

    # Gemma 3's pattern in 12 layers: 2 full, 10 windowed of 128 keys, groups of 2 layers (6 groups).
    config = ModelConfig.from_pretrained(save_tiny_model(tmp_path, "gemma3", num_hidden_layers=12,
                                                         sliding_window=128, sliding_window_pattern=6,
                                                         max_position_embeddings=2048))
    grouping, _ = hybrid_kv_cache_grouping(config, EngineConfig(model=str(tmp_path)))
    assert grouping.group_size == 2 and len(grouping.windows) == 6

    def outweighs(drafter_layers: int | None, max_model_len: int) -> str:
        return drafter_outweighs_groups(grouping, config, config, drafter_layers, max_model_len, 16, 3, 1)

    # A one-layer drafter (an EAGLE head): 3 pages a block over 100 blocks against 13 over 50.
    assert outweighs(1, 800) == ""
    # The model as its own draft model: 14 pages a block over 100 blocks against 24 over 50.
    assert outweighs(None, 800) == ("a drafter with a KV cache of its own, whose pages sit beside every block of "
                                    "every group: a 800-token request would hold 1.17x the memory it holds in "
                                    "one group")
    # ... which a request long past the window outgrows: 14 over 510 blocks against 24 over 460.
    assert outweighs(None, 7360) == ""
    # Within the window a request holds a block in every group a position: 6 x 3 pages against 13.
    assert "1.38x" in outweighs(1, 128)
