from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from gpu_worker import gguf_loader
from gpu_worker.gguf_loader import (
    build_hf_config,
    cache_key,
    convert_gguf_to_hf,
    ensure_converted,
    gguf_to_hf_name,
    load_gguf,
    unpermute_qk,
)
from gpu_worker.model_resolver import find_default_gguf

from .tiny_gguf import CHAT_TEMPLATE, llama_cpp_permute, tiny_lfm2, tiny_llama, write_tiny_gguf, write_tiny_lfm2_gguf
from .utils import make_runner, prefill_logits

PROMPT_IDS = torch.tensor([[1, 120, 118, 263, 13, 107, 108, 261, 117, 104, 2, 13]])


def _logits(model: LlamaForCausalLM) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT_IDS).logits


# ------------------------------------------------------------------------------------------ permutation


@pytest.mark.parametrize(("n_head", "n_head_kv"), [(4, 4), (4, 2), (9, 3), (8, 1)])
def test_unpermute_inverts_llama_cpp_permute(n_head: int, n_head_kv: int) -> None:
    head_dim = 8
    weights = np.random.default_rng(0).standard_normal((n_head_kv * head_dim, 24)).astype(np.float32)
    permuted = llama_cpp_permute(weights, n_head, n_head_kv)
    assert not np.array_equal(permuted, weights)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head_kv), weights)


def test_unpermute_handles_bias_vectors() -> None:
    bias = np.arange(32, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(bias, 4, 2), 2), bias)


def test_unpermute_rejects_rows_not_divisible_into_heads() -> None:
    with pytest.raises(ValueError, match="heads"):
        unpermute_qk(np.zeros((10, 4), dtype=np.float32), 4)


# ------------------------------------------------------------------------------------------------ names


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.12.attn_k.bias", "model.layers.12.self_attn.k_proj.bias"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
    ],
)
def test_gguf_to_hf_name(gguf_name: str, hf_name: str) -> None:
    assert gguf_to_hf_name(gguf_name) == hf_name


@pytest.mark.parametrize("name", ["blk.0.ffn_gate_exps.weight", "rope_freqs.weight", "blk.x.attn_q.weight"])
def test_gguf_to_hf_name_rejects_unknown_tensors(name: str) -> None:
    with pytest.raises(ValueError, match="unexpected GGUF tensor"):
        gguf_to_hf_name(name)


# ------------------------------------------------------------------------------------------ config/tensors


def test_config_matches_source_model(tiny_gguf: Path, tiny_model: LlamaForCausalLM) -> None:
    config = build_hf_config(GGUFReader(str(tiny_gguf)))
    source = tiny_model.config
    assert config["architectures"] == ["LlamaForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == getattr(source, key), key
    assert config["rms_norm_eps"] == source.rms_norm_eps
    assert config["rope_theta"] == source.rope_parameters["rope_theta"]
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}


def test_f32_tensors_round_trip_exactly(tiny_gguf: Path, tiny_model: LlamaForCausalLM) -> None:
    _, tensors = load_gguf(tiny_gguf)
    loaded = dict(tensors)
    expected = tiny_model.state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32
        assert tensor.shape == expected[name].shape, name
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def test_gguf_holds_permuted_qk_so_round_trip_is_meaningful(tiny_gguf: Path, tiny_model: LlamaForCausalLM) -> None:
    raw = next(t for t in GGUFReader(str(tiny_gguf)).tensors if t.name == "blk.0.attn_k.weight")
    hf = tiny_model.state_dict()["model.layers.0.self_attn.k_proj.weight"].numpy()
    assert tuple(raw.shape.tolist()) == (hf.shape[1], hf.shape[0])  # GGUF lists dims innermost first
    assert not np.array_equal(np.asarray(raw.data), hf)


def test_quantised_tensors_match_gguf_dequantisation(tmp_path: Path, tiny_model: LlamaForCausalLM) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", tiny_model, GGMLQuantizationType.Q8_0)
    _, tensors = load_gguf(path)
    for name, tensor in tensors:
        original = tiny_model.state_dict()[name].numpy()
        # Row-wise block quantisation commutes with the row permutation, so no permute is needed here.
        reference = original if original.ndim == 1 else dequantize(quantize(original, GGMLQuantizationType.Q8_0),
                                                                    GGMLQuantizationType.Q8_0)
        np.testing.assert_array_equal(tensor.numpy(), reference, err_msg=name)
        np.testing.assert_allclose(tensor.numpy(), original, atol=0.01, err_msg=name)


def test_load_gguf_casts_to_requested_dtype(tiny_gguf: Path) -> None:
    config, tensors = load_gguf(tiny_gguf, torch.bfloat16)
    assert config["torch_dtype"] == "bfloat16"
    assert {t.dtype for _, t in tensors} == {torch.bfloat16}


def test_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    model = tiny_llama(tie_word_embeddings=True, seed=1)
    config, tensors = load_gguf(write_tiny_gguf(tmp_path / "tied.gguf", model))
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in dict(tensors)


def test_other_architectures_are_rejected(tmp_path: Path, tiny_model: LlamaForCausalLM) -> None:
    path = write_tiny_gguf(tmp_path / "other.gguf", tiny_model, architecture="rwkv6")
    with pytest.raises(ValueError, match="architecture 'rwkv6' is not supported; one of llama, qwen2, qwen3, gemma"):
        load_gguf(path)


def test_mixture_of_experts_files_of_other_architectures_are_refused(tmp_path: Path,
                                                                     tiny_model: LlamaForCausalLM) -> None:
    """Experts under an architecture whose MoE files are not converted (a Qwen2 file that says it has
    some): refused with the way out."""
    path = write_tiny_gguf(tmp_path / "moe.gguf", tiny_model, architecture="qwen2", expert_count=8)
    with pytest.raises(ValueError, match=r"mixture-of-experts .*8 experts.*'qwen2'.*Hugging Face checkpoint"):
        load_gguf(path)


# Per kind: its architecture, and the routing keys the converted config.json must hold.
_MOE_FILES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                          "norm_topk_prob": True}),
    "qwen2_moe": ("Qwen2MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                          "norm_topk_prob": False, "shared_expert_intermediate_size": 96}),
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 128}),
}


@pytest.mark.parametrize("kind, split_experts, expert_widths",
                         [("qwen3_moe", False, True), ("qwen2_moe", False, True), ("qwen2_moe", False, False),
                          ("mixtral", False, True), ("mixtral", True, True)],
                         ids=["qwen3_moe", "qwen2_moe", "qwen2_moe_widths_from_tensors", "mixtral",
                              "mixtral_one_tensor_per_expert"])
def test_mixture_of_experts_files_convert_their_experts(tmp_path: Path, kind: str, split_experts: bool,
                                                        expert_widths: bool) -> None:
    """llama.cpp's MoE files stack each layer's experts ([experts, rows, columns] per projection; older
    Mixtral files: a tensor per expert) and name the router ffn_gate_inp; Mixtral's say "llama" (their
    q/k rows permuted), Qwen2-MoE's add a shared expert and its gate. Each expert's projections come
    back under the checkpoint's names, the routing from the metadata. Q8_0 weights: the source's
    logits within quantisation, in transformers and exactly transformers' in our runner. A file
    without the experts' widths (early Qwen1.5-MoE conversions) has them read from its tensors."""
    architecture, routing = _MOE_FILES[kind]
    source = tiny_llama(kind=kind, seed=5)
    path = write_tiny_gguf(tmp_path / f"tiny-{kind}.Q8_0.gguf", source, GGMLQuantizationType.Q8_0,
                           split_experts=split_experts, expert_widths=expert_widths)
    model_dir = ensure_converted(path, tmp_path / "cache")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [architecture]
    assert {key: config[key] for key in routing} == routing
    loaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(loaded) is type(source)
    experts = source.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    torch.testing.assert_close(loaded.state_dict()["model.layers.1.mlp.experts.gate_up_proj"], experts, rtol=0,
                               atol=0.02)
    for proj in ("q_proj", "k_proj"):  # (Mixtral's rows un-permuted; too small an effect on these logits to show)
        name = f"model.layers.1.self_attn.{proj}.weight"
        torch.testing.assert_close(loaded.state_dict()[name], source.state_dict()[name], rtol=0, atol=0.02)
    if kind == "qwen2_moe":  # (its shared expert's gate: an F32 vector in the file, [1, hidden] here)
        gate = "model.layers.1.mlp.shared_expert_gate.weight"
        torch.testing.assert_close(loaded.state_dict()[gate], source.state_dict()[gate], rtol=0, atol=0)
    torch.testing.assert_close(_logits(loaded), _logits(source), rtol=0, atol=0.05)
    ours = prefill_logits(make_runner(model_dir, num_blocks=8, block_size=4), PROMPT_IDS[0].tolist(), [3, 1, 0])
    torch.testing.assert_close(ours, _logits(loaded)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_files_convert_without_the_llama_permutation(tmp_path: Path, kind: str) -> None:
    """llama.cpp writes Qwen2/Qwen3 q/k rows in HF's order: un-permuting them as Llama's would break
    RoPE. The converted directory gives the source model's logits, in transformers and in our
    runner, and Qwen3's head norms and head_dim come through."""
    source = tiny_llama(kind=kind, seed=2)
    model_dir = ensure_converted(write_tiny_gguf(tmp_path / f"tiny-{kind}.Q8_0.gguf", source,
                                                 GGMLQuantizationType.Q8_0), tmp_path / "cache")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [type(source).__name__] and config["model_type"] == kind
    assert config["head_dim"] == source.config.head_dim
    loaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(loaded) is type(source)
    # Q8_0 weights: close to the source, and exactly what the GGUF's dequantised weights give.
    torch.testing.assert_close(_logits(loaded), _logits(source), rtol=0, atol=0.05)
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    np.testing.assert_allclose(loaded.state_dict()[q_proj].numpy(), source.state_dict()[q_proj].numpy(), atol=0.02)
    if kind == "qwen3":
        norm = "model.layers.1.self_attn.k_norm.weight"
        torch.testing.assert_close(loaded.state_dict()[norm], source.state_dict()[norm], rtol=0, atol=0)
    else:
        bias = "model.layers.1.self_attn.k_proj.bias"
        torch.testing.assert_close(loaded.state_dict()[bias], source.state_dict()[bias], rtol=0, atol=0)
    runner = make_runner(model_dir, num_blocks=8, block_size=4)
    ours = prefill_logits(runner, PROMPT_IDS[0].tolist(), [3, 1, 0])
    torch.testing.assert_close(ours, _logits(loaded)[0], rtol=1e-4, atol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.decode(tokenizer.encode("the cat in there")) == "the cat in there"


@pytest.mark.parametrize("kind", ["gemma", "gemma2", "gemma3"])
def test_gemma_files_convert_with_their_norms_and_settings(tmp_path: Path, kind: str) -> None:
    """llama.cpp stores Gemma's norm weights as 1 + w and renames Gemma 2/3's four norms a layer;
    the soft caps, window and Gemma 3's window pattern and scaled global RoPE are in the metadata,
    its attention scale and local RoPE base are llama.cpp's defaults. The converted directory gives
    the source model's logits, in transformers and in our runner."""
    source = tiny_llama(kind=kind, seed=3, tie_word_embeddings=True)
    model_dir = ensure_converted(write_tiny_gguf(tmp_path / f"tiny-{kind}.gguf", source), tmp_path / "cache")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [type(source).__name__] and config["tie_word_embeddings"]
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    assert type(loaded) is type(source)
    for name, param in source.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], param, rtol=0, atol=1e-6, msg=name)
    reference = source.eval()
    reference.config._attn_implementation = "eager"
    torch.testing.assert_close(_logits(loaded), _logits(reference), rtol=0, atol=1e-5)
    ours = prefill_logits(make_runner(model_dir, num_blocks=8, block_size=4), PROMPT_IDS[0].tolist(), [3, 1, 0])
    torch.testing.assert_close(ours, _logits(reference)[0], rtol=1e-4, atol=1e-4)
    if kind == "gemma2":
        assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (2.0, 5.0)
    if kind == "gemma3":
        assert config["layer_types"] == source.config.layer_types and config["rope_local_base_freq"] == 10000.0
        assert config["rope_parameters"]["full_attention"]["factor"] == 2.0


@pytest.mark.parametrize("conv_bias, quant, moe", [(False, GGMLQuantizationType.F32, False),
                                                   (True, GGMLQuantizationType.Q8_0, False),
                                                   (False, GGMLQuantizationType.F32, True)],
                         ids=["lfm2", "lfm2_biases_q8_0", "lfm2_moe"])
def test_lfm2_files_convert_with_their_short_convolutions(tmp_path: Path, conv_bias: bool, quant, moe: bool) -> None:
    """llama.cpp's LFM2 files: the layer kinds from the per-layer KV head counts, the convolution's
    taps, its weights squeezed to 2-D, the final norm as token_embd_norm, the MLP's adjusted width;
    LFM2-MoE's (lfm2moe) stacked experts, expert bias, dense layers and scale. The converted
    directory gives the source model's logits, in transformers and in our runner."""
    source = tiny_lfm2(seed=4, conv_bias=conv_bias, moe=moe)
    model_dir = ensure_converted(write_tiny_lfm2_gguf(tmp_path / "tiny-lfm2.gguf", source, quant), tmp_path / "cache")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [type(source).__name__] and config["layer_types"] == source.config.layer_types
    assert config["conv_L_cache"] == 3 and config["conv_bias"] == conv_bias
    if moe:
        assert (config["num_experts"], config["num_dense_layers"], config["routed_scaling_factor"]) == (8, 1, 2.5)
        assert config["use_expert_bias"] and config["intermediate_size"] == 96
    else:
        assert config["intermediate_size"] == 128
    loaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(loaded) is type(source) and loaded.config.tie_word_embeddings
    if quant == GGMLQuantizationType.F32:
        for name, param in source.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[name], param, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(_logits(loaded), _logits(source), rtol=0, atol=0.05)
    ours = prefill_logits(make_runner(model_dir, num_blocks=8, block_size=4), PROMPT_IDS[0].tolist(), [3, 1, 0])
    torch.testing.assert_close(ours, _logits(loaded)[0], rtol=1e-4, atol=1e-4)


def test_gemma_27b_files_scale_attention_by_hidden_over_heads() -> None:
    """llama.cpp knows Gemma 2/3 27B by their layer counts (46 / 62) and scales their scores by
    1 / sqrt(hidden / heads), transformers' query_pre_attn_scalar of 144 / 168."""
    from gpu_worker.gguf_loader import _gemma_config

    meta = {"gemma2.attention.sliding_window": 4096, "gemma2.attn_logit_softcapping": 50.0,
            "gemma2.final_logit_softcapping": 30.0}
    big = _gemma_config(meta, "gemma2", {"num_attention_heads": 32, "hidden_size": 4608, "num_hidden_layers": 46,
                                         "head_dim": 128, "rope_parameters": {}})
    assert big["query_pre_attn_scalar"] == 144 and big["final_logit_softcapping"] == 30.0
    small = _gemma_config(meta, "gemma2", {"num_attention_heads": 8, "hidden_size": 2304, "num_hidden_layers": 26,
                                           "head_dim": 256, "rope_parameters": {}})
    assert small["query_pre_attn_scalar"] == 256
    # A Gemma 2 file from before llama.cpp wrote its window and caps: llama.cpp's defaults.
    old = _gemma_config({}, "gemma2", {"num_attention_heads": 8, "hidden_size": 2304, "num_hidden_layers": 26,
                                       "head_dim": 256, "rope_parameters": {}})
    assert (old["sliding_window"], old["attn_logit_softcapping"], old["final_logit_softcapping"]) == (4096, 50.0, 30.0)
    # A Gemma 3 file without a window (a pattern of 1): every layer global, with the global RoPE.
    unwindowed = _gemma_config({}, "gemma3", {"num_attention_heads": 4, "hidden_size": 1152, "num_hidden_layers": 3,
                                              "head_dim": 256, "rope_parameters": {}})
    assert unwindowed["layer_types"] == ["full_attention"] * 3 and unwindowed["sliding_window"] is None
    gemma3 = _gemma_config({"gemma3.attention.sliding_window": 1024}, "gemma3",
                           {"num_attention_heads": 32, "hidden_size": 5376, "num_hidden_layers": 62, "head_dim": 128,
                            "rope_parameters": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    assert gemma3["query_pre_attn_scalar"] == 168 and gemma3["sliding_window_pattern"] == 6
    assert gemma3["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0


# ------------------------------------------------------------------------------------- converted model dir


def test_converted_dir_reproduces_logits_and_tokenizer(
    tiny_gguf: Path, tiny_model: LlamaForCausalLM, tmp_path: Path
) -> None:
    model_dir = ensure_converted(tiny_gguf, tmp_path / "cache")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in model_dir.iterdir()
    }
    loaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.testing.assert_close(_logits(loaded), _logits(tiny_model), rtol=0, atol=1e-5)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer.encode("the cat in there")) == "the cat in there"
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2


def test_sharded_output_loads(tiny_gguf: Path, tiny_model: LlamaForCausalLM, tmp_path: Path) -> None:
    out = tmp_path / "sharded"
    out.mkdir()
    convert_gguf_to_hf(tiny_gguf, out, max_shard_bytes=100_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not list(out.glob("*.tmp.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(loaded), _logits(tiny_model), rtol=0, atol=1e-5)


def test_second_call_reuses_cache(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = ensure_converted(tiny_gguf, tmp_path)

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("cache hit expected, but the GGUF was converted again")

    monkeypatch.setattr(gguf_loader, "convert_gguf_to_hf", fail)
    assert ensure_converted(tiny_gguf, tmp_path) == first
    assert first.parent == tmp_path and first.name.startswith("tiny-llama.F32-")


def test_concurrent_callers_convert_once(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_convert = gguf_loader.convert_gguf_to_hf
    calls = []

    def slow_convert(*args: object, **kwargs: object) -> Path:
        calls.append(args)
        time.sleep(0.3)  # keeps the second caller waiting on the lock while the first converts
        return real_convert(*args, **kwargs)

    monkeypatch.setattr(gguf_loader, "convert_gguf_to_hf", slow_convert)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: ensure_converted(tiny_gguf, tmp_path), range(2)))
    assert results[0] == results[1]
    assert len(calls) == 1


def test_cache_dir_env_var_is_respected(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_CLUSTER_CACHE_DIR", str(tmp_path / "from-env"))
    assert ensure_converted(tiny_gguf).parent == tmp_path / "from-env"


def test_cache_key_changes_with_file_mtime_and_dtype(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"x" * 10)
    before = cache_key(path)
    assert cache_key(path, torch.bfloat16) != before
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert cache_key(path) != before


def test_failed_conversion_leaves_nothing_behind(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_tokenizer(*args: object, **kwargs: object) -> None:
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(gguf_loader, "build_tokenizer", broken_tokenizer)
    with pytest.raises(RuntimeError, match="tokenizer exploded"):
        ensure_converted(tiny_gguf, tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_missing_gguf_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        ensure_converted(tmp_path / "absent.gguf", tmp_path)


# ------------------------------------------------------------------------------------ real SmolLM2 model


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, float]:
    try:
        gguf_path = find_default_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    cache = tmp_path_factory.mktemp("smollm2-cache")
    start = time.perf_counter()
    model_dir = ensure_converted(gguf_path, cache)
    converted = time.perf_counter() - start
    start = time.perf_counter()
    assert ensure_converted(gguf_path, cache) == model_dir
    AutoModelForCausalLM.from_pretrained(model_dir)
    reloaded = time.perf_counter() - start
    return model_dir, converted, reloaded


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2_dir: tuple[Path, float, float], record_property: pytest.RecordProperty) -> None:
    model_dir, converted, reloaded = smollm2_dir
    record_property("conversion_s", round(converted, 1))
    record_property("cached_load_s", round(reloaded, 1))
    print(f"SmolLM2 GGUF conversion {converted:.1f}s, cached load {reloaded:.1f}s")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loader(smollm2_dir: tuple[Path, float, float]) -> None:
    # transformers' own loader (the from_pretrained(gguf_file=...) path needs accelerate, so call its core).
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    model_dir, _, _ = smollm2_dir
    ours = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    reference = LlamaForCausalLM(ours.config).eval()
    parsed = gguf_utils.load_gguf_checkpoint(str(find_default_gguf()), return_tensors=True, model_to_load=reference)
    reference.load_state_dict({k: torch.as_tensor(v) for k, v in parsed["tensors"].items()}, strict=False)
    reference.tie_weights()
    ours_state, ref_state = ours.state_dict(), reference.state_dict()
    for name, tensor in ours_state.items():
        torch.testing.assert_close(tensor, ref_state[name], rtol=0, atol=0, msg=name)
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("meta", "expected"), [
    ({}, {"rope_type": "default"}),
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, {"rope_type": "default"}),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    # As llama.cpp reads older files: a factor without a type is linear, also from rope.scale_linear.
    ({"llama.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ({"llama.rope.scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    ({"llama.rope.scale_linear": 1.0}, {"rope_type": "default"}),
])
def test_rope_scaling_is_read_as_llama_cpp_reads_it(meta: dict, expected: dict) -> None:
    from gpu_worker.gguf_loader import _rope_parameters

    assert _rope_parameters(meta, "llama", 10000.0) == {"rope_theta": 10000.0, **expected}


def test_end_of_turn_and_message_tokens_stop_generation_too() -> None:
    from gpu_worker.gguf_loader import _generation_config

    config = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
    meta = {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 8}
    assert _generation_config(config, meta) == {"_from_model_config": True, "bos_token_id": 1,
                                                "eos_token_id": [2, 7, 8]}
    assert _generation_config(config, {"tokenizer.ggml.eos_token_id": 2})["eos_token_id"] == 2
    # A file naming no end of turn (Gemma's): llama.cpp's end-of-turn texts, found in its vocabulary.
    assert _generation_config(config, {"tokenizer.ggml.eos_token_id": 1}, 107)["eos_token_id"] == [1, 107]
    assert _generation_config(config, meta, 107)["eos_token_id"] == [2, 7, 8]  # (a named one wins)


def test_end_of_turn_found_by_its_text(tiny_gguf: Path) -> None:
    from gpu_worker.gguf_loader import _end_of_turn_by_text

    assert _end_of_turn_by_text(GGUFReader(tiny_gguf)) == 2  # "<|im_end|>" in the tiny vocabulary
