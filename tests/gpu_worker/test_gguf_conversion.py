"""GGUF files the converter once refused or converted wrongly: split files, Llama 3.x's rope_freqs."""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from gpu_worker.gguf_loader import ensure_converted
from gpu_worker.model_resolver import resolve_model

from . import tiny_gguf
from .tiny_gguf import gguf_tensors as tiny_gguf_tensors
from .tiny_gguf import tiny_vocab, write_tiny_gguf
from .utils import make_runner, prefill_logits

PROMPT = [1, 120, 118, 263, 13, 107, 108, 261, 117, 104, 2, 13]


def _logits(model: LlamaForCausalLM) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0]


def _converted_dirs(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if not p.name.startswith(".")] if cache.exists() else []


# ---------------------------------------------------------------------------------------------- split


def write_split_gguf(path: Path, model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch,
                     max_tensors: int = 8) -> list[Path]:
    """``model`` as llama.cpp's split GGUF (gguf-py's own splitting, as its converters'
    --split-max-tensors): ``<stem>-00001-of-0000N.gguf``, the metadata in the first shard."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with monkeypatch.context() as patch:
        patch.setattr(tiny_gguf, "GGUFWriter", functools.partial(GGUFWriter, split_max_tensors=max_tensors))
        write_tiny_gguf(path, model)
    shards = sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
    assert len(shards) > 1 and not path.exists()
    return shards


def test_every_shard_of_a_split_gguf_is_converted(
    tiny_model: LlamaForCausalLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = write_split_gguf(tmp_path / "split" / "tiny.gguf", tiny_model, monkeypatch)
    assert [s.name for s in shards] == ["tiny-00001-of-00003.gguf", "tiny-00002-of-00003.gguf",
                                        "tiny-00003-of-00003.gguf"]
    model_dir = ensure_converted(shards[0], tmp_path / "cache")
    loaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.testing.assert_close(_logits(loaded), _logits(tiny_model), rtol=0, atol=1e-5)
    ours = prefill_logits(make_runner(model_dir, num_blocks=8, block_size=4), PROMPT, [3, 1, 0])
    torch.testing.assert_close(ours, _logits(tiny_model), rtol=1e-4, atol=1e-4)
    # Any shard, or the folder holding them, names the same model and conversion.
    resolved = resolve_model(str(shards[1]), cache_dir=tmp_path / "cache")
    assert (resolved.model_dir, resolved.served_name) == (model_dir, "tiny")
    assert resolve_model(str(shards[0].parent), cache_dir=tmp_path / "cache").model_dir == model_dir


def test_a_split_gguf_missing_a_shard_is_refused_and_nothing_is_cached(
    tiny_model: LlamaForCausalLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = write_split_gguf(tmp_path / "split" / "tiny.gguf", tiny_model, monkeypatch)
    shards[2].unlink()
    with pytest.raises(FileNotFoundError, match=r"tiny-00003-of-00003.gguf not found.*llama-gguf-split --merge"):
        ensure_converted(shards[0], tmp_path / "cache")
    assert _converted_dirs(tmp_path / "cache") == []


def test_a_renamed_first_shard_is_refused_and_nothing_is_cached(
    tiny_model: LlamaForCausalLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard whose name hides that it is one (its siblings cannot be found by llama.cpp's naming)."""
    shards = write_split_gguf(tmp_path / "split" / "tiny.gguf", tiny_model, monkeypatch)
    renamed = Path(shutil.move(shards[0], tmp_path / "tiny.gguf"))
    with pytest.raises(ValueError, match=r"shard 1 of 3 \(split.count\).*llama-gguf-split --merge"):
        ensure_converted(renamed, tmp_path / "cache")
    assert _converted_dirs(tmp_path / "cache") == []


# ------------------------------------------------------------------------------------ llama3 rope_freqs


def llama_cpp_rope_freqs(config: LlamaConfig) -> np.ndarray:
    """The rope_freqs tensor of llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors)
    for a llama3 rope config: a divisor per frequency."""
    rope = config.rope_parameters
    base, dim = rope["rope_theta"], config.head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(float(1 / ((1 - smooth) / factor + smooth)))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def tiny_llama3(rope: dict, max_position_embeddings: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=len(tiny_vocab()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, rope_parameters={"rope_type": "llama3", **rope},
                         initializer_range=0.2)  # (peaked logits: a rotation gone wrong shows)
    torch.manual_seed(4)
    return LlamaForCausalLM(config).eval()


def write_llama3_gguf(path: Path, model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``model`` as llama.cpp writes a Llama 3.x: no rope scaling keys, a rope_freqs tensor first."""
    with monkeypatch.context() as patch:
        patch.setattr(tiny_gguf, "gguf_tensors", lambda m: {"rope_freqs.weight": llama_cpp_rope_freqs(m.config),
                                                            **tiny_gguf_tensors(m)})
        return write_tiny_gguf(path, model)


LLAMA_3_2 = {"rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(("rope", "max_position", "expected"), [
    # Llama 3.2 1B/3B's: Meta's standard parameters, factor 32.
    (LLAMA_3_2, 16384, LLAMA_3_2),
    # Others, found by their smooth band: an original length and a high_freq_factor of no standard model.
    ({"rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 3.0,
      "original_max_position_embeddings": 100}, 400, None),
    # Only original / low and original / high count: (2, 8, 256) is (1, 4, 128).
    ({"rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
      "original_max_position_embeddings": 256}, 1024,
     {"rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 128}),
])
def test_llama3_rope_freqs_become_llama3_rope_scaling(
    rope: dict, max_position: int, expected: dict | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tiny_llama3(rope, max_position)
    model_dir = ensure_converted(write_llama3_gguf(tmp_path / "llama3.gguf", source, monkeypatch), tmp_path / "cache")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "llama3", **(expected or rope)}
    assert config["rope_parameters"] == config["rope_scaling"]
    # Positions far enough for the scaled low frequencies to turn.
    prompt = torch.randint(3, len(tiny_vocab()), (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = source(prompt).logits[0]
        loaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        torch.testing.assert_close(loaded(prompt).logits[0], reference, rtol=0, atol=1e-5)
    ours = prefill_logits(make_runner(model_dir, num_blocks=64, block_size=4), prompt[0].tolist(), list(range(50)))
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


def test_rope_freqs_that_no_llama3_scaling_gives_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tiny_llama3(LLAMA_3_2, 16384)
    scrambled = llama_cpp_rope_freqs(source.config)[::-1].copy()  # (divisors falling with the wavelength)
    with monkeypatch.context() as patch:
        patch.setattr(tiny_gguf, "gguf_tensors", lambda m: {"rope_freqs.weight": scrambled, **tiny_gguf_tensors(m)})
        path = write_tiny_gguf(tmp_path / "odd.gguf", source)
    with pytest.raises(ValueError, match=r"rope_freqs.weight \(factors .*\) matches no llama3 rope scaling"):
        ensure_converted(path, tmp_path / "cache")
    assert _converted_dirs(tmp_path / "cache") == []
