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
    with pytest.raises(ValueError, match=r"returned_token_ids, not \[.softmax.\]"):
        resolve_pooler_config(tmp_path, {"softmax": True})
    with pytest.raises(ValueError, match="normalize must be true or false"):
        resolve_pooler_config(tmp_path, {"normalize": "yes"})


def add_dense(path, index: int, in_features: int, out_features: int, activation: str | None = "Tanh",
              bias: bool = True, weights: str = "safetensors", seed: int = 0) -> tuple:
    """A sentence-transformers Dense module after the others (weights in model.safetensors, or in an
    older pytorch_model.bin): returns its (weight, bias)."""
    import torch

    modules = json.loads((path / "modules.json").read_text())
    modules.insert(len(modules) - (modules[-1]["type"].endswith("Normalize")),
                   {"idx": index, "name": str(index), "path": f"{index}_Dense",
                    "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    directory = path / f"{index}_Dense"
    directory.mkdir()
    settings = {"in_features": in_features, "out_features": out_features, "bias": bias}
    if activation is not None:
        settings["activation_function"] = f"torch.nn.modules.activation.{activation}"
    (directory / "config.json").write_text(json.dumps(settings))
    generator = torch.Generator().manual_seed(seed)
    tensors = {"linear.weight": torch.randn(out_features, in_features, generator=generator) * 0.3}
    if bias:
        tensors["linear.bias"] = torch.randn(out_features, generator=generator) * 0.3
    if weights == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(directory / "model.safetensors"))
    else:
        torch.save(tensors, directory / "pytorch_model.bin")
    return tensors["linear.weight"], tensors.get("linear.bias")


def test_dense_projections_are_read_in_order_and_checked(tmp_path):
    """LaBSE-style Dense modules after the pooling: read in their order (the first
    fed the hidden size), whatever --pooler-config says; a size that does not chain, an activation
    we do not apply, or a Dense before the Pooling is refused."""
    from gpu_worker.pooler_config import DenseProjection, load_dense_weights

    st = write_sentence_transformers(tmp_path, {"pooling_mode_cls_token": True}, True)
    weight, bias = add_dense(st, 2, 64, 32)
    add_dense(st, 3, 32, 16, activation="Identity", bias=False, weights="bin")
    config = resolve_pooler_config(st, hidden_size=64)
    assert config.dense == (DenseProjection("2_Dense", 64, 32, True, "Tanh"),
                            DenseProjection("3_Dense", 32, 16, False, "Identity"))
    assert (config.pooling_type, config.normalize, config.embedding_size(64)) == ("CLS", True, 16)
    assert resolve_pooler_config(st, {"pooling_type": "MEAN", "normalize": False}, hidden_size=64).dense == config.dense
    loaded = load_dense_weights(st, config.dense[0])
    assert loaded[0].equal(weight) and loaded[1].equal(bias)
    assert load_dense_weights(st, config.dense[1])[1] is None
    with pytest.raises(ValueError, match="the Dense module takes 64 values, the pooled embedding before it has 48"):
        resolve_pooler_config(st, hidden_size=48)
    relu6 = write_sentence_transformers(tmp_path / "relu6", {"pooling_mode_cls_token": True}, False)
    add_dense(relu6, 2, 64, 8, activation="ReLU6")
    with pytest.raises(ValueError, match="the Dense activation 'ReLU6' is not served"):
        resolve_pooler_config(relu6, hidden_size=64)
    # (sentence-transformers' default activation is Tanh.)
    default = write_sentence_transformers(tmp_path / "default", {"pooling_mode_cls_token": True}, False)
    add_dense(default, 2, 64, 8, activation=None)
    assert resolve_pooler_config(default, hidden_size=64).dense[0].activation == "Tanh"
    (tmp_path / "early").mkdir()
    early = write_sentence_transformers(tmp_path / "early", None, False)
    add_dense(early, 1, 64, 8)
    with pytest.raises(ValueError, match="a Dense module before the Pooling is not served"):
        resolve_pooler_config(early, hidden_size=64)


def test_pipelines_we_cannot_reproduce_are_refused(tmp_path):
    """A module we do not run, or several poolings concatenated, would change the embedding's size
    and meaning: refused rather than answered wrong."""
    st = write_sentence_transformers(tmp_path, {"pooling_mode_mean_tokens": True}, True)
    modules = json.loads((st / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    (st / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="lists LayerNorm modules, which are not served"):
        resolve_pooler_config(st)
    # Unless --pooler-config takes the pooling and normalisation over.
    assert resolve_pooler_config(st, {"pooling_type": "CLS", "normalize": False}) == PoolerConfig("CLS", False)
    both = write_sentence_transformers(tmp_path / "both", {"pooling_mode_mean_tokens": True,
                                                           "pooling_mode_cls_token": True}, False)
    with pytest.raises(ValueError, match="pooling_mode_mean_tokens and pooling_mode_cls_token together"):
        resolve_pooler_config(both)


def test_sentence_transformers_prompts_and_lowercasing_are_read(tmp_path):
    from gpu_worker.pooler_config import sentence_transformers_text_settings

    assert sentence_transformers_text_settings(tmp_path) == ((), False)
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "passage": "passage: ", "bad": 3}, "default_prompt_name": None}))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": True}))
    assert sentence_transformers_text_settings(tmp_path) == ((("query", "query: "), ("passage", "passage: ")), True)
