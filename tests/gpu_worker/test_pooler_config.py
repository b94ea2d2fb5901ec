"""The pooling an embedding model declares (sentence-transformers' modules.json and Pooling config),
under --pooler-config, as vLLM reads them."""

from __future__ import annotations

import json

import pytest

from gpu_worker.pooler_config import PoolerConfig, resolve_pooler_config


def write_sentence_transformers(path, pooling: dict | None, normalize: bool):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (path / "1_Pooling").mkdir(parents=True, exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    return path


@pytest.mark.parametrize(("pooling", "normalize", "expected"), [
    ({"pooling_mode_mean_tokens": True}, True, PoolerConfig("MEAN", True)),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, False, PoolerConfig("CLS", False)),
    ({"pooling_mode_lasttoken": True}, True, PoolerConfig("LAST", True)),
    # A Pooling module with no mode we know of left on keeps LAST; without Normalize, not normalised.
    (None, False, PoolerConfig("LAST", False)),
], ids=["mean", "cls-unnormalised", "last", "no-pooling-module"])
def test_sentence_transformers_files_say_how_to_pool(tmp_path, pooling, normalize, expected):
    assert resolve_pooler_config(write_sentence_transformers(tmp_path, pooling, normalize)) == expected


def test_without_sentence_transformers_files_last_normalised_and_overrides_win(tmp_path):
    assert resolve_pooler_config(tmp_path) == PoolerConfig("LAST", True)
    assert resolve_pooler_config(tmp_path, {"pooling_type": "mean"}) == PoolerConfig("MEAN", True)
    st = write_sentence_transformers(tmp_path / "st", {"pooling_mode_mean_tokens": True}, True)
    assert resolve_pooler_config(st, {"normalize": False}) == PoolerConfig("MEAN", False)
    assert resolve_pooler_config(st, {"pooling_type": "CLS"}) == PoolerConfig("CLS", True)


def test_poolings_we_do_not_compute_are_refused_unless_overridden(tmp_path):
    st = write_sentence_transformers(tmp_path, {"pooling_mode_max_tokens": True}, True)
    with pytest.raises(ValueError, match=r"pooling_mode_max_tokens, which is not served .* set --pooler-config"):
        resolve_pooler_config(st)
    assert resolve_pooler_config(st, {"pooling_type": "MEAN"}) == PoolerConfig("MEAN", True)
    instructed = write_sentence_transformers(tmp_path / "i", {"pooling_mode_mean_tokens": True,
                                                              "include_prompt": False}, False)
    with pytest.raises(ValueError, match="include_prompt: false"):
        resolve_pooler_config(instructed)
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        resolve_pooler_config(tmp_path, {"pooling_type": "MAX"})
    with pytest.raises(ValueError, match=r"pooler_config takes pooling_type and normalize, not \['softmax'\]"):
        resolve_pooler_config(tmp_path, {"softmax": True})
    with pytest.raises(ValueError, match="normalize must be true or false"):
        resolve_pooler_config(tmp_path, {"normalize": "yes"})


def test_pipelines_we_cannot_reproduce_are_refused(tmp_path):
    """A Dense projection after the pooling, or several poolings concatenated, would change the
    embedding's size and meaning: refused rather than answered wrong."""
    st = write_sentence_transformers(tmp_path, {"pooling_mode_mean_tokens": True}, True)
    modules = json.loads((st / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (st / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="lists Dense modules, which are not served"):
        resolve_pooler_config(st)
    both = write_sentence_transformers(tmp_path / "both", {"pooling_mode_mean_tokens": True,
                                                           "pooling_mode_cls_token": True}, False)
    with pytest.raises(ValueError, match="pooling_mode_mean_tokens and pooling_mode_cls_token together"):
        resolve_pooler_config(both)
