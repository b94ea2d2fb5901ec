"""The model's default sampling parameters from its generation config (vLLM's --generation-config and
--override-generation-config)."""

from __future__ import annotations

import json
import logging

import pytest

from engine_core.generation_defaults import model_sampling_defaults

# A Qwen-style generation_config.json: sampling defaults among ids and flags that are not defaults.
QWEN_STYLE = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "pad_token_id": 0,
              "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
              "transformers_version": "4.45.0"}


def _model(tmp_path, generation_config: dict | None, name: str = "model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"temperature": 0.1}))  # (not a generation config)
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def test_auto_takes_the_sampling_keys_of_the_models_generation_config(tmp_path):
    model = _model(tmp_path, QWEN_STYLE)
    assert model_sampling_defaults(model) == {"repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20,
                                              "top_p": 0.8}
    # max_new_tokens is vLLM's max_tokens; min_p counts; nulls are unset.
    model = _model(tmp_path, {"max_new_tokens": 512, "min_p": 0.05, "temperature": None, "max_length": 20}, "b")
    assert model_sampling_defaults(model) == {"max_tokens": 512, "min_p": 0.05}


def test_no_file_or_no_sampling_keys_mean_no_defaults(tmp_path):
    assert model_sampling_defaults(_model(tmp_path, None)) == {}  # config.json's keys are not defaults
    assert model_sampling_defaults(_model(tmp_path, {"eos_token_id": 2, "do_sample": True}, "b")) == {}


def test_vllm_means_none_and_a_folder_means_its_file(tmp_path):
    model = _model(tmp_path, QWEN_STYLE)
    assert model_sampling_defaults(model, "vllm") == {}
    other = _model(tmp_path, {"temperature": 0.3}, "other")
    assert model_sampling_defaults(model, str(other)) == {"temperature": 0.3}
    with pytest.raises(ValueError, match="must be 'auto', 'vllm' or a folder"):
        model_sampling_defaults(model, str(tmp_path / "missing"))


def test_overrides_set_over_the_source_even_with_vllm(tmp_path, caplog):
    model = _model(tmp_path, QWEN_STYLE)
    with caplog.at_level(logging.WARNING, logger="engine_core.generation_defaults"):
        defaults = model_sampling_defaults(model, "auto", {"temperature": 0.2, "max_new_tokens": 64,
                                                           "do_sample": False})
    assert defaults == {"repetition_penalty": 1.05, "temperature": 0.2, "top_k": 20, "top_p": 0.8, "max_tokens": 64}
    assert "do_sample ignored" in caplog.text
    assert model_sampling_defaults(model, "vllm", {"top_p": 0.5}) == {"top_p": 0.5}


@pytest.mark.parametrize(("values", "message"), [
    ({"temperature": -1}, "temperature must be finite and >= 0"),
    ({"top_p": 0}, "top_p must be in"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"repetition_penalty": "high"}, "repetition_penalty must be a number"),
    ({"temperature": True}, "temperature must be a number"),
])
def test_values_no_request_could_send(tmp_path, caplog, values, message):
    """From the model's own file (auto) such a value is left out with a warning, as vLLM would start;
    from a folder or an override the user chose, it is refused, naming its source."""
    model = _model(tmp_path, {**values, "min_p": 0.1})
    with caplog.at_level(logging.WARNING, logger="engine_core.generation_defaults"):
        assert model_sampling_defaults(model) == {"min_p": 0.1}
    assert message in caplog.text and str(model / "generation_config.json") in caplog.text
    with pytest.raises(ValueError, match=message) as refused:
        model_sampling_defaults(_model(tmp_path, None, "clean"), str(model))
    assert str(model / "generation_config.json") in str(refused.value)
    with pytest.raises(ValueError, match="override_generation_config: " + message):
        model_sampling_defaults(model, "auto", values)


def test_a_null_override_removes_the_sources_value(tmp_path):
    model = _model(tmp_path, {"temperature": 0.6, "max_new_tokens": 100})
    assert model_sampling_defaults(model, "auto", {"max_new_tokens": None}) == {"temperature": 0.6}


def test_a_folder_without_the_file_gives_no_defaults_and_says_so(tmp_path, caplog):
    empty = tmp_path / "empty"
    empty.mkdir()
    with caplog.at_level(logging.WARNING, logger="engine_core.generation_defaults"):
        assert model_sampling_defaults(_model(tmp_path, QWEN_STYLE), str(empty)) == {}
    assert "holds no generation_config.json" in caplog.text


def test_a_file_that_is_not_a_json_object_is_refused(tmp_path):
    model = _model(tmp_path, None)
    (model / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        model_sampling_defaults(model)
    (model / "generation_config.json").write_text("{temperature")
    with pytest.raises(ValueError, match="not readable as JSON"):
        model_sampling_defaults(model)
