"""Images in chat through the whole stack: the openai client sends image parts to the router on Ray
Serve, engines on Ray (one of them two tensor-parallel workers) encode them; the answers equal
transformers' LlavaForConditionalGeneration, streamed or not, and prefix-aware routing sends a
repeated image to the engine that holds it."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import torch

from cluster.config import ClusterConfig, EngineSpec, ServedModel
from tests.serve_cluster import serve_cluster
from tests.tiny_model import (
    build_tiny_idefics3,
    build_tiny_llava,
    build_tiny_llava_next,
    build_tiny_mistral3,
    build_tiny_qwen2_vl,
    build_tiny_qwen3_vl,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def picture(seed: int, size: tuple[int, int] = (40, 50)):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8"))


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def messages(text: str, *images) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava"))


def hf_text(model_dir, text: str, *images) -> str:
    """transformers' greedy answer to the same chat: the template rendered with image parts, each
    image token expanded to its image's placeholders (as LlavaProcessor / LlavaNextProcessor do)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from gpu_worker.config import ModelConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    geometry = ModelConfig.from_pretrained(model_dir).vision.geometry
    image_token = model.config.image_token_id
    runs = iter([geometry.placeholder_ids(image_token, image.height, image.width) for image in images])
    chat = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids: list[int] = []
    for token in tokenizer.encode(rendered, add_special_tokens=False):
        ids += next(runs) if token == image_token else [token]
    processor = AutoImageProcessor.from_pretrained(model_dir)
    if geometry.pixtral:  # (Mistral 3's processor passes its merged token side as the patch size)
        side = geometry.patch_size * geometry.spatial_merge
        processor.patch_size = {"height": side, "width": side}
    processed = processor(images=list(images), return_tensors="pt")
    if "image_grid_thw" in processed:  # (Qwen2-VL: transformers places the M-RoPE positions by token type)
        processed["mm_token_type_ids"] = (torch.tensor([ids]) == model.config.image_token_id).int()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long), **processed)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    return build_tiny_llava_next(tmp_path_factory.mktemp("llava-next"))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl"), windowed=True)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3-vl"))


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory):
    return build_tiny_idefics3(tmp_path_factory.mktemp("smolvlm"))


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return build_tiny_mistral3(tmp_path_factory.mktemp("mistral3"))


@pytest.fixture(scope="module")
def cluster(ray_cluster, llava_dir, next_dir, qwen_dir, qwen3_dir, smolvlm_dir, mistral_dir):
    # LLaVA on two engines (one of two TP workers), and LLaVA-NeXT, Qwen2.5-VL, Qwen3-VL, SmolVLM
    # (Idefics3) and Mistral 3 beside it behind the same endpoint.
    config = ClusterConfig(
        model=str(llava_dir), served_model_name="llava", num_engines=2, routing_policy="prefix_aware",
        defaults=EngineSpec(num_gpu_blocks=128, max_model_len=512, block_size=4, max_num_batched_tokens=24),
        engines=[EngineSpec(num_cpus_per_worker=0.5), EngineSpec(tensor_parallel_size=2, num_cpus_per_worker=0.5)],
        models=[ServedModel(model=str(next_dir), served_model_name="llava-next",
                            defaults=EngineSpec(num_cpus_per_worker=0.5)),
                # (half a CPU each: the test cluster's four CPUs hold all seven engines)
                ServedModel(model=str(qwen_dir), served_model_name="qwen2.5-vl",
                            defaults=EngineSpec(num_cpus_per_worker=0.5)),
                ServedModel(model=str(qwen3_dir), served_model_name="qwen3-vl",
                            defaults=EngineSpec(num_cpus_per_worker=0.5)),
                ServedModel(model=str(smolvlm_dir), served_model_name="smolvlm",
                            defaults=EngineSpec(num_cpus_per_worker=0.5)),
                ServedModel(model=str(mistral_dir), served_model_name="mistral3",
                            defaults=EngineSpec(num_cpus_per_worker=0.5))])
    with serve_cluster(config) as served:
        yield served


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.base}/v1", api_key="unused", max_retries=0, timeout=60)


def ask(client, chat: list[dict], stream: bool = False, model: str = "llava") -> str:
    kwargs = dict(model=model, messages=chat, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def assert_answers_as_transformers(client, chat: list[dict], name: str, model, tokenizer, ids: torch.Tensor,
                                   **inputs) -> None:
    """The served model ``name``'s answer to ``chat``, streamed or not, is transformers' ``model``'s
    greedy answer to the prompt ``ids`` ([1, tokens]) with ``inputs`` (its images or videos)."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             do_sample=False, **inputs)
    want = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    for stream in (False, True):
        assert ask(client, chat, stream, model=name) == want


def test_chat_with_images_equals_transformers_on_either_engine(client, cluster, llava_dir):
    one, two = picture(0), picture(1, (64, 32))
    want_one = hf_text(llava_dir, "What is this?", one)
    want_two = hf_text(llava_dir, "Compare them.", one, two)
    assert want_one != hf_text(llava_dir, "What is this?", two)  # (the image matters to the answer)
    for stream in (False, True):
        assert ask(client, messages("What is this?", one), stream) == want_one
        assert ask(client, messages("Compare them.", one, two), stream) == want_two
    # Four at once: least loaded (their images share no block) spreads them over both engines, one
    # of them two TP workers; the same answers.
    seeds = (5, 6, 7, 8)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda seed: ask(client, messages("What is this?", picture(seed))), seeds))
    assert answers == [hf_text(llava_dir, "What is this?", picture(seed)) for seed in seeds]
    assert all(s.num_requests_finished >= 1 for s in cluster.stats()[:2])


def test_a_repeated_image_goes_where_its_blocks_are_and_hits_them(client, cluster, llava_dir):
    image = picture(11)
    first = ask(client, messages("Describe the picture in a few words.", image))
    hits_before = [s.prefix_cache_hits for s in cluster.stats()[:2]]  # (the LLaVA engines)
    again = ask(client, messages("Describe the picture in a few words.", image))
    hits_after = [s.prefix_cache_hits for s in cluster.stats()[:2]]
    assert first == again == hf_text(llava_dir, "Describe the picture in a few words.", image)
    gained = [after - before for before, after in zip(hits_before, hits_after, strict=True)]
    # One engine found the whole prompt but its last block's tokens (the image's placeholders among them).
    assert sorted(gained)[0] == 0 and sorted(gained)[1] >= 16


def test_llava_next_beside_it_counts_each_image_by_its_size(client, next_dir):
    wide, tall = picture(21, (20, 90)), picture(22, (90, 20))
    for stream in (False, True):
        assert ask(client, messages("Compare them.", wide, tall), stream, model="llava-next") == hf_text(
            next_dir, "Compare them.", wide, tall)


def test_qwen2_5_vl_beside_it_places_each_image_by_its_grid(client, qwen_dir):
    """Qwen2.5-VL: each image's placeholders by its resized grid, its tokens' M-RoPE positions by
    their place in it; transformers' answers, streamed or not."""
    wide, tall = picture(23, (30, 90)), picture(24, (90, 30))
    want = hf_text(qwen_dir, "Compare them.", wide, tall)
    assert want != hf_text(qwen_dir, "Compare them.", tall, wide)  # (the images' order matters)
    for stream in (False, True):
        assert ask(client, messages("Compare them.", wide, tall), stream, model="qwen2.5-vl") == want


def transformers_side_of_a_video(model_dir, data: bytes):
    """A Qwen-VL model's tokenizer, transformers' model, image processor and image geometry, and the
    video ``data`` as the router makes it (its frames decoded, sampled and cut into patches)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from gpu_worker.config import ModelConfig
    from router.video import decode_video, process_video

    processor = AutoImageProcessor.from_pretrained(model_dir)
    geometry = ModelConfig.from_pretrained(model_dir).vision.geometry
    video = process_video(decode_video(data, geometry), geometry, processor.image_mean, processor.image_std, "qwen")
    return (AutoTokenizer.from_pretrained(model_dir), AutoModelForImageTextToText.from_pretrained(model_dir).eval(),
            processor, geometry, video)


def test_qwen2_5_vl_takes_a_video_beside_an_image(client, qwen_dir):
    """A video_url part (vLLM's): its frames sampled, paired and encoded, its placeholders timed by
    M-RoPE; transformers' answer on the same frames, streamed or not."""

    from tests.router.test_video import mp4, video_part

    data, image = mp4(10, seed=3), picture(25, (40, 70))
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                         {"type": "text", "text": "then"}, video_part(data),
                                         {"type": "text", "text": "What moves?"}]}]
    tokenizer, model, processor, geometry, video = transformers_side_of_a_video(qwen_dir, data)
    config = model.config
    parts = [{"type": "image"}, {"type": "text", "text": "then"}, {"type": "video"},
             {"type": "text", "text": "What moves?"}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                             tokenize=False)
    ids: list[int] = []
    for token in tokenizer.encode(rendered, add_special_tokens=False):
        ids += ([token] * geometry.num_tokens(image.height, image.width) if token == config.image_token_id
                else [token] * video.num_tokens if token == config.video_token_id else [token])
    kinds = torch.tensor([ids])
    inputs = {**processor(images=[image], return_tensors="pt"),
              "pixel_values_videos": video.pixel_values.to_tensor(),
              "video_grid_thw": torch.tensor([geometry.video_patch_grid(video.num_frames, *video.frame_size)]),
              "second_per_grid_ts": torch.tensor([video.second_per_grid]),
              "mm_token_type_ids": (kinds == config.image_token_id).int() + 2 * (kinds == config.video_token_id).int()}
    assert_answers_as_transformers(client, chat, "qwen2.5-vl", model, tokenizer, kinds, **inputs)


def test_qwen3_vl_takes_a_video_as_its_timed_frame_pairs(client, qwen3_dir):
    """Qwen3-VL: a video_url part becomes its frame pairs, each after its time as text ("<0.2
    seconds>"), as its processor writes them; transformers' answer for that prompt, the video whole in
    one grid, streamed or not."""

    from router.multimodal import TimedVideoTokens
    from tests.router.test_video import mp4, video_part

    data = mp4(10, seed=5)
    chat = [{"role": "user", "content": [video_part(data), {"type": "text", "text": "What moves?"}]}]
    tokenizer, model, _, _, video = transformers_side_of_a_video(qwen3_dir, data)
    config = model.config
    timed = TimedVideoTokens(tokenizer, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {
        "type": "text", "text": "What moves?"}]}], add_generation_prompt=True, tokenize=False)
    before, after = rendered.split("<|vision_start|><|video_pad|><|vision_end|>")
    ids = (tokenizer.encode(before, add_special_tokens=False) + timed.run(video)[0]
           + tokenizer.encode(after, add_special_tokens=False))
    assert "<0.2 seconds><|vision_start|>" in tokenizer.decode(ids)
    kinds = torch.tensor([ids])
    height, width = video.frame_size
    inputs = {"pixel_values_videos": video.pixel_values.to_tensor(),
              "video_grid_thw": torch.tensor([[len(video.timestamps), height // 16, width // 16]]),
              "mm_token_type_ids": 2 * (kinds == config.video_token_id).int()}
    assert_answers_as_transformers(client, chat, "qwen3-vl", model, tokenizer, kinds, **inputs)


def test_smolvlm_takes_each_image_as_its_tiles(client, smolvlm_dir):
    """SmolVLM (Idefics3): each image cut into tiles, each tile's row and column written before it,
    the whole image last, as its processor writes them; transformers' answer, streamed or not."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Idefics3Processor

    from router.multimodal import load_image_processor

    wide, square = picture(26, (40, 120)), picture(27, (80, 80))
    tokenizer = AutoTokenizer.from_pretrained(smolvlm_dir)
    processor = Idefics3Processor(load_image_processor(smolvlm_dir), tokenizer, image_seq_len=4)
    parts = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare them."}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)
    inputs = dict(processor(text=[text], images=[[wide, square]], return_tensors="pt"))
    model = AutoModelForImageTextToText.from_pretrained(smolvlm_dir).eval()
    ids = inputs.pop("input_ids")
    del inputs["attention_mask"]
    assert_answers_as_transformers(client, messages("Compare them.", wide, square), "smolvlm", model, tokenizer, ids,
                                   **inputs)


def test_mistral3_beside_it_writes_each_image_as_rows(client, mistral_dir):
    """Mistral 3: each image's [IMG] becomes its rows of image tokens with their break and end tokens
    (counted in the prompt's usage); transformers' answers, streamed or not."""
    wide, tall = picture(25, (30, 90)), picture(26, (90, 30))
    want = hf_text(mistral_dir, "Compare them.", wide, tall)
    assert want != hf_text(mistral_dir, "Compare them.", tall, wide)  # (the images' order matters)
    for stream in (False, True):
        assert ask(client, messages("Compare them.", wide, tall), stream, model="mistral3") == want
    usage = client.chat.completions.create(model="mistral3", messages=messages("Compare them.", wide, tall),
                                           max_tokens=1).usage
    # (30x90 shrunk to fit 64 pixels: 21x64, 2 rows of 4 tokens, each with its break or end token;
    # 90x30: 4 rows of 2)
    text_only = client.chat.completions.create(model="mistral3", messages=messages("Compare them."), max_tokens=1)
    assert usage.prompt_tokens - text_only.usage.prompt_tokens == 2 * 5 + 4 * 3


def test_bench_serve_loads_it_with_random_images(cluster, tmp_path, capsys):
    """vLLM's random-mm dataset: random chat prompts, each with one to three random-noise images of
    the bucket shapes; every request answered, the placeholders counted in its prompt tokens."""
    import json

    from cluster.cli import main

    assert main(["bench", "serve", "--base-url", cluster.base, "--backend", "openai-chat", "--model", "llava",
                 "--dataset-name", "random-mm", "--num-prompts", "4", "--random-input-len", "8",
                 "--random-output-len", "4", "--ignore-eos", "--random-mm-base-items-per-request", "2",
                 "--random-mm-num-mm-items-range-ratio", "0.5", "--random-mm-bucket-config",
                 "{(40, 50, 1): 0.5, (64, 32, 1): 0.5, (64, 64, 16): 0.0}", "--save-result", "--result-dir",
                 str(tmp_path), "--result-filename", "r.json"]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (4, 0, 16)
    assert result["total_input_tokens"] >= 4 * (8 + 16)  # (each prompt at least one 16-token image)
    assert main(["bench", "serve", "--base-url", cluster.base, "--dataset-name", "random-mm"]) == 2
    assert "random-mm loads /v1/chat/completions" in capsys.readouterr().out


def test_errors(client):
    with pytest.raises(openai.BadRequestError, match="image"):
        client.chat.completions.create(model="llava", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]}])
    with pytest.raises(openai.BadRequestError, match=r"file://|allowed-local-media-path"):
        client.chat.completions.create(model="llava", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}])
