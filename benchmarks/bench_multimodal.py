"""Images in prompts: our engine vs transformers on the same LLaVA work, and what the encoder cache saves.

A random LLaVA (CLIP tower: ``--image-size`` / ``--patch`` -> (size/patch)^2 tokens per image, a
``--layers``-layer ``--hidden``-wide Llama), CPU. ``--requests`` prompts, each an image and a line
of text, ``--max-tokens`` greedy tokens each, all at once:
  transformers   LlavaForConditionalGeneration.generate on the whole batch (the prompts are the
                 same length, so no padding), the reference;
  ours           an in-process engine (vision encoder scheduled with the prompts' chunks);
  ours, repeated the same requests where every prompt shows the same image after different text
                 (no prefix-cache hit reaches the image): the encoder runs once, its rows served
                 from the encoder cache to the others.
Prints wall time and output tokens/s of each, as a ratio to transformers, checks that ours equals
transformers token for token, and counts the images encoded. ``--next``: LLaVA-NeXT instead (grid
pinpoints of 1x2, 2x1 and 2x2 tiles: each 300x280 image is 5 tiles and more tokens). ``--qwen``:
Qwen2-VL instead (a 4-block native-resolution tower: each 300x280 image resized to 308x280 pixels,
22x20 patches, 110 tokens; M-RoPE positions in a Qwen2 decoder). ``--mistral3``: Mistral 3 instead
(a 4-block Pixtral tower, 2x2 patches merged: each 300x280 image 11 rows of 10 tokens, each row
ended by its break or end token, 121 tokens; a Mistral decoder). ``--internvl``: InternVL instead (a
4-layer InternViT over ``--image-size`` tiles, pixel-shuffled 2x2: each 300x280 image 1 tile of
(size/patch/2)^2 tokens, at most 2 tiles an image and a thumbnail beside them; a Qwen2 decoder).
``--qwen --video``: each prompt a video of 8 frames of 300x280 pixels in place of the image (frames
resized within a 28x28 to 196x196 pixels' range: 196x168, 14x12 patches; 4 frame pairs of 42
tokens, 168 tokens), its patches made by the router's video code (router.video); "repeated" the
same video in every prompt. ``--qwen3 [--video]``: Qwen3-VL instead (a 4-block tower over 16-pixel
patches, DeepStack rows from 2 blocks, a Qwen3 decoder with interleaved M-RoPE); its video's 8 frames
resized together into 224x192 (its video pixel range holds the whole video), 4 frame pairs of 42
tokens, each after its time as text: transformers encodes the video whole, ours pair by pair.
``--smolvlm``: SmolVLM (Idefics3) instead (a 4-layer SigLIP-like tower over 256-pixel tiles, 16-pixel
patches pixel-shuffled 2x2: each 300x280 image resized to 512 pixels on its longest side, cut into 2x2
tiles beside the whole image: 5 tiles of 64 tokens and their rows and columns as text; a Llama decoder).
Usage: python benchmarks/bench_multimodal.py [--rounds 2] [--requests 16] [--max-tokens 32]
       [--image-size 224] [--patch 14] [--layers 4] [--hidden 256] [--next | --qwen [--video] |
       --qwen3 [--video] | --mistral3 | --internvl | --smolvlm]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# A --video prompt's frames.
FRAMES = 8


def save_random(model_class, config, tokenizer, path: Path) -> None:
    """A ``model_class`` of ``config`` with random weights (seeded), and ``tokenizer``, saved to ``path``."""
    import torch

    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def build_qwen_model(path: Path, args: argparse.Namespace) -> Path:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.tiny_model import qwen_vl_tokenizer

    tokenizer, ids = qwen_vl_tokenizer()
    quarter = args.hidden // 4 // 8  # (the rotary half of a head split 1:1.5:1.5, as Qwen2-VL's 16:24:24)
    text = dict(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                 "mrope_section": [quarter, quarter * 3 // 2, quarter * 3 // 2]})
    vision = dict(depth=4, embed_dim=args.hidden, num_heads=4, hidden_size=args.hidden, patch_size=args.patch)
    config = Qwen2VLConfig(vision_config=vision, text_config=text, image_token_id=ids["image_pad"],
                           vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
                           video_token_id=ids["video_pad"])
    save_random(Qwen2VLForConditionalGeneration, config, tokenizer, path)
    Qwen2VLImageProcessorPil(patch_size=args.patch).save_pretrained(path)
    side = 2 * args.patch  # (the video frames' pixel range: 2x2 to 7x7 merged patches)
    (path / "video_preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": side * side, "longest_edge": 49 * side * side}, "patch_size": args.patch,
        "temporal_patch_size": 2, "merge_size": 2}))
    return path


def build_qwen3_model(path: Path, args: argparse.Namespace) -> Path:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.tiny_model import qwen_vl_tokenizer

    tokenizer, ids = qwen_vl_tokenizer()
    quarter = args.hidden // 4 // 8
    text = dict(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                head_dim=args.hidden // 4, max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_interleaved": True,
                                 "mrope_section": [quarter, quarter * 3 // 2, quarter * 3 // 2]})
    vision = dict(depth=4, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_heads=4,
                  out_hidden_size=args.hidden, patch_size=16, num_position_embeddings=64,
                  deepstack_visual_indexes=[1, 2])
    config = Qwen3VLConfig(vision_config=vision, text_config=text, image_token_id=ids["image_pad"],
                           vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
                           video_token_id=ids["video_pad"])
    save_random(Qwen3VLForConditionalGeneration, config, tokenizer, path)
    Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32, max_pixels=32 * 32 * 256).save_pretrained(path)
    (path / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 49 * FRAMES}}))
    return path


def build_smolvlm_model(path: Path, args: argparse.Namespace) -> Path:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from tests.tiny_model import idefics3_tokenizer

    tokenizer = idefics3_tokenizer()
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=args.hidden,
                intermediate_size=4 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id)
    vision = dict(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=4,
                  num_attention_heads=4, image_size=256, patch_size=16)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2, tie_word_embeddings=False,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    save_random(Idefics3ForConditionalGeneration, config, tokenizer, path)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 512}, max_image_size={"longest_edge": 256})
    Idefics3Processor(image_processor, tokenizer, image_seq_len=64).save_pretrained(path)
    return path


def build_mistral3_model(path: Path, args: argparse.Namespace) -> Path:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from tests.tiny_model import MISTRAL3_CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]})
    tokenizer.chat_template = MISTRAL3_CHAT_TEMPLATE
    text = dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=args.hidden,
                intermediate_size=4 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id,
                tie_word_embeddings=False)
    vision = dict(model_type="pixtral", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                  num_hidden_layers=4, num_attention_heads=4, image_size=1540, patch_size=args.patch,
                  hidden_act="silu")
    config = Mistral3Config(vision_config=vision, text_config=text, spatial_merge_size=2,
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), tie_word_embeddings=False)
    save_random(Mistral3ForConditionalGeneration, config, tokenizer, path)
    PixtralImageProcessorPil(size={"longest_edge": 1540}, patch_size={"height": args.patch, "width": args.patch}
                             ).save_pretrained(path)
    return path


def build_internvl_model(path: Path, args: argparse.Namespace) -> Path:
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from tests.tiny_model import INTERNVL_CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<img>", "</img>", "<IMG_CONTEXT>"]})
    tokenizer.chat_template = INTERNVL_CHAT_TEMPLATE
    text = dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=args.hidden,
                intermediate_size=4 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id,
                tie_word_embeddings=False)
    vision = dict(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=4,
                  num_attention_heads=4, image_size=args.image_size, patch_size=args.patch)
    tokens = (args.image_size // args.patch // 2) ** 2
    config = InternVLConfig(vision_config=vision, text_config=text, image_seq_length=tokens,
                            image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"), tie_word_embeddings=False)
    save_random(InternVLForConditionalGeneration, config, tokenizer, path)
    GotOcr2ImageProcessorPil(size={"height": args.image_size, "width": args.image_size}, crop_to_patches=True,
                             max_patches=2).save_pretrained(path)
    return path


def build_model(path: Path, args: argparse.Namespace) -> Path:
    if args.qwen:
        return build_qwen_model(path, args)
    if args.qwen3:
        return build_qwen3_model(path, args)
    if args.smolvlm:
        return build_smolvlm_model(path, args)
    if args.mistral3:
        return build_mistral3_model(path, args)
    if args.internvl:
        return build_internvl_model(path, args)
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
    )

    from tests.tiny_model import LLAVA_CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    vision = CLIPVisionConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=4,
                              num_attention_heads=4, image_size=args.image_size, patch_size=args.patch)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id)
    side = args.image_size
    pinpoints = [[side, 2 * side], [2 * side, side], [2 * side, 2 * side]]
    token = tokenizer.convert_tokens_to_ids("<image>")
    config = (LlavaNextConfig(vision_config=vision, text_config=text, image_token_id=token,
                              image_grid_pinpoints=pinpoints)
              if args.next else LlavaConfig(vision_config=vision, text_config=text, image_token_id=token,
                                            image_seq_length=(side // args.patch) ** 2))
    save_random(LlavaNextForConditionalGeneration if args.next else LlavaForConditionalGeneration, config, tokenizer,
                path)
    sizes = {"size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}
    (LlavaNextImageProcessor(image_grid_pinpoints=pinpoints, **sizes) if args.next
     else CLIPImageProcessor(**sizes)).save_pretrained(path)
    return path


def workload(model_dir: Path, args: argparse.Namespace, repeated: bool):
    """(token ids, features, pixel values) per request: '<text> <image>' with distinct texts of one
    length (no shared prefix past the first block) and distinct images, or one image everywhere."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    from engine_core.multimodal import MultiModalFeature, TensorData, feature_identifier
    from gpu_worker.config import ModelConfig
    from router.video import video_patches

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    vision = ModelConfig.from_pretrained(model_dir).vision
    image_id = vision.image_token_id
    # (Qwen2-VL's and InternVL's image within their start and end tokens.)
    qwen = args.qwen or args.qwen3
    wrap = (("<|vision_start|>", "<|vision_end|>") if qwen else ("<img>", "</img>") if args.internvl else ())
    before, after = ([tokenizer.convert_tokens_to_ids(t) for t in wrap] if wrap else (None, None))
    if args.mistral3:  # (its processor's patches are the merged 2x2 ones)
        processor.patch_size = {"height": 2 * args.patch, "width": 2 * args.patch}
    placeholders = vision.geometry.placeholder_ids(image_id, 300, 280)
    if args.video and args.qwen:
        image_id = vision.video_token_id
        placeholders = [image_id] * vision.geometry.video_num_tokens(FRAMES, 300, 280)
    n = len(placeholders)
    words = tokenizer.encode("Hello world the quick brown fox jumps over the lazy dog Paris Berlin capital")
    out = []
    for i in range(args.requests):
        seed = 0 if repeated else i
        image = Image.fromarray((np.random.RandomState(seed).rand(300, 280, 3) * 255).astype("uint8"))
        if args.smolvlm:
            out.append(tiled_image_request(model_dir, tokenizer, processor, vision, image,
                                           [words[(i + j) % len(words)] for j in range(8)], words[:4]))
            continue
        if args.video:
            frames = [Image.fromarray((np.random.RandomState(seed * 100 + f).rand(300, 280, 3) * 255)
                                      .astype("uint8")) for f in range(FRAMES)]
            if args.qwen3:
                out.append(timed_video_request(model_dir, tokenizer, processor, vision, frames,
                                               [words[(i + j) % len(words)] for j in range(8)], words[:4]))
                continue
            patches = video_patches(frames, vision.geometry, processor.image_mean, processor.image_std)
            processed = {"pixel_values_videos": torch.from_numpy(patches),
                         "video_grid_thw": torch.tensor([vision.geometry.video_patch_grid(FRAMES, 300, 280)])}
        else:
            # (InternVL's tile counts are its processor's own: its model takes the tiles alone.)
            processed = {k: v for k, v in processor(images=[image], return_tensors="pt").items()
                         if k != "num_patches"}
        text = [words[(i + j) % len(words)] for j in range(8)]
        if wrap:
            text.append(before)
        whole = qwen or args.internvl  # (Qwen2-VL's patches, InternVL's tiles: the image's whole batch)
        pixels = processed["pixel_values_videos"] if args.video else processed["pixel_values"]
        data = TensorData.from_array(pixels if whole else pixels[0])
        ids = text + placeholders + ([after] if wrap else []) + words[:4]
        kind = "video" if args.video else "image"
        if qwen:  # (transformers places the M-RoPE positions by the tokens' types: video 2, image 1)
            processed["mm_token_type_ids"] = torch.tensor([[(1 + args.video) * int(t == image_id) for t in ids]])
        feature = MultiModalFeature(kind, feature_identifier(kind, data), len(text), n, data,
                                    None if not vision.geometry.counts_by_size else (300, 280),
                                    FRAMES if args.video else 0, 1.0 if args.video else 0.0)
        out.append((ids, [feature], processed))
    return out


def timed_video_request(model_dir: Path, tokenizer, processor, vision, frames: list, text: list[int],
                        after: list[int]):
    """Qwen3-VL's video request as the router makes it (its frames taken at 2 a second): each frame pair
    a feature after its time as text; transformers' inputs the video whole."""
    import torch

    from router.multimodal import MultiModalProcessor, timed_video_tokens
    from router.video import DecodedVideo, process_video

    geometry, token = vision.geometry, vision.video_token_id
    media = MultiModalProcessor(vision.image_token_id, geometry, processor, str(model_dir), "", video_token_id=token,
                                timed_videos=timed_video_tokens(tokenizer, token, geometry))
    video = process_video(DecodedVideo(frames, len(frames), 2.0, (frames[0].height, frames[0].width)), geometry,
                          processor.image_mean, processor.image_std, str(model_dir))
    start, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    ids, _, offsets = media.expand_media([*text, start, token, end, *after], [], [video])
    height, width = video.frame_size
    processed = {"pixel_values_videos": video.pixel_values.to_tensor(),
                 "video_grid_thw": torch.tensor([[len(video.timestamps), height // 16, width // 16]]),
                 "mm_token_type_ids": torch.tensor([[2 * int(t == token) for t in ids]])}
    return ids, media.features([], ids, [], [video], offsets), processed


def tiled_image_request(model_dir: Path, tokenizer, processor, vision, image, text: list[int], after: list[int]):
    """SmolVLM's image request as the router makes it: each tile a feature after its row and column;
    transformers' inputs its processor's tiles."""
    import torch

    from router.image_tiles import tiled_image_tokens
    from router.multimodal import MultiModalProcessor

    geometry, token = vision.geometry, vision.image_token_id
    media = MultiModalProcessor(token, geometry, processor, str(model_dir), "<image>",
                                tiled_images=tiled_image_tokens(tokenizer, processor, token, geometry))
    tiled = media.process_image(image)
    ids, offsets = media.expand([*text, token, *after], 1, [tiled.image_size])
    pixels = torch.stack([tile.pixel_values.to_tensor() for tile in tiled.tiles])[None]
    processed = {"pixel_values": pixels, "pixel_attention_mask": torch.ones(pixels.shape[:2] + pixels.shape[3:],
                                                                            dtype=torch.long)}
    return ids, media.features([tiled], ids, offsets), processed


def run_transformers(model_dir: Path, work, max_tokens: int) -> tuple[float, list[list[int]]]:
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    ids = torch.tensor([w[0] for w in work])
    inputs = {key: torch.cat([w[2][key] for w in work]) for key in work[0][2]}  # (pixel_values, image_sizes)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, **inputs)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def run_ours(engine, work, max_tokens: int, tag: str) -> tuple[float, list[list[int]], int]:
    from engine_core.outputs import EngineCoreRequest
    from engine_core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {}
    encoded = 0
    t0 = time.perf_counter()
    for i, (ids, features, _) in enumerate(work):
        engine.add_request(EngineCoreRequest(request_id=f"{tag}-{i}", prompt_token_ids=ids, sampling_params=params,
                                             mm_features=features))
        got[f"{tag}-{i}"] = []
    while engine.has_work():
        so = engine.scheduler.schedule()
        encoded += sum(len(v) for v in so.scheduled_encoder_inputs.values())
        outputs = engine.scheduler.update_from_output(so, engine.executor.execute_model(so))
        for eco in outputs.values():
            for o in eco.outputs:
                got[o.request_id] += o.new_token_ids
    return time.perf_counter() - t0, [got[f"{tag}-{i}"] for i in range(len(work))], encoded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--patch", type=int, default=14)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--next", action="store_true", help="LLaVA-NeXT (tiles by the image's size)")
    kind.add_argument("--qwen", action="store_true", help="Qwen2-VL (native resolution, M-RoPE)")
    kind.add_argument("--qwen3", action="store_true", help="Qwen3-VL (DeepStack, timed video frames)")
    kind.add_argument("--mistral3", action="store_true", help="Mistral 3 (Pixtral tower, rows of image tokens)")
    kind.add_argument("--internvl", action="store_true", help="InternVL (InternViT over tiles, pixel shuffle)")
    kind.add_argument("--smolvlm", action="store_true", help="SmolVLM / Idefics3 (tiles, rows and columns as text)")
    parser.add_argument("--video", action="store_true", help="with --qwen / --qwen3: a video of 8 frames a prompt")
    args = parser.parse_args()
    if args.video and not (args.qwen or args.qwen3):
        parser.error("--video needs --qwen or --qwen3")
    import torch

    from cluster.config import ClusterConfig, EngineSpec
    from engine_core.engine_core import EngineCore
    from gpu_worker.executor import create_executor

    model_dir = build_model(Path(tempfile.mkdtemp(prefix="bench-multimodal-")), args)
    distinct, repeated = workload(model_dir, args, False), workload(model_dir, args, True)
    n = sum(f.length for f in distinct[0][1])  # (the image's or video's placeholders)
    longest = max(len(ids) for ids, _, _ in distinct)
    config = ClusterConfig(model=str(model_dir), defaults=EngineSpec(
        num_gpu_blocks=args.requests * (longest + args.max_tokens) // 16 + 64,
        max_model_len=longest + args.max_tokens + 16, max_num_batched_tokens=2048)).engine_configs()[0]
    engine = EngineCore(config, create_executor(config))
    times: dict[str, list[float]] = {"transformers": [], "ours": [], "ours, repeated": []}
    encoded = {}
    for r in range(args.rounds + 1):  # (round 0 warms up)
        t_ref, ref = run_transformers(model_dir, distinct, args.max_tokens)
        t_ours, ours, encoded["ours"] = run_ours(engine, distinct, args.max_tokens, f"d{r}")
        assert engine.reset_prefix_cache()
        t_rep, rep, encoded["ours, repeated"] = run_ours(engine, repeated, args.max_tokens, f"r{r}")
        assert engine.reset_prefix_cache()
        if r == 0:
            _, ref_rep = run_transformers(model_dir, repeated, args.max_tokens)
            assert ours == ref, "our tokens differ from transformers'"
            assert rep == ref_rep, "our tokens differ from transformers' (repeated image)"
            continue
        for name, t in (("transformers", t_ref), ("ours", t_ours), ("ours, repeated", t_rep)):
            times[name].append(t)
    total = args.requests * args.max_tokens
    model = ("Qwen2-VL" if args.qwen else "Qwen3-VL" if args.qwen3 else "SmolVLM" if args.smolvlm
             else "Mistral 3" if args.mistral3
             else "InternVL" if args.internvl
             else "LLaVA-NeXT" if args.next else "LLaVA")
    tower = (f"4-block native-resolution tower, {args.patch}px patches" if args.qwen
             else "4-block tower, 16px patches, DeepStack" if args.qwen3
             else "4-layer SigLIP-like 256px/16 tiles, pixel-shuffled" if args.smolvlm
             else f"4-block Pixtral tower, {args.patch}px patches merged 2x2" if args.mistral3
             else f"4-layer InternViT {args.image_size}px/{args.patch} tiles, pixel-shuffled" if args.internvl
             else f"4-layer CLIP {args.image_size}px/{args.patch}")
    decoder = ("Qwen3" if args.qwen3 else "Qwen2" if args.qwen or args.internvl else "Mistral" if args.mistral3
               else "Llama")
    text_tokens = len(distinct[0][0]) - n
    what = f"{FRAMES}-frame video" if args.video else "image"
    print(f"\n{args.requests} requests x ({n}-token {what} + {text_tokens} text tokens) x {args.max_tokens} tokens, "
          f"random {model} ({args.layers} x {args.hidden} {decoder}, {tower}), CPU, "
          f"{torch.get_num_threads()} torch threads, medians of {args.rounds} rounds; tokens equal transformers'")
    print(f"{'':16}{'wall s':>9}{'out tok/s':>11}{'vs transformers':>17}{'images encoded':>16}")
    base = statistics.median(times["transformers"])
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:16}{t:9.2f}{total / t:11.1f}{base / t:16.2f}x{encoded.get(name, args.requests):16}")
    if args.qwen3 and args.video:
        print(f"(ours encodes each video as its {len(distinct[0][1])} frame pairs, each an encoder input of its own; "
              "transformers each video whole)")
    if args.smolvlm:
        print(f"(ours encodes each image as its {len(distinct[0][1])} tiles, each an encoder input of its own)")


if __name__ == "__main__":
    main()
