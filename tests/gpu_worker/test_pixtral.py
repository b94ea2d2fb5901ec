"""Mistral 3 (Mistral3ForConditionalGeneration) and Pixtral-12B (LlavaForConditionalGeneration over a
Pixtral tower): our engine's prompt logprobs and greedy tokens equal transformers' on tiny random
checkpoints, with images of several sizes whose prompt runs are rows of image tokens ended by break
and end tokens, whole and chunked (inside an image's rows), beside a text request, through the prefix
cache; the geometry against Pixtral's processor; the released configs; refusals."""

from __future__ import annotations

import json

import pytest
import torch

from engine_core.engine_core import RequestRefusedError
from engine_core.multimodal import MultiModalFeature, TensorData, feature_identifier
from engine_core.outputs import EngineCoreRequest
from engine_core.sampling_params import SamplingParams
from gpu_worker.config import ModelConfig
from tests.gpu_worker.test_llava import make_engine, picture
from tests.gpu_worker.test_qwen2_vl import assert_equal, hf_logprobs_and_tokens, run
from tests.tiny_model import build_tiny_mistral3

# Mistral Small 3.1's config.json (mistralai/Mistral-Small-3.1-24B-Instruct-2503), as released.
MISTRAL_SMALL_3_1 = {
    "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "text_config": {"head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
                    "max_position_embeddings": 131072, "model_type": "mistral", "num_attention_heads": 32,
                    "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                    "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 131072},
    "torch_dtype": "bfloat16",
    "vision_config": {"head_dim": 64, "hidden_act": "silu", "hidden_size": 1024, "image_size": 1540,
                      "intermediate_size": 4096, "model_type": "pixtral", "num_attention_heads": 16,
                      "num_channels": 3, "num_hidden_layers": 24, "patch_size": 14, "rope_theta": 10000.0},
    "vision_feature_layer": -1}


@pytest.fixture(scope="module", params=["mistral3", "pixtral", "ministral3"])
def pixtral(request, tmp_path_factory):
    """(model dir, transformers' model, its image processor as the model's processor runs it)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model_dir = build_tiny_mistral3(tmp_path_factory.mktemp(request.param), llava=request.param == "pixtral",
                                    ministral3=request.param == "ministral3")
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    side = 8 if request.param == "pixtral" else 16  # (Mistral 3's processor: the merged 2x2 patches' side)
    processor.patch_size = {"height": side, "width": side}
    return model_dir, AutoModelForImageTextToText.from_pretrained(model_dir).eval(), processor


def _tokens(model_dir) -> dict[str, int]:
    vocabulary = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    return {t["content"]: t["id"] for t in vocabulary}


def prompt(pixtral, text_ids: list[list[int]], images: list):
    """Text pieces with an image between each two (as rows of [IMG], each ended by [IMG_BREAK], the last
    by [IMG_END], the way transformers' processor writes them): token ids, features, and transformers'
    inputs (its padded pixel values and each image's resized size)."""
    model_dir, _, processor = pixtral
    tokens = _tokens(model_dir)
    inputs = processor(images=images, return_tensors="pt") if images else None
    side = processor.patch_size["height"]
    ids: list[int] = [1]
    features = []
    for i, piece in enumerate(text_ids):
        ids += piece
        if i < len(images):
            height, width = (int(v) for v in inputs["image_sizes"][i])
            data = TensorData.from_array(inputs["pixel_values"][i, :, :height, :width])
            rows, columns = height // side, width // side
            run_ids = ([tokens["[IMG]"]] * columns + [tokens["[IMG_BREAK]"]]) * rows
            run_ids[-1] = tokens["[IMG_END]"]
            size = (images[i].height, images[i].width)
            features.append(MultiModalFeature("image", feature_identifier("image", data), len(ids), len(run_ids),
                                              data, size))
            ids += run_ids
    return ids, features, inputs


def reference(pixtral, ids: list[int], inputs) -> tuple[list[float], list[int]]:
    """transformers' logprob of each prompt token after the first, and its greedy tokens."""
    kwargs = {} if inputs is None else {"pixel_values": inputs["pixel_values"], "image_sizes": inputs["image_sizes"]}
    return hf_logprobs_and_tokens(pixtral[1], ids, **kwargs)


def test_images_of_three_shapes_equal_transformers_whole_and_in_chunks(pixtral):
    model_dir = pixtral[0]
    # 40x50 -> 48x64 pixels; 90x60 shrunk to 64x42 -> 64x48; 20x100 shrunk to 12x64 -> 16x64.
    ids, features, inputs = prompt(pixtral, [[74, 75], [223, 263, 84], [71], [90]],
                                   [picture(0), picture(1, (90, 60)), picture(2, (20, 100))])
    want = reference(pixtral, ids, inputs)
    assert_equal(run(make_engine(model_dir), {"a": (ids, features)})["a"], want)
    # 7-token passes: each image's rows (and their break tokens) run over several chunks.
    assert_equal(run(make_engine(model_dir, max_num_batched_tokens=7), {"a": (ids, features)})["a"], want)


def test_an_image_prompt_beside_a_text_prompt_and_through_the_prefix_cache(pixtral):
    model_dir = pixtral[0]
    image_ids, image_features, inputs = prompt(pixtral, [[90, 91, 94, 95, 96], [92, 93, 97, 98, 99, 100, 101, 102]],
                                              [picture(3, (70, 30))])
    text_ids = [1, 5, 9, 11, 200, 31]
    want = {"image": reference(pixtral, image_ids, inputs), "text": reference(pixtral, text_ids, None)}
    engine = make_engine(model_dir, max_num_batched_tokens=32, block_size=16)
    got = run(engine, {"image": (image_ids, image_features), "text": (text_ids, [])})
    for req_id in want:
        assert_equal(got[req_id], want[req_id])
    # (A request asking for prompt logprobs reads no cached blocks: these two ask for tokens only.)
    cached: dict[str, int] = {}
    assert run(engine, {"first": (image_ids, image_features)}, cached)["first"][1] == want["image"][1]
    assert run(engine, {"again": (image_ids, image_features)}, cached)["again"][1] == want["image"][1]
    assert cached["again"] == 16 * ((len(image_ids) - 1) // 16) > image_features[0].offset


def test_the_geometry_is_the_processors(pixtral):
    """Each image's placeholders and pixel-value shape, from its size alone, as Pixtral's processor
    resizes it (shrunk to fit the longest edge, sides rounded up to whole tokens)."""
    model_dir, _, processor = pixtral
    geometry = ModelConfig.from_pretrained(model_dir).vision.geometry
    side = processor.patch_size["height"]
    for height, width in ((1, 1), (15, 17), (64, 64), (65, 64), (200, 7), (7, 200), (33, 95), (1000, 999)):
        processed = processor(images=[picture(0, (height, width))], return_tensors="np")["pixel_values"][0]
        assert geometry.input_shape(height, width) == processed.shape
        rows, columns = processed.shape[1] // side, processed.shape[2] // side
        assert geometry.num_tokens(height, width) == rows * (columns + 1) <= geometry.max_tokens
    assert geometry.min_tokens == 2 and geometry.max_tokens == geometry.num_tokens(*geometry.largest_image)


def test_the_engine_refuses_a_run_that_is_not_the_images_rows(pixtral):
    model_dir = pixtral[0]
    ids, features, _ = prompt(pixtral, [[74], [75]], [picture(4)])
    tokens = _tokens(model_dir)
    engine = make_engine(model_dir)
    flat = [tokens["[IMG]"] if t in (tokens["[IMG_BREAK]"], tokens["[IMG_END]"]) else t for t in ids]
    with pytest.raises(RequestRefusedError, match="break token"):
        engine.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=flat, sampling_params=SamplingParams(),
                                             mm_features=features))


def test_the_config_of_mistral_small_3_1_reads_its_vision_side():
    config = ModelConfig.from_dict(MISTRAL_SMALL_3_1)
    vision = config.vision
    assert config.architecture == "MistralForCausalLM" and config.hidden_size == 5120
    assert (vision.patch_size, vision.spatial_merge_size, vision.longest_edge, vision.num_layers_used) == (14, 2, 1540,
                                                                                                            24)
    assert vision.patch_merger and not vision.projector_bias and vision.hidden_act == "silu"
    assert (vision.image_token_id, vision.image_break_token_id, vision.image_end_token_id) == (10, 12, 13)
    geometry = vision.geometry
    # (1540 pixels: 55 tokens of 28 a side, each row one more for its break or end token)
    assert geometry.max_tokens == 55 * 56 and geometry.num_tokens(28, 56) == 3
    assert geometry.input_shape(1000, 500) == (3, 1008, 504)
    with pytest.raises(ValueError, match="Pixtral's"):
        ModelConfig.from_dict({**MISTRAL_SMALL_3_1, "vision_config": {"model_type": "clip_vision_model"}})


def test_a_head_stored_beside_a_tied_config_is_not_tied(pixtral, tmp_path):
    """transformers 5 re-saves a Mistral 3 checkpoint with Mistral3Config's default (tied) at its
    top level, and keeps the head the checkpoint stores: so do we, with transformers' answers."""
    import shutil

    model_dir = tmp_path / "retied"
    shutil.copytree(pixtral[0], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    assert not ModelConfig.from_pretrained(model_dir).tie_word_embeddings
    ids = [1, 5, 9, 11, 200, 31]
    assert_equal(run(make_engine(model_dir), {"t": (ids, [])})["t"], reference(pixtral, ids, None))
    # A head equal to the embedding (a tied checkpoint that stores it anyway) stays tied, and so does
    # one --hf-overrides ties.
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    tensors["language_model.lm_head.weight"] = tensors["language_model.model.embed_tokens.weight"].clone()
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    assert ModelConfig.from_pretrained(model_dir).tie_word_embeddings
    assert ModelConfig.from_pretrained(pixtral[0], hf_overrides={"tie_word_embeddings": True}).tie_word_embeddings


def test_the_processor_config_in_either_file_and_patch_size_as_a_number(pixtral, tmp_path):
    """An image processor config nested in processor_config.json (as transformers 5 saves it) is
    read as preprocessor_config.json is; a patch_size given as one number is served."""
    import shutil

    from engine_core.tokenizer_files import IMAGE_PROCESSOR_FILE, PROCESSOR_FILE
    from router.multimodal import MultiModalProcessor, load_image_processor

    model_dir = tmp_path / "nested"
    shutil.copytree(pixtral[0], model_dir)
    processor = json.loads((model_dir / IMAGE_PROCESSOR_FILE).read_text())
    (model_dir / IMAGE_PROCESSOR_FILE).unlink()
    (model_dir / PROCESSOR_FILE).write_text(json.dumps({"image_processor": {
        **processor, "patch_size": 8, "size": {"longest_edge": 48}}}))
    config = ModelConfig.from_pretrained(model_dir)
    geometry = config.vision.geometry
    assert config.vision.longest_edge == 48 and geometry.num_tokens(64, 64) == geometry.max_tokens
    images = MultiModalProcessor(config.vision.image_token_id, geometry, load_image_processor(model_dir),
                                 str(model_dir), "[IMG]")
    image = picture(5, (70, 30))
    processed = images.process_image(image)
    assert processed.pixel_values.shape == geometry.input_shape(70, 30)
    assert processed.num_tokens == geometry.num_tokens(70, 30)


def test_the_router_gets_the_models_image_processor_whatever_the_tokenizer_directory_holds(pixtral, tmp_path):
    """--tokenizer DIR: the tokenizer's files are that directory's, the image processor's the model's
    (as the engines read it), even where that directory has a processor config of its own."""
    import shutil

    from engine_core.tokenizer_files import PROCESSOR_FILE, read_image_processor_config, read_tokenizer_files

    tokenizer_dir = tmp_path / "tokenizer"
    shutil.copytree(pixtral[0], tokenizer_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    (tokenizer_dir / PROCESSOR_FILE).write_text(json.dumps({"image_processor": {"size": {"longest_edge": 32}}}))
    files = read_tokenizer_files(str(pixtral[0]), str(tokenizer_dir))
    assert PROCESSOR_FILE not in files and "tokenizer.json" in files
    replica = tmp_path / "replica"
    replica.mkdir()
    for name, data in files.items():
        (replica / name).write_bytes(data)
    assert read_image_processor_config(replica) == read_image_processor_config(pixtral[0])


def test_ministral3_in_fp8_answers_as_its_dequantized_weights_do(pixtral, tmp_path):
    """Ministral 3 Instruct's release layout: the language model's projections in fp8 with one scale
    each and static activation scales, the tower unquantized; served dequantized, it answers as
    transformers does on the same weights dequantized."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    from tests.gpu_worker.test_quantized_checkpoints import _quantized

    model_dir = pixtral[0]
    if json.loads((model_dir / "config.json").read_text())["text_config"]["model_type"] != "ministral3":
        pytest.skip("Ministral 3's release layout")
    fp8_dir, plain_dir = tmp_path / "fp8", tmp_path / "dequantized"
    for directory in (fp8_dir, plain_dir):
        shutil.copytree(model_dir, directory)
    tensors = load_file(model_dir / "model.safetensors")
    fp8, plain = {}, {}
    for name, tensor in tensors.items():
        if "language_model." in name and name.endswith("_proj.weight"):
            values, scale = _quantized(tensor, tuple(tensor.shape))
            fp8 |= {name: values, name + "_scale_inv": scale.reshape(()),
                    name.removesuffix("weight") + "activation_scale": torch.tensor(0.02)}
            plain[name] = values.float() * scale.reshape(())
        else:
            fp8[name] = plain[name] = tensor
    save_file(fp8, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, plain_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None,
                                     "modules_to_not_convert": ["model.vision_tower", "model.multi_modal_projector",
                                                                "lm_head"]}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_pretrained(fp8_dir).fp8_weight_block == (0, 0)
    ids, features, inputs = prompt(pixtral, [[74, 75], [223, 263, 84, 90, 91, 92]], [picture(1, (90, 60))])
    hf = AutoModelForImageTextToText.from_pretrained(plain_dir).eval()
    want = hf_logprobs_and_tokens(hf, ids, pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"])
    assert_equal(run(make_engine(fp8_dir), {"a": (ids, features)})["a"], want)


def test_the_config_of_ministral_3_8b_reads_its_language_model():
    """transformers' Ministral3Config defaults (which are Ministral 3 8B's) under Mistral 3's config: a
    262,144-position YaRN decoder whose queries are scaled past its pretrained 16,384 positions."""
    from transformers import Ministral3Config, Mistral3Config

    released = {**Mistral3Config(text_config=Ministral3Config().to_dict()).to_dict(),
                "architectures": ["Mistral3ForConditionalGeneration"]}
    config = ModelConfig.from_dict(released)
    assert config.architecture == "Ministral3ForCausalLM" and config.num_hidden_layers == 34
    assert config.llama_4_scaling == (0.1, 16384) and config.max_context_len == 262144
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_scaling["factor"] == 16.0
    assert config.vision.spatial_merge_size == 2 and config.vision.longest_edge == 1540
    # (Other models' configs scale no queries, whatever their rope parameters hold.)
    mistral = {**released, "text_config": {**released["text_config"], "model_type": "mistral"}}
    assert ModelConfig.from_dict(mistral).llama_4_scaling is None
    text_only = {"architectures": ["Ministral3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                 "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "llama_4_scaling_beta": 0.1}}
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        ModelConfig.from_dict(text_only)
    text_only["rope_parameters"]["original_max_position_embeddings"] = 8
    assert ModelConfig.from_dict(text_only).llama_4_scaling == (0.1, 8)
    # (A config that gives no rope parameters has transformers' defaults: Ministral 3's YaRN and scale.)
    bare = ModelConfig.from_dict({k: v for k, v in text_only.items() if k != "rope_parameters"})
    assert bare.llama_4_scaling == (0.1, 16384) and bare.max_context_len == 262144
