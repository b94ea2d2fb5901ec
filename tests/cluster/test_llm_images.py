"""The offline LLM with images (vLLM's multi_modal_data prompts and image parts in LLM.chat): equal
to transformers' LLaVA; refusals."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from cluster import LLM, SamplingParams
from tests.tiny_model import build_tiny_llama, build_tiny_llava

MAX_TOKENS = 6


def picture(seed: int):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(36, 44, 3) * 255).astype("uint8"))


def hf_tokens(model_dir, ids: list[int], images: list) -> list[int]:
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    expanded: list[int] = []
    for token in ids:
        expanded += [token] * 16 if token == model.config.image_token_id else [token]
    pixels = AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([expanded]), pixel_values=pixels, max_new_tokens=MAX_TOKENS,
                             do_sample=False, attention_mask=torch.ones(1, len(expanded), dtype=torch.long))
    return out[0, len(expanded):].tolist()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    model_dir = build_tiny_llava(tmp_path_factory.mktemp("llava"))
    llm = LLM(model=str(model_dir), num_gpu_blocks=64, max_model_len=256)
    yield model_dir, llm
    llm.shutdown()


def test_generate_with_multi_modal_data_equals_transformers(llava):
    model_dir, llm = llava
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    one, two = picture(0), picture(1)
    outputs = llm.generate([{"prompt": "Hello <image> world", "multi_modal_data": {"image": one}},
                            {"prompt": "<image> and <image>?", "multi_modal_data": {"image": [one, two]}},
                            "plain text"], params, use_tqdm=False)
    tokenizer = llm.tokenizer
    assert outputs[0].outputs[0].token_ids == hf_tokens(model_dir, tokenizer.encode("Hello <image> world"), [one])
    assert outputs[1].outputs[0].token_ids == hf_tokens(model_dir, tokenizer.encode("<image> and <image>?"),
                                                        [one, two])
    assert outputs[0].prompt == "Hello <image> world" and outputs[2].outputs[0].token_ids
    assert len(outputs[0].prompt_token_ids) == len(tokenizer.encode("Hello <image> world")) + 15


def test_chat_with_image_parts_equals_transformers(llava):
    model_dir, llm = llava
    image = picture(2)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    by_url, by_pil = llm.chat([
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                      {"type": "text", "text": "What is it?"}]}],
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                      {"type": "text", "text": "What is it?"}]}]], params, use_tqdm=False)
    rendered = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
        add_generation_prompt=True, tokenize=False)
    want = hf_tokens(model_dir, llm.tokenizer.encode(rendered, add_special_tokens=False), [image])
    assert by_url.outputs[0].token_ids == by_pil.outputs[0].token_ids == want


def test_refusals(llava, tmp_path):
    _, llm = llava
    with pytest.raises(ValueError, match=r"0 image token\(s\).*for 1 image"):
        llm.generate({"prompt": "no token here", "multi_modal_data": {"image": picture(3)}}, use_tqdm=False)
    with pytest.raises(ValueError, match="takes images and videos"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"audio": [1.0]}}, use_tqdm=False)
    with pytest.raises(ValueError, match="takes no videos"):  # (LLaVA's)
        llm.generate({"prompt": "<video>", "multi_modal_data": {"video": np.zeros((2, 8, 8, 3), np.uint8)}},
                     use_tqdm=False)
    from PIL import Image

    with pytest.raises(ValueError, match="prompt 0: an image of 1000x2 pixels is too narrow"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": Image.new("RGB", (1000, 2))}},
                     use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": picture(3)}},
                     SamplingParams(max_tokens=2, truncate_prompt_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"only LLM\.generate and LLM\.chat"):
        llm.embed({"prompt": "<image>", "multi_modal_data": {"image": picture(3)}}, use_tqdm=False)
    text = LLM(model=str(build_tiny_llama(tmp_path / "text")), num_gpu_blocks=16, max_model_len=128)
    try:
        with pytest.raises(ValueError, match="takes no images"):
            text.generate({"prompt": "x", "multi_modal_data": {"image": picture(3)}}, use_tqdm=False)
    finally:
        text.shutdown()


def test_llava_next_counts_each_image_by_its_size(tmp_path):
    """LLaVA-NeXT offline: an image's placeholders follow its size ("anyres" tiles); transformers' tokens."""
    from transformers import AutoImageProcessor, LlavaNextForConditionalGeneration

    from tests.tiny_model import build_tiny_llava_next

    model_dir = build_tiny_llava_next(tmp_path / "next")
    images = [picture(4), picture(5).resize((90, 20))]
    with LLM(model=str(model_dir), num_gpu_blocks=64, max_model_len=512) as llm:
        [out] = llm.generate({"prompt": "<image> then <image>", "multi_modal_data": {"image": images}},
                             SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
        model = LlavaNextForConditionalGeneration.from_pretrained(model_dir).eval()
        processed = AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt")
        with torch.no_grad():
            ids = torch.tensor([out.prompt_token_ids])
            want = model.generate(input_ids=ids, pixel_values=processed["pixel_values"],
                                  image_sizes=processed["image_sizes"], max_new_tokens=MAX_TOKENS, do_sample=False,
                                  attention_mask=torch.ones_like(ids))[0, ids.shape[1]:].tolist()
    assert out.outputs[0].token_ids == want
    from gpu_worker.config import ModelConfig

    geometry = ModelConfig.from_pretrained(model_dir).vision.geometry
    counts = (geometry.num_tokens(36, 44), geometry.num_tokens(20, 90))
    assert out.prompt_token_ids.count(model.config.image_token_id) == sum(counts) and counts[0] != counts[1]


def test_qwen2_vl_chat_places_each_image_by_its_grid(tmp_path):
    """Qwen2-VL offline on two TP workers: image parts in LLM.chat, each image's placeholders by its resized grid and
    their M-RoPE positions by their place in it; transformers' tokens."""
    from transformers import AutoImageProcessor, Qwen2VLForConditionalGeneration

    from tests.tiny_model import build_tiny_qwen2_vl

    model_dir = build_tiny_qwen2_vl(tmp_path / "qwen2-vl")
    images = [picture(6), picture(7).resize((20, 90))]
    content = [{"type": "image_pil", "image_pil": images[0]}, {"type": "text", "text": "and"},
               {"type": "image_pil", "image_pil": images[1]}]
    # (Two tensor-parallel workers: the tower runs whole on each, the positions are each one's own.)
    with LLM(model=str(model_dir), num_gpu_blocks=64, max_model_len=512, tensor_parallel_size=2) as llm:
        [out] = llm.chat([{"role": "user", "content": content}],
                         SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()
    processed = AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt")
    ids = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                              do_sample=False, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                              **processed)[0, ids.shape[1]:].tolist()
    assert out.outputs[0].token_ids == want
    grids = processed["image_grid_thw"].tolist()
    assert out.prompt_token_ids.count(model.config.image_token_id) == sum(t * h * w // 4 for t, h, w in grids)


def test_gemma3_chat_writes_each_image_as_its_processor_does(tmp_path):
    """Gemma 3 offline: LLM.chat's image parts, each image's sequence written as Gemma's processor
    writes it, its tokens attending to each other both ways; transformers' tokens."""
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

    from tests.tiny_model import build_tiny_gemma3_vl

    model_dir = build_tiny_gemma3_vl(tmp_path / "gemma3")
    images = [picture(8), picture(9)]
    content = [{"type": "text", "text": "Compare"}, {"type": "image_pil", "image_pil": images[0]},
               {"type": "image_pil", "image_pil": images[1]}]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    with LLM(model=str(model_dir), num_gpu_blocks=64, max_model_len=512) as llm:
        [out] = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)
        rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": [
            {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}]}], add_generation_prompt=True,
            tokenize=False)
        sequence = "\n\n<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>\n\n"
        assert out.prompt_token_ids == llm.tokenizer.encode(rendered.replace("<start_of_image>", sequence),
                                                            add_special_tokens=False)
        # Token ids are taken as they are: they must hold the image's sequence, not only its begin token.
        begin_only = llm.tokenizer.encode("Look <start_of_image>", add_special_tokens=False)
        with pytest.raises(ValueError, match="must hold each image's whole sequence"):
            llm.generate({"prompt_token_ids": begin_only, "multi_modal_data": {"image": images[0]}},
                         use_tqdm=False)
    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir).eval()
    pixels = AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt")["pixel_values"]
    ids = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                             token_type_ids=(ids == model.config.image_token_index).long(), max_new_tokens=MAX_TOKENS,
                             do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert out.outputs[0].token_ids == got.sequences[0, ids.shape[1]:].tolist()
    first = torch.log_softmax(got.scores[0][0].float(), -1)
    token = out.outputs[0].token_ids[0]
    assert abs(out.outputs[0].logprobs[0][token].logprob - float(first[token])) < 1e-4


def test_mistral3_chat_writes_each_image_as_rows_with_break_and_end_tokens(tmp_path):
    """Mistral 3 offline on two TP workers: LLM.chat's image parts, each image's [IMG] expanded as
    Pixtral's processor does (rows of image tokens, each ended by [IMG_BREAK], the last by [IMG_END],
    those two embedded as text on every worker); transformers' tokens."""
    from transformers import AutoImageProcessor, Mistral3ForConditionalGeneration

    from tests.tiny_model import build_tiny_mistral3

    model_dir = build_tiny_mistral3(tmp_path / "mistral3")
    images = [picture(10), picture(11).resize((90, 20))]  # (36x44 -> 48x48 pixels, 3x3 tokens; 20x90 -> 16x64, 1x4)
    content = [{"type": "image_pil", "image_pil": images[0]}, {"type": "text", "text": "and"},
               {"type": "image_pil", "image_pil": images[1]}]
    with LLM(model=str(model_dir), num_gpu_blocks=64, max_model_len=512, tensor_parallel_size=2) as llm:
        [out] = llm.chat([{"role": "user", "content": content}],
                         SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
        image, row_break, end = llm.tokenizer.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    runs = [([image] * 3 + [row_break]) * 2 + [image] * 3 + [end], [image] * 4 + [end]]
    ids = out.prompt_token_ids
    starts = [i for i, t in enumerate(ids) if t == image and (i == 0 or ids[i - 1] not in (image, row_break))]
    assert [ids[s:s + len(r)] for s, r in zip(starts, runs, strict=True)] == runs
    model = Mistral3ForConditionalGeneration.from_pretrained(model_dir).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    processed = processor(images=images, patch_size={"height": 16, "width": 16}, return_tensors="pt")
    tensor = torch.tensor([ids])
    with torch.no_grad():
        want = model.generate(input_ids=tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=MAX_TOKENS,
                              do_sample=False, **processed)[0, tensor.shape[1]:].tolist()
    assert out.outputs[0].token_ids == want


def test_no_image_allowed_serves_the_language_model_alone(llava):
    """limit_mm_per_prompt {"image": 0} (vLLM's text-only mode): the same text answers, images refused;
    a limit of one refuses two."""
    model_dir, llm = llava
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = llm.generate("plain text", params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(model=str(model_dir), num_gpu_blocks=64, max_model_len=256, limit_mm_per_prompt={"image": 0}) as text:
        assert text.engine_configs[0].language_model_only
        assert text.generate("plain text", params, use_tqdm=False)[0].outputs[0].token_ids == want
        with pytest.raises(ValueError, match=r"At most 0 image.*limit_mm_per_prompt"):
            text.generate({"prompt": "<image> hi", "multi_modal_data": {"image": picture(0)}}, use_tqdm=False)
    two = {"prompt": "<image> and <image>", "multi_modal_data": {"image": [picture(0), picture(1)]}}
    with LLM(model=str(model_dir), num_gpu_blocks=64, max_model_len=256, limit_mm_per_prompt={"image": 1}) as one, \
            pytest.raises(ValueError, match="At most 1 image"):
        one.generate(two, use_tqdm=False)


def test_internvl_chat_writes_each_image_between_its_begin_and_end_tokens(tmp_path):
    """InternVL offline: LLM.chat's image parts, each <IMG_CONTEXT> the template writes put between
    <img> and </img> and expanded to its tiles' tokens, as InternVLProcessor does; transformers' tokens."""
    from transformers import AutoImageProcessor, InternVLForConditionalGeneration

    from tests.tiny_model import build_tiny_internvl

    model_dir = build_tiny_internvl(tmp_path / "internvl")
    images = [picture(12), picture(13).resize((150, 40))]  # (36x44: one tile; 40x150: 4x1 tiles and a thumbnail)
    content = [{"type": "image_pil", "image_pil": images[0]}, {"type": "text", "text": "and"},
               {"type": "image_pil", "image_pil": images[1]}]
    with LLM(model=str(model_dir), num_gpu_blocks=64, max_model_len=512) as llm:
        [out] = llm.chat([{"role": "user", "content": content}],
                         SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
        begin, token, end = llm.tokenizer.convert_tokens_to_ids(["<img>", "<IMG_CONTEXT>", "</img>"])
    ids = out.prompt_token_ids
    starts = [i for i, t in enumerate(ids) if t == begin]
    assert [ids[s:s + 2 + n] for s, n in zip(starts, (4, 20), strict=True)] == [
        [begin] + [token] * 4 + [end], [begin] + [token] * 20 + [end]]
    model = InternVLForConditionalGeneration.from_pretrained(model_dir).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    pixels = processor(images=images, crop_to_patches=True, return_tensors="pt")["pixel_values"]
    tensor = torch.tensor([ids])
    with torch.no_grad():
        want = model.generate(input_ids=tensor, attention_mask=torch.ones_like(tensor), pixel_values=pixels,
                              max_new_tokens=MAX_TOKENS, do_sample=False)[0, tensor.shape[1]:].tolist()
    assert out.outputs[0].token_ids == want


def test_ministral3_with_mistrals_own_tokenizer_file_chats_with_an_image(tmp_path):
    """Ministral 3 as Mistral releases it, its tokenizer tekken.json alone: LLM.chat renders the
    template's control tokens as Mistral's ids, expands the image into rows with [IMG_BREAK] (12)
    and [IMG_END] (13), and answers with transformers' tokens, decoded without control tokens."""
    from transformers import AutoImageProcessor, Mistral3ForConditionalGeneration

    from tests.tiny_model import build_tiny_mistral3

    model_dir = build_tiny_mistral3(tmp_path / "ministral3", ministral3=True, tekken=True)
    content = [{"type": "text", "text": "Describe"}, {"type": "image_pil", "image_pil": picture(10)}]
    with LLM(model=str(model_dir), num_gpu_blocks=64, max_model_len=512) as llm:
        [out] = llm.chat([{"role": "user", "content": content}],
                         SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
        text = llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    ids = out.prompt_token_ids  # (<s>[INST]Describe, a 36x44 image as 3 rows of 3 tokens, [/INST])
    image = ids.index(10)
    assert ids[:2] == [1, 3] and ids[-1] == 4
    assert ids[image:image + 12] == [10, 10, 10, 12] * 2 + [10, 10, 10, 13]
    model = Mistral3ForConditionalGeneration.from_pretrained(model_dir).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    processed = processor(images=[picture(10)], patch_size={"height": 16, "width": 16}, return_tensors="pt")
    tensor = torch.tensor([ids])
    with torch.no_grad():
        want = model.generate(input_ids=tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=MAX_TOKENS,
                              do_sample=False, **processed)[0, tensor.shape[1]:].tolist()
    assert out.outputs[0].token_ids == want and out.outputs[0].text == text


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_qwen_vl_takes_videos_in_chat_and_in_multi_modal_data(family, tmp_path):
    """Qwen2.5-VL and Qwen3-VL offline: a video_url part in LLM.chat (an mp4 data URL: its frames
    sampled at 2 a second), and vLLM's multi_modal_data video (an array of frames, taken as sampled at
    2 a second); transformers' tokens on the same frames and timing (Qwen3-VL's: each frame pair after
    its time as text, at 0.2 and 1.2 s for the array; the video whole in one grid for transformers)."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from gpu_worker.config import ModelConfig
    from router.video import DecodedVideo, decode_video, process_video
    from tests.router.test_video import mp4, video_part
    from tests.tiny_model import build_tiny_qwen2_vl, build_tiny_qwen3_vl

    qwen3 = family == "qwen3_vl"
    model_dir = (build_tiny_qwen3_vl(tmp_path / family) if qwen3
                 else build_tiny_qwen2_vl(tmp_path / family, windowed=True))
    data = mp4(10, seed=4)
    frames = np.stack([np.asarray(picture(30 + i).resize((120, 60))) for i in range(4)])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model=str(model_dir), num_gpu_blocks=64, max_model_len=512) as llm:
        [chat] = llm.chat([{"role": "user", "content": [video_part(data), {"type": "text", "text": "What moves?"}]}],
                          params, use_tqdm=False)
        video_token = llm.tokenizer.convert_tokens_to_ids("<|video_pad|>")
        prompt = "<|vision_start|><|video_pad|><|vision_end|>What moves?"
        [given] = llm.generate({"prompt": prompt, "multi_modal_data": {"video": frames}}, params, use_tqdm=False)
        text = llm.tokenizer.decode(given.prompt_token_ids)
    if qwen3:
        assert text.startswith("<0.2 seconds><|vision_start|><|video_pad|>") and "<1.2 seconds><|vision_start|>" in text
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir)
    geometry = ModelConfig.from_pretrained(model_dir).vision.geometry
    array_video = DecodedVideo([Image.fromarray(f) for f in frames], 4, 2.0, (60, 120))
    for out, video in ((chat, decode_video(data, geometry)), (given, array_video)):
        processed = process_video(video, geometry, processor.image_mean, processor.image_std, "m")
        ids = torch.tensor([out.prompt_token_ids])
        assert out.prompt_token_ids.count(video_token) == processed.num_tokens and (qwen3 or processed.num_tokens == 16)
        height, width = processed.frame_size
        grid = ([len(processed.timestamps), height // 16, width // 16] if qwen3
                else geometry.video_patch_grid(processed.num_frames, height, width))
        timing = {} if qwen3 else {"second_per_grid_ts": torch.tensor([processed.second_per_grid])}
        with torch.no_grad():
            want = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                pixel_values_videos=processed.pixel_values.to_tensor(), video_grid_thw=torch.tensor([grid]),
                mm_token_type_ids=2 * (ids == video_token).int(), **timing)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == want
    assert given.outputs[0].token_ids != chat.outputs[0].token_ids  # (another video: another answer)
