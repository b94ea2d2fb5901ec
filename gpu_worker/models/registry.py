"""HF ``architectures[0]`` -> our model class."""

from __future__ import annotations

from torch import nn

from gpu_worker import distributed
from gpu_worker.bitnet_checkpoint import check_bitnet_model, quantize_linear_inputs
from gpu_worker.config import ModelConfig
from gpu_worker.models.afmoe import AfmoeForCausalLM
from gpu_worker.models.apertus import ApertusForCausalLM
from gpu_worker.models.arcee import ArceeForCausalLM
from gpu_worker.models.bailing_hybrid import BailingHybridForCausalLM
from gpu_worker.models.beam import BeamForCausalLM
from gpu_worker.models.bert import BertModel, RobertaModel
from gpu_worker.models.bert_rope import JinaEmbeddingsV3Model, RopeBertModel
from gpu_worker.models.bitnet import BitNetForCausalLM
from gpu_worker.models.bloom import BloomForCausalLM
from gpu_worker.models.classic import (
    GPTNeoXForCausalLM,
    Jais2ForCausalLM,
    NemotronForCausalLM,
    PersimmonForCausalLM,
    PhiForCausalLM,
    StableLmForCausalLM,
    Starcoder2ForCausalLM,
)
from gpu_worker.models.cohere import Cohere2ForCausalLM, Cohere2MoeForCausalLM, CohereForCausalLM
from gpu_worker.models.dbrx import DbrxForCausalLM
from gpu_worker.models.deepseek import (
    AXK1ForCausalLM,
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    Glm4MoeLiteForCausalLM,
    MiniCPM3ForCausalLM,
    YoutuForCausalLM,
)
from gpu_worker.models.deepseek_v32 import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
from gpu_worker.models.eagle import EAGLE_HEADS
from gpu_worker.models.exaone import ExaoneForCausalLM
from gpu_worker.models.falcon import FalconForCausalLM
from gpu_worker.models.falcon_h1 import FalconH1ForCausalLM
from gpu_worker.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM, VaultGemmaForCausalLM
from gpu_worker.models.gemma3_vl import Gemma3VLForConditionalGeneration
from gpu_worker.models.gemma3n import Gemma3nForCausalLM
from gpu_worker.models.gemma4 import Gemma4ForCausalLM
from gpu_worker.models.glm4 import Glm4ForCausalLM, GlmForCausalLM, Kolibri1ForCausalLM
from gpu_worker.models.gpt2 import (
    CodeGenForCausalLM,
    GPT2LMHeadModel,
    GPTBigCodeForCausalLM,
    GPTJForCausalLM,
    GPTNeoForCausalLM,
)
from gpu_worker.models.gpt_oss import GptOssForCausalLM
from gpu_worker.models.hyperclovax import HyperCLOVAXForCausalLM
from gpu_worker.models.idefics3 import Idefics3ForConditionalGeneration
from gpu_worker.models.internlm import InternLM2ForCausalLM, InternLM3ForCausalLM
from gpu_worker.models.internvl import internvl_class
from gpu_worker.models.jamba import JambaForCausalLM
from gpu_worker.models.jetmoe import JetMoeForCausalLM
from gpu_worker.models.kimi_linear import KimiLinearForCausalLM
from gpu_worker.models.laguna import LagunaForCausalLM, MellumForCausalLM
from gpu_worker.models.language_model_only import language_model_class
from gpu_worker.models.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM, Lfm3ForCausalLM
from gpu_worker.models.llama import (
    BambaForCausalLM,
    CwmForCausalLM,
    Dots1ForCausalLM,
    FlintForCausalLM,
    Glm4MoeForCausalLM,
    GraniteForCausalLM,
    GraniteMoeForCausalLM,
    GraniteMoeHybridForCausalLM,
    GraniteMoeSharedForCausalLM,
    GraniteMoeSWAForCausalLM,
    GraniteSWAForCausalLM,
    HunYuanDenseV1ForCausalLM,
    HunYuanMoEV1ForCausalLM,
    HYV3ForCausalLM,
    LlamaForCausalLM,
    MiniCPMForCausalLM,
    Ministral3ForCausalLM,
    MinistralForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    Phi3ForCausalLM,
    PhimoeForCausalLM,
    Qwen2ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    SeedOssForCausalLM,
    SmolLM3ForCausalLM,
    SolarOpenForCausalLM,
)
from gpu_worker.models.llama4 import Llama4ForCausalLM
from gpu_worker.models.llava import llava_class
from gpu_worker.models.longcat_flash import LongcatFlashForCausalLM
from gpu_worker.models.mimo_v2_flash import MiMoV2FlashForCausalLM
from gpu_worker.models.minicpm5_moe import MiniCPM5MoeForCausalLM
from gpu_worker.models.minimax import MiniMaxForCausalLM
from gpu_worker.models.minimax_m2 import MiniMaxM2ForCausalLM
from gpu_worker.models.modernbert import ModernBertModel
from gpu_worker.models.modernbert_decoder import ModernBertDecoderForCausalLM
from gpu_worker.models.mpt import MPTForCausalLM, MptForCausalLM
from gpu_worker.models.mtp import MTP_DRAFTERS
from gpu_worker.models.nanochat import NanoChatForCausalLM
from gpu_worker.models.nemotron_h import (
    FalconMambaForCausalLM,
    Mamba2ForCausalLM,
    MambaForCausalLM,
    NemotronHForCausalLM,
)
from gpu_worker.models.olmo2 import (
    Exaone4ForCausalLM,
    ExaoneMoeForCausalLM,
    FlexOlmoForCausalLM,
    Olmo2ForCausalLM,
    Olmo3ForCausalLM,
    OlmoeForCausalLM,
    OlmoForCausalLM,
)
from gpu_worker.models.olmo_hybrid import OlmoHybridForCausalLM
from gpu_worker.models.opt import BioGptForCausalLM, OPTForCausalLM, XGLMForCausalLM
from gpu_worker.models.paired_rope import Ernie4_5_MoeForCausalLM, Ernie4_5ForCausalLM, HeliumForCausalLM
from gpu_worker.models.pixtral import pixtral_class
from gpu_worker.models.qwen2_vl import Qwen2VLForConditionalGeneration
from gpu_worker.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from gpu_worker.models.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration
from gpu_worker.models.zamba2 import Zamba2ForCausalLM
from gpu_worker.vision_config import (
    Gemma3VisionConfig,
    Idefics3VisionConfig,
    InternVLVisionConfig,
    PixtralVisionConfig,
    Qwen3VisionConfig,
    QwenVisionConfig,
)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Ministral3ForCausalLM": Ministral3ForCausalLM,
    "MinistralForCausalLM": MinistralForCausalLM,
    "CwmForCausalLM": CwmForCausalLM,
    "PersimmonForCausalLM": PersimmonForCausalLM,
    "HunYuanDenseV1ForCausalLM": HunYuanDenseV1ForCausalLM,
    "DbrxForCausalLM": DbrxForCausalLM,
    "VaultGemmaForCausalLM": VaultGemmaForCausalLM,
    "HunYuanMoEV1ForCausalLM": HunYuanMoEV1ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "MiniCPMForCausalLM": MiniCPMForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,
    "MiniCPM3ForCausalLM": MiniCPM3ForCausalLM,
    "Glm4MoeLiteForCausalLM": Glm4MoeLiteForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "GraniteMoeSharedForCausalLM": GraniteMoeSharedForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2MoeForCausalLM,
    "FalconH1ForCausalLM": FalconH1ForCausalLM,
    "MambaForCausalLM": MambaForCausalLM,
    "FalconMambaForCausalLM": FalconMambaForCausalLM,
    "JambaForCausalLM": JambaForCausalLM,
    "Zamba2ForCausalLM": Zamba2ForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": Cohere2ForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "SeedOssForCausalLM": SeedOssForCausalLM,
    "HeliumForCausalLM": HeliumForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
    "ArceeForCausalLM": ArceeForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "ExaoneMoeForCausalLM": ExaoneMoeForCausalLM,
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
    "StableLmForCausalLM": StableLmForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "NemotronForCausalLM": NemotronForCausalLM,
    "OlmoForCausalLM": OlmoForCausalLM,
    "PhiForCausalLM": PhiForCausalLM,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "Dots1ForCausalLM": Dots1ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,
    "GPTJForCausalLM": GPTJForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "FalconForCausalLM": FalconForCausalLM,
    "BloomForCausalLM": BloomForCausalLM,
    "FlexOlmoForCausalLM": FlexOlmoForCausalLM,
    "MptForCausalLM": MptForCausalLM,
    "MPTForCausalLM": MPTForCausalLM,
    "ApertusForCausalLM": ApertusForCausalLM,
    "PhimoeForCausalLM": PhimoeForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "Mamba2ForCausalLM": Mamba2ForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "MiniCPM5MoeForCausalLM": MiniCPM5MoeForCausalLM,
    "Gemma3nForCausalLM": Gemma3nForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "InternLM2ForCausalLM": InternLM2ForCausalLM,
    "InternLM3ForCausalLM": InternLM3ForCausalLM,
    "ExaoneForCausalLM": ExaoneForCausalLM,
    "Jais2ForCausalLM": Jais2ForCausalLM,
    "SolarOpenForCausalLM": SolarOpenForCausalLM,
    "YoutuForCausalLM": YoutuForCausalLM,
    "AfmoeForCausalLM": AfmoeForCausalLM,
    "LagunaForCausalLM": LagunaForCausalLM,
    "MellumForCausalLM": MellumForCausalLM,
    "HYV3ForCausalLM": HYV3ForCausalLM,
    "HyperCLOVAXForCausalLM": HyperCLOVAXForCausalLM,
    "AXK1ForCausalLM": AXK1ForCausalLM,
    "NanoChatForCausalLM": NanoChatForCausalLM,
    "Kolibri1ForCausalLM": Kolibri1ForCausalLM,
    "FlintForCausalLM": FlintForCausalLM,
    "BeamForCausalLM": BeamForCausalLM,
    "BitNetForCausalLM": BitNetForCausalLM,
    "JetMoeForCausalLM": JetMoeForCausalLM,
    "LongcatFlashForCausalLM": LongcatFlashForCausalLM,
    "BioGptForCausalLM": BioGptForCausalLM,
    "XGLMForCausalLM": XGLMForCausalLM,
    "ModernBertDecoderForCausalLM": ModernBertDecoderForCausalLM,
    "MiMoV2FlashForCausalLM": MiMoV2FlashForCausalLM,
    "GraniteSWAForCausalLM": GraniteSWAForCausalLM,
    "GraniteMoeSWAForCausalLM": GraniteMoeSWAForCausalLM,
    "Cohere2MoeForCausalLM": Cohere2MoeForCausalLM,
    "Lfm3ForCausalLM": Lfm3ForCausalLM,
    "GPTNeoForCausalLM": GPTNeoForCausalLM,
    "CodeGenForCausalLM": CodeGenForCausalLM,
    "OlmoHybridForCausalLM": OlmoHybridForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
    "BailingHybridForCausalLM": BailingHybridForCausalLM,
    "MiniMaxForCausalLM": MiniMaxForCausalLM,
    "MiniMaxText01ForCausalLM": MiniMaxForCausalLM,
    "MiniMaxM1ForCausalLM": MiniMaxForCausalLM,
    "BertModel": BertModel,
    "RobertaModel": RobertaModel,
    "ModernBertModel": ModernBertModel,
    "NomicBertModel": RopeBertModel,
    "GteModel": RopeBertModel,
    "JinaEmbeddingsV3Model": JinaEmbeddingsV3Model,
}


# Speculative decoding's MTP drafters and EAGLE heads (built for a served model, never served themselves).
_DRAFTER_MODELS = {**{drafter.__name__: drafter for drafter in MTP_DRAFTERS.values()}, **EAGLE_HEADS}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY.get(architecture) or _DRAFTER_MODELS[architecture]
    except KeyError:
        raise ValueError(f"architecture must be one of {sorted(MODEL_REGISTRY)}, got {architecture!r}") from None


def build_model(config: ModelConfig) -> nn.Module:
    """Uninitialised model (parameters are torch.empty) on the current default device and dtype."""
    model_class = get_model_class(config.architecture)
    if config.vision is None and config.language_model_of is not None:  # (text-only mode)
        model_class = language_model_class(model_class)
    elif isinstance(config.vision, QwenVisionConfig):  # (Qwen2-VL / Qwen2.5-VL: a Qwen2 decoder)
        model_class = Qwen2VLForConditionalGeneration
    elif isinstance(config.vision, Qwen3VisionConfig):  # (Qwen3-VL: a Qwen3 or Qwen3-MoE decoder)
        moe = config.architecture == "Qwen3MoeForCausalLM"
        model_class = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    elif isinstance(config.vision, Gemma3VisionConfig):  # (Gemma 3 4B+: its SigLIP tower and projector)
        model_class = Gemma3VLForConditionalGeneration
    elif isinstance(config.vision, PixtralVisionConfig):  # (Pixtral-12B, Mistral 3: a Mistral decoder)
        model_class = pixtral_class(model_class)
    elif isinstance(config.vision, InternVLVisionConfig):  # (InternVL: a Qwen2, Qwen3 or Llama decoder)
        model_class = internvl_class(model_class)
    elif isinstance(config.vision, Idefics3VisionConfig):  # (Idefics3 / SmolVLM: a Llama decoder)
        model_class = Idefics3ForConditionalGeneration
    elif config.vision is not None:  # (LLaVA: its decoder, and the image side)
        model_class = llava_class(model_class)
    if config.quantization == "bitnet":  # (one rank, no LoRA: refused before here by the executor)
        check_bitnet_model(config.architecture, distributed.get_tp_world_size(), lora=False)
    model = model_class(config)
    if config.quantization == "bitnet":
        quantize_linear_inputs(model)
    return model
