"""Tiny random-weight Llama (and Qwen2-MoE) models with a real (small, byte-level BPE) tokenizer, saved as HF dirs."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Ünïcödé tëxt, naïve café, 東京は日本の首都です。 😀🚀 emoji and more words.",
    "def main():\n    return 42\n",
    "user assistant system What is the capital of France?",
] * 20


def build_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_llama(path: Path, seed: int = 0, num_layers: int = 2, hidden: int = 64, heads: int = 4,
                     kv_heads: int = 2, max_positions: int = 1024, tie: bool = False) -> Path:
    """Save a random tiny Llama with our tokenizer into ``path`` (an HF model directory)."""
    from transformers import LlamaConfig

    def config(**common):
        return LlamaConfig(intermediate_size=hidden * 2, num_key_value_heads=kv_heads, tie_word_embeddings=tie,
                           architectures=["LlamaForCausalLM"], **common)

    return _save_random_model(path, config, seed, num_layers, hidden, heads, max_positions)


def build_tiny_moe(path: Path, seed: int = 0, num_layers: int = 2, hidden: int = 64, heads: int = 4,
                   max_positions: int = 1024) -> Path:
    """Save a random tiny Qwen2-MoE (8 routed experts, 2 per token, a gated shared expert, the first
    layer's MLP dense) with our tokenizer into ``path``."""
    from transformers import Qwen2MoeConfig

    def config(**common):
        return Qwen2MoeConfig(intermediate_size=hidden * 2, num_key_value_heads=2, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
                              shared_expert_intermediate_size=hidden, mlp_only_layers=[0],
                              architectures=["Qwen2MoeForCausalLM"], **common)

    return _save_random_model(path, config, seed, num_layers, hidden, heads, max_positions)


def build_tiny_granite_hybrid(path: Path, seed: int = 0, hidden: int = 64, heads: int = 4,
                              max_positions: int = 1024) -> Path:
    """Save a random tiny Granite 4.0-H (Mamba-2 layers around an attention layer without positions,
    4 routed experts and a shared one) with our tokenizer into ``path``."""
    from transformers import GraniteMoeHybridConfig

    kinds = ["mamba", "attention", "mamba"]

    def config(**common):
        return GraniteMoeHybridConfig(intermediate_size=hidden // 2, shared_intermediate_size=hidden,
                                      num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                      layer_types=kinds, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=1,
                                      mamba_chunk_size=16,
                                      position_embedding_type="nope", architectures=["GraniteMoeHybridForCausalLM"],
                                      **common)

    return _save_random_model(path, config, seed, len(kinds), hidden, heads, max_positions)


def build_tiny_gemma2(path: Path, seed: int = 0, num_layers: int = 2, hidden: int = 64, heads: int = 4,
                      max_positions: int = 1024) -> Path:
    """Save a random tiny Gemma 2 (window 8 on its even layers, soft caps that bind: 2 on attention
    scores, 5 on the logits) with our tokenizer into ``path``."""
    from transformers import Gemma2Config

    def config(**common):
        return Gemma2Config(intermediate_size=hidden * 2, num_key_value_heads=2, head_dim=hidden // heads,
                            query_pre_attn_scalar=hidden // heads, sliding_window=8, attn_logit_softcapping=2.0,
                            final_logit_softcapping=5.0, architectures=["Gemma2ForCausalLM"], **common)

    return _save_random_model(path, config, seed, num_layers, hidden, heads, max_positions)


def build_tiny_embedder(path: Path, pooling_mode: str = "pooling_mode_mean_tokens", normalize: bool = False,
                        seed: int = 0) -> Path:
    """Save a random tiny e5-mistral-style embedding model into ``path``: transformers' bare
    MistralModel (no LM head), our tokenizer, and sentence-transformers files declaring
    ``pooling_mode`` (and a Normalize module when ``normalize``)."""
    from transformers import AutoModel, MistralConfig

    def config(**common):
        return MistralConfig(intermediate_size=128, num_key_value_heads=2, sliding_window=None,
                             architectures=["MistralModel"], **common)

    path = _save_random_model(path, config, seed, 2, 64, 4, 1024, auto_class=AutoModel)
    _write_sentence_transformers_files(path, pooling_mode, normalize)
    return path


def _write_sentence_transformers_files(path: Path, pooling_mode: str, normalize: bool) -> None:
    """modules.json and the Pooling module's config, as sentence-transformers saves them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, pooling_mode: True}))


def build_tiny_classifier(path: Path, num_labels: int = 1, seed: int = 0) -> Path:
    """Save a random tiny LlamaForSequenceClassification (one output: a cross-encoder or reward
    model) with our tokenizer into ``path``."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    def config(**common):
        return LlamaConfig(intermediate_size=128, num_key_value_heads=2, num_labels=num_labels,
                           architectures=["LlamaForSequenceClassification"], **common)

    return _save_random_model(path, config, seed, 2, 64, 4, 1024, auto_class=AutoModelForSequenceClassification)


def _save_random_model(path: Path, make_config, seed: int, num_layers: int, hidden: int, heads: int,
                       max_positions: int, auto_class=None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer()
    config = make_config(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=num_layers,
                         num_attention_heads=heads, max_position_embeddings=max_positions,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return _save_randomized((auto_class or AutoModelForCausalLM).from_config(config), path, tokenizer)


def _norms_off_their_init(model, names: tuple[str, ...] = ("norm",)) -> None:
    """Each norm's (1-d, named with one of ``names``) scales drawn from 0.5..1.5, off their init of
    ones, so a test sees each norm applied."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and any(part in name for part in names):
                p.uniform_(0.5, 1.5)


def _save_randomized(model, path: Path, tokenizer, rescale: dict[str, float] | None = None) -> Path:
    """Save ``model`` (weights drawn larger than the init default, so greedy decoding is not
    dominated by near-ties; those whose names contain a key of ``rescale`` then scaled by its value),
    its generation config and ``tokenizer`` into ``path``."""
    import torch
    from transformers import GenerationConfig

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
        for name, p in model.named_parameters():
            for part, factor in (rescale or {}).items():
                if part in name:
                    p.mul_(factor)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_wordpiece_tokenizer(extra_words: tuple[str, ...] = ()):
    """A small BERT (WordPiece, lower-cased) tokenizer over the corpus' words (and ``extra_words``):
    [CLS] a [SEP] b [SEP] with token types 0 then 1 for a pair, as BERT's tokenizers join them."""
    import re

    from transformers import BertTokenizerFast

    words = sorted({w for line in _CORPUS for w in re.findall(r"[a-z]+", line.lower())} | set(extra_words))
    chars = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'():"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars[:36]), *words]
    return BertTokenizerFast(vocab={token: i for i, token in enumerate(dict.fromkeys(vocab))}, do_lower_case=True)


def build_tiny_bert(path: Path, num_labels: int = 0, seed: int = 0, pooling_mode: str | None = None,
                    normalize: bool = True, max_positions: int = 128, per_token: bool = False) -> Path:
    """Save a random tiny BERT with a WordPiece tokenizer into ``path``: the bare encoder (an
    embedding model; with ``pooling_mode`` its sentence-transformers files), or with ``num_labels``
    a BertForSequenceClassification (a cross-encoder for one; ``per_token``: BertForTokenClassification)."""
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoModelForTokenClassification, BertConfig

    path = Path(path)
    tokenizer = build_wordpiece_tokenizer()
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=max_positions, num_labels=max(num_labels, 1),
                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    auto = AutoModelForTokenClassification if per_token else AutoModelForSequenceClassification
    model = (auto if num_labels else AutoModel).from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # (Biases start at 0 and LayerNorms at 1 in transformers: random ones show any skipped.)
            p.normal_(1.0 if name.endswith("LayerNorm.weight") else 0.0, 0.2 if p.dim() > 1 else 0.3)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if pooling_mode is not None:
        _write_sentence_transformers_files(path, pooling_mode, normalize)
    return path


class RewardReference:
    """Qwen2.5-Math-RM / -PRM as their custom code computes: transformers' Qwen2Model, then score =
    Linear, ReLU, Linear (with biases) over every token's final hidden state."""

    def __init__(self, num_labels: int, vocab_size: int, seed: int = 4, hidden: int = 64, num_layers: int = 2,
                 max_positions: int = 256) -> None:
        import torch
        from transformers import AutoModel, Qwen2Config

        torch.manual_seed(seed)
        config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                             num_hidden_layers=num_layers, num_attention_heads=hidden // 16, num_key_value_heads=2,
                             max_position_embeddings=max_positions)
        self.model = AutoModel.from_config(config, dtype=torch.float32).eval()
        self.score = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(hidden, num_labels))
        with torch.no_grad():
            for p in [*self.model.parameters(), *self.score.parameters()]:
                p.normal_(0.0, 0.2 if hidden <= 64 else 0.04)

    def __call__(self, prompt: list[int]):
        """Each token's outputs [len(prompt), num_labels]."""
        import torch

        with torch.no_grad():
            return self.score(self.model(torch.tensor([prompt])).last_hidden_state[0])


def build_tiny_reward_model(path: Path, architecture: str = "Qwen2ForProcessRewardModel", **shape) -> RewardReference:
    """Save a random tiny Qwen2ForRewardModel (one output) or Qwen2ForProcessRewardModel (two) into
    ``path`` as the Qwen reward checkpoints are (model.*, score.0.*, score.2.*, and an LM head nothing
    reads), with our tokenizer (chat template included) plus the step separator "<extra_0>"; returns
    the reference that computes its outputs."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<extra_0>"]})
    # (``shape``: RewardReference's hidden, num_layers and max_positions, for benchmarks.)
    reference = RewardReference(2 if architecture == "Qwen2ForProcessRewardModel" else 1, len(tokenizer), **shape)
    tensors = {f"model.{k}": v.contiguous() for k, v in reference.model.state_dict().items()}
    tensors |= {f"score.{k}": v.contiguous() for k, v in reference.score.state_dict().items()}
    tensors["lm_head.weight"] = torch.randn(len(tokenizer), reference.model.config.hidden_size)
    save_file(tensors, str(path / "model.safetensors"))
    config = reference.model.config.to_dict() | {"architectures": [architecture],
                                                 "bos_token_id": tokenizer.bos_token_id,
                                                 "eos_token_id": tokenizer.eos_token_id}
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(path)
    return reference


# A chat template that takes a message's content as text or as OpenAI-style parts (an image part
# stands where the image goes), as llava-hf's templates do.
LLAVA_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_llava(path: Path, seed: int = 0, image_size: int = 32, patch_size: int = 8,
                     select_strategy: str = "default", feature_layer: int = -2) -> Path:
    """Save a random tiny LLaVA (a 3-layer CLIP vision tower over 16 patches of a 32x32 image, a
    two-layer projector, a 2-layer Llama) with our tokenizer plus an ``<image>`` token, a chat template
    taking image parts, and CLIP's image processor config into ``path``."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration

    tokenizer, vision, text = _llava_parts(image_size, patch_size)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(
        "<image>"), vision_feature_select_strategy=select_strategy, vision_feature_layer=feature_layer,
        image_seq_length=(image_size // patch_size) ** 2 + (select_strategy == "full"),
        eos_token_id=tokenizer.eos_token_id)
    processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                   crop_size={"height": image_size, "width": image_size})
    return _save_llava(Path(path), LlavaForConditionalGeneration, config, seed, tokenizer, processor)


def build_tiny_llava_next(path: Path, seed: int = 0,
                          pinpoints: tuple[tuple[int, int], ...] = ((32, 64), (64, 32), (64, 64), (32, 96), (96, 32))
                          ) -> Path:
    """Save a random tiny LLaVA-NeXT (build_tiny_llava's parts, 32x32 tiles, and "anyres" grid
    pinpoints: an image is fitted into one, cut into tiles beside a whole-image tile) into ``path``."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessor

    tokenizer, vision, text = _llava_parts(32, 8)
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(
        "<image>"), image_grid_pinpoints=[list(p) for p in pinpoints], eos_token_id=tokenizer.eos_token_id)
    processor = LlavaNextImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                        image_grid_pinpoints=[list(p) for p in pinpoints])
    return _save_llava(Path(path), LlavaNextForConditionalGeneration, config, seed, tokenizer, processor)


def _llava_parts(image_size: int, patch_size: int):
    """Our tokenizer with an ``<image>`` token and a chat template taking image parts, a 3-layer CLIP
    tower's config and a 2-layer Llama's."""
    from transformers import CLIPVisionConfig, LlamaConfig

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=image_size, patch_size=patch_size, projection_dim=16)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer, vision, text


def _save_llava(path: Path, model_class, config, seed: int, tokenizer, processor) -> Path:
    import torch

    torch.manual_seed(seed)
    _save_randomized(model_class(config), path, tokenizer)
    processor.save_pretrained(path)
    return path


QWEN_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen_vl_tokenizer():
    """Our tokenizer plus Qwen-VL's vision tokens and a chat template taking image and video parts,
    and those tokens' ids by name (vision_start, image_pad, vision_end, video_pad)."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>",
                                                                "<|vision_end|>", "<|video_pad|>"]})
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>")
           for name in ("vision_start", "image_pad", "vision_end", "video_pad")}
    return tokenizer, ids


def build_tiny_qwen2_vl(path: Path, seed: int = 0, windowed: bool = False, max_pixels: int = 28 * 28 * 16,
                        rope_scaling: dict | None = None) -> Path:
    """Save a random tiny Qwen2-VL (``windowed``: Qwen2.5-VL) into ``path``: a 2-block vision tower
    (3 blocks, windows of 2x2 merged patches and one full-attention block for 2.5) over 14-pixel
    patches, a 2-layer Qwen2 decoder with M-RoPE, our tokenizer plus Qwen's vision tokens, a chat
    template taking image parts, and the image processor's config (at most ``max_pixels`` per image).
    ``rope_scaling``: the decoder's frequency scaling beside M-RoPE (e.g. YaRN's keys)."""
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer, ids = qwen_vl_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 **(rope_scaling or {})},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    tokens = dict(image_token_id=ids["image_pad"], vision_start_token_id=ids["vision_start"],
                  vision_end_token_id=ids["vision_end"], video_token_id=ids["video_pad"],
                  eos_token_id=tokenizer.eos_token_id)
    if windowed:
        vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, window_size=56,
                      fullatt_block_indexes=[1], tokens_per_second=2)
        model_class, config = Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig(
            vision_config=vision, text_config=text, **tokens)
    else:
        vision = dict(depth=2, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=2)
        model_class, config = Qwen2VLForConditionalGeneration, Qwen2VLConfig(vision_config=vision, text_config=text,
                                                                              **tokens)
    torch.manual_seed(seed)
    model = model_class(config)
    _norms_off_their_init(model, ("norm", "ln_q"))
    # (The merger's rows scaled to the text embeddings' size: else an image's rows decide every answer.)
    _save_randomized(model, Path(path), tokenizer, rescale={"merger.mlp.2.": 0.1})
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels).save_pretrained(path)
    # (Its video processor's frames: 56x56 to 56x112 pixels, 4 to 8 tokens a temporal patch.)
    (Path(path) / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "Qwen2VLVideoProcessor", "size": {"shortest_edge": 56 * 56, "longest_edge": 56 * 112},
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}))
    return Path(path)


def build_tiny_qwen3_vl(path: Path, seed: int = 0, max_pixels: int = 32 * 32 * 16, moe: bool = False) -> Path:
    """Save a random tiny Qwen3-VL into ``path``: a 3-block vision tower over 16-pixel patches (its
    learnt position grid 4x4, interpolated to each image's; DeepStack rows from blocks 0 and 1), a
    2-layer Qwen3 decoder with interleaved M-RoPE (``moe``: Qwen3-VL-MoE's, 4 routed experts, 2 a
    token), build_tiny_qwen2_vl's tokenizer and template, and the image processor's config (at most
    ``max_pixels`` per image) and the video processor's."""
    import torch
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer, ids = qwen_vl_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    config_class, model_class = ((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if moe
                                 else (Qwen3VLConfig, Qwen3VLForConditionalGeneration))
    config = config_class(vision_config=vision, text_config=text, image_token_id=ids["image_pad"],
                          vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
                          video_token_id=ids["video_pad"])
    torch.manual_seed(seed)
    model = model_class(config)
    _norms_off_their_init(model)
    # (The mergers' rows scaled to the text embeddings' size: else an image's rows decide every answer.)
    _save_randomized(model, Path(path), tokenizer, rescale={"merger.linear_fc2.": 0.1, "merger_list": 0.1})
    Qwen2VLImageProcessorPil(patch_size=16, min_pixels=64 * 64, max_pixels=max_pixels).save_pretrained(path)
    # (Its video processor's range, all of a video's frames together: 4 frames of 60x120 are resized to
    # 32x96, 3 tokens a pair of frames.)
    (Path(path) / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "Qwen3VLVideoProcessor", "size": {"shortest_edge": 32 * 32 * 4,
                                                                  "longest_edge": 32 * 32 * 24},
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "fps": 2, "min_frames": 4, "max_frames": 768}))
    return Path(path)


# SmolVLM's chat template (Idefics3): "User:<image>What is it?<end_of_utterance>\nAssistant:".
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def idefics3_tokenizer():
    """Our tokenizer plus Idefics3's image tokens (SmolVLM's: <fake_token_around_image>, <image>,
    <global-img>, <row_R_col_C> for R, C in 1..6, <end_of_utterance>) and SmolVLM's chat template."""
    tokenizer = build_tokenizer()
    grid = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                                "<end_of_utterance>", "<global-img>", *grid]})
    tokenizer.chat_template = IDEFICS3_CHAT_TEMPLATE
    return tokenizer


def build_tiny_idefics3(path: Path, seed: int = 0, longest_edge: int = 128, split: bool = True,
                        smolvlm: bool = False, tile: int = 64, patch: int = 16) -> Path:
    """Save a random tiny Idefics3 (SmolVLM's architecture; ``smolvlm``: SmolVLM2's class of it) into
    ``path``: a 2-layer SigLIP-like tower over ``tile``-pixel tiles in ``patch``-pixel patches (a tile
    side of 4 patches, SmolVLM 2.2B's floored when not whole), pixel-shuffled 2x2 (4 tokens a tile)
    into a 2-layer Llama; idefics3_tokenizer's tokens and template; its image processor (images
    resized to ``longest_edge``, cut into tiles beside the whole image as one where ``split``)."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = idefics3_tokenizer()
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=tile,
                  patch_size=patch)
    config_class, model_class = ((SmolVLMConfig, SmolVLMForConditionalGeneration) if smolvlm
                                 else (Idefics3Config, Idefics3ForConditionalGeneration))
    config = config_class(vision_config=vision, text_config=text, scale_factor=2,
                          image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_class(config)
    _norms_off_their_init(model)
    # (The connector's rows scaled to the text embeddings' size: else an image's rows decide every answer.)
    _save_randomized(model, Path(path), tokenizer, rescale={"connector.": 0.3})
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": longest_edge},
                                                max_image_size={"longest_edge": tile}, do_image_splitting=split)
    Idefics3Processor(image_processor, tokenizer, image_seq_len=4).save_pretrained(path)
    return Path(path)


GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def build_tiny_gemma3_vl(path: Path, seed: int = 0) -> Path:
    """Save a random tiny Gemma 3 with images (Gemma3ForConditionalGeneration) into ``path``: a 2-layer
    SigLIP tower over 64x64 images in 8-pixel patches, pooled to 16 tokens an image; a 2-layer Gemma 3
    decoder whose first layer attends through an 8-token window (an image's 16 tokens outrun it); our
    tokenizer plus Gemma's image tokens, a chat template writing <start_of_image> per image, and the
    image processor's config."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<end_of_image>",
                                                                "<image_soft_token>"]})
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<start_of_image>", "<end_of_image>", "<image_soft_token>")}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                  patch_size=8, model_type="siglip_vision_model", vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                          image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
                          eoi_token_index=ids["<end_of_image>"], eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # (Gemma's norms scale by 1 + w and start at 0: random ones show each one)
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(0.0, 0.3)
    # (The projector's rows scaled to the text embeddings' size: else an image's rows decide every answer.)
    _save_randomized(model, Path(path), tokenizer, rescale={"mm_input_projection_weight": 0.1})
    Gemma3ImageProcessorPil(size={"height": 64, "width": 64}).save_pretrained(path)
    return Path(path)


MISTRAL3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}[IMG]{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% if m['role'] == 'user' %}[/INST]{% else %}{{ eos_token }}{% endif %}{% endfor %}")


# Mistral's control tokens at their ids (a tekken.json's special tokens, as Mistral's releases list
# them), and its pre-tokenizer pattern.
TEKKEN_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                   "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
                   "[THINK]", "[/THINK]")
TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                  r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def tekken_vocabulary(num_special: int = 32) -> dict:
    """A tekken.json (Mistral's own tokenizer file) over our tiny tokenizer's byte-level merges: the
    256 bytes, then each merge's token in merge order, as ranks after ``num_special`` control tokens."""
    import base64

    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    merges = json.loads(build_tokenizer().backend_tokenizer.to_str())["model"]["merges"]
    ranks = [bytes([i]) for i in range(256)]
    for merge in merges:
        token = bytes(to_byte[c] for c in "".join(merge.split(" ") if isinstance(merge, str) else merge))
        if token not in ranks:
            ranks.append(token)
    return {"config": {"pattern": TEKKEN_PATTERN, "num_vocab_tokens": len(ranks),
                       "default_vocab_size": num_special + len(ranks), "default_num_special_tokens": num_special,
                       "version": "v13"},
            "vocab": [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": None}
                      for i, t in enumerate(ranks)],
            "special_tokens": [{"rank": i, "token_str": t, "is_control": True} for i, t in enumerate(TEKKEN_SPECIALS)]}


def build_tiny_mistral3(path: Path, seed: int = 0, llava: bool = False, longest_edge: int = 64,
                        ministral3: bool = False, tekken: bool = False) -> Path:
    """Save a random tiny Mistral 3 (Mistral3ForConditionalGeneration: a 2-layer Pixtral tower in
    8-pixel patches merged 2x2, so a token is 16 pixels, with its RMSNorm-and-merger projector) or,
    ``llava``, a tiny Pixtral-12B (LlavaForConditionalGeneration over a Pixtral tower, a token a
    patch), each over a 2-layer Mistral decoder; our tokenizer plus [IMG], [IMG_BREAK] and [IMG_END],
    a chat template writing [IMG] per image, and Pixtral's image processor config (images shrunk to
    fit ``longest_edge`` pixels). ``ministral3``: Ministral 3's language model (YaRN over a pretrained
    16 positions, queries past them scaled by Llama 4's attention temperature) in place of Mistral's.
    ``tekken``: the tokenizer as Mistral's releases ship it, tekken.json alone (Mistral's control
    tokens at their ids: [IMG] 10, [IMG_BREAK] 12, [IMG_END] 13) and the chat template's file."""
    import torch
    from transformers import (
        LlavaConfig,
        LlavaForConditionalGeneration,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
    )
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]})
    tokenizer.chat_template = MISTRAL3_CHAT_TEMPLATE
    text = dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024, rms_norm_eps=1e-5, sliding_window=None,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    if ministral3:
        text.update(model_type="ministral3", rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 64.0, "original_max_position_embeddings": 16,
            "max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.5})
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=longest_edge, patch_size=8, hidden_act="silu",
                  rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    image_token = tokenizer.convert_tokens_to_ids("[IMG]")
    vocabulary = tekken_vocabulary() if tekken else None
    if vocabulary is not None:
        image_token = TEKKEN_SPECIALS.index("[IMG]")
        text.update(vocab_size=vocabulary["config"]["default_vocab_size"], bos_token_id=1, eos_token_id=2)
    if llava:
        config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token,
                             vision_feature_layer=-1, vision_feature_select_strategy="full",
                             eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
        model_class = LlavaForConditionalGeneration
    else:
        config = Mistral3Config(vision_config=vision, text_config=text, image_token_index=image_token,
                                spatial_merge_size=2, vision_feature_layer=-1,
                                eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
        model_class = Mistral3ForConditionalGeneration
    if vocabulary is not None:
        config.eos_token_id = 2
    torch.manual_seed(seed)
    _save_randomized(model_class(config), Path(path), tokenizer)
    if vocabulary is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            (Path(path) / name).unlink(missing_ok=True)
        (Path(path) / "tekken.json").write_text(json.dumps(vocabulary))
        (Path(path) / "chat_template.jinja").write_text(MISTRAL3_CHAT_TEMPLATE)
    PixtralImageProcessorPil(size={"longest_edge": longest_edge}, patch_size={"height": 8, "width": 8}
                             ).save_pretrained(path)
    return Path(path)


INTERNVL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<IMG_CONTEXT>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_internvl(path: Path, seed: int = 0, max_patches: int = 6) -> Path:
    """Save a random tiny InternVL (InternVLForConditionalGeneration: a 2-layer InternViT over 56-pixel
    tiles of 14-pixel patches, pixel-shuffled to 4 tokens a tile; a 2-layer Qwen2 decoder) with our
    tokenizer plus <img>, </img> and <IMG_CONTEXT>, a chat template writing <IMG_CONTEXT> per image,
    and the image processor's config (1..``max_patches`` tiles an image, a thumbnail beside more)."""
    import torch
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<img>", "</img>", "<IMG_CONTEXT>"]})
    tokenizer.chat_template = INTERNVL_CHAT_TEMPLATE
    text = dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14, use_qk_norm=True, norm_type="rms_norm")
    config = InternVLConfig(vision_config=vision, text_config=text,
                            image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=4,
                            eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config)
    with torch.no_grad():  # (layer scales and norms away from their init, so each one shows)
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("lambda" in name or "norm" in name):
                p.normal_(1.0, 0.3)
    _save_randomized(model, Path(path), tokenizer)
    GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=False, min_patches=1,
                             max_patches=max_patches).save_pretrained(path)
    return Path(path)
