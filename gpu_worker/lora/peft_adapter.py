"""Reading a PEFT LoRA checkpoint (``adapter_config.json`` + ``adapter_model.safetensors``).

What is served: LoRA on the attention and MLP projections of Llama-family models (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``, and the fused
``qkv_proj`` / ``gate_up_proj`` of models whose checkpoints store them fused, as Phi-3's do), with
the plain or rank-stabilised scaling and per-module ranks and alphas (``rank_pattern`` /
``alpha_pattern``). On mixture-of-experts models also the routed experts, in either form PEFT
writes: one module per expert (``experts.3.gate_proj``, Mixtral's ``experts.3.w1``: transformers 4's
layout), or LoRA on the stacked ``experts.gate_up_proj`` / ``experts.down_proj`` parameters
(``target_parameters``, PEFT's form under transformers 5, which PEFT also makes of the plain
gate/up/down names and of ``all-linear``), and the router (``gate``) and Qwen2-MoE's
``shared_expert_gate``. Anything else a checkpoint may hold (DoRA, trained biases, embedding or
LM-head adapters, full modules to save) is refused with a message naming it, rather than served
wrong. An adapter for a vision-language checkpoint served as its language model (Gemma 3 4B+) names
its modules as that checkpoint does: the caller renames them as the base checkpoint's tensors are,
and its vision-tower modules are skipped (as vLLM does).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpu_worker.weights import EXPERT_PROJECTIONS

# Our projections an adapter may train (wrapped by LoRA: gpu_worker.lora.manager.wrap_model).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "qkv_proj", "gate_up_proj",
                  "c_fc", "c_proj",  # (StarCoder2's and GPT-2's MLPs)
                  "fc1", "fc2",  # (Phi's and OPT's)
                  "fc_in", "fc_out",  # (GPT-J's)
                  "dense_h_to_4h", "dense_4h_to_h")  # (GPT-NeoX's and Falcon's)
# The names an adapter's checkpoint may give them: ours, and those of checkpoints that name a projection
# otherwise, read as ours by the model (lora_module_name): GPT-2's c_attn, GPT-J's and OPT's out_proj,
# Phi's, GPT-NeoX's and Falcon's dense, GPT-NeoX's and Falcon's query_key_value.
ADAPTER_MODULE_NAMES = (*TARGET_MODULES, "c_attn", "out_proj", "dense", "query_key_value", "Wqkv",
                        "in_proj",  # (a recurrent mixer's, with its out_proj: their lora_targets)
                        "gate", "shared_expert_gate")  # (an MoE block's router, Qwen2-MoE's shared expert's gate)
# One routed expert's projection as transformers 4 held them (a module per expert: Qwen-MoE's names,
# Mixtral's w1 = gate, w3 = up, w2 = down).
_ONE_EXPERT = re.compile(rf"\.experts\.\d+\.({'|'.join(EXPERT_PROJECTIONS)})$")
# The stacked parameters of a layer's routed experts (transformers 5) that PEFT's target_parameters
# may name, in the order the experts modules register them: PEFT wraps each targeted parameter of a
# module around the wrapper of the one before, so the first one's tensors are named with one
# ".base_layer" per parameter after it ("experts.base_layer.lora_A.weight": gate_up_proj's, when
# down_proj's is "experts.lora_A.weight").
_EXPERT_PARAMETERS = ("gate_up_proj", "gate_up_proj_bias", "up_proj", "down_proj", "down_proj_bias")
_BASE_LAYER = ".base_layer"
# Our names of the layers whose 2-D weight target_parameters may name: an MoE block's router (GPT-OSS's
# and Granite MoE's "router", Llama 4's, read as ours) and Qwen2-MoE's shared expert's gate.
_ROUTERS = ("gate", "shared_expert_gate")
_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"
# adapter_config.json settings that change what the adapter computes, and are not served.
_UNSUPPORTED = {
    "use_dora": "DoRA", "lora_bias": "a bias on lora_B", "layer_replication": "layer replication",
    "alora_invocation_tokens": "activated LoRA", "trainable_token_indices": "trained token embeddings",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA", "arrow_config": "Arrow routing over several adapters",
}
# init_lora_weights values after which the adapter is only right on a changed base model (PiSSA,
# OLoRA, CorDA, LoftQ and LoRA-GA move part of W into A and B). PEFT writes True instead once it has
# converted such an adapter to apply to the original model (path_initial_model_for_weight_conversion).
# "orthogonal" and "mica" set A and B only (MiCA from W's singular vectors, then keeps B frozen in
# training) and leave W as it is: PEFT applies and merges the trained adapter as plain LoRA, W + B A scaling.
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")


@dataclass
class PeftAdapter:
    rank: int
    scaling: float
    # HF module name ("model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r]), scaling not applied;
    # a layer's stacked experts parameter ("model.layers.0.mlp.experts.gate_up_proj") -> (A [experts, r, in],
    # B [experts, out, r]).
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # The checkpoint's modules left out: in parts of a vision-language model that are not served.
    skipped: list[str] = field(default_factory=list)
    # Each module's scaling where a rank_pattern or alpha_pattern makes it other than ``scaling``.
    scalings: dict[str, float] = field(default_factory=dict)

    def scaling_of(self, module: str) -> float:
        return self.scalings.get(module, self.scaling)


def _refuse(path: Path, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {path}: {why}")


def read_adapter_config(path: str | Path, max_lora_rank: int) -> dict:
    """The checked ``adapter_config.json`` of the adapter directory ``path``."""
    path = Path(path)
    if not path.exists():
        # (vLLM's words: the router answers it as a 404, as vLLM does)
        raise FileNotFoundError(f"No adapter found at {path}")
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise _refuse(path, "no adapter_config.json (expected a PEFT LoRA checkpoint directory)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise _refuse(path, f"adapter_config.json is not valid JSON ({e})") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise _refuse(path, f"peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise _refuse(path, f"{what} ({key}) is not supported")
    if config.get("bias", "none") != "none":
        raise _refuse(path, f"trained biases (bias={config.get('bias')!r}) are not supported")
    # (fan_in_fan_out, set for Conv1D modules (GPT-2's), only says how PEFT merges B @ A into a weight
    # stored [in, out]: its A and B are stored as for a Linear module, and applied so here.)
    if config.get("modules_to_save"):
        raise _refuse(path, f"modules_to_save {config['modules_to_save']!r} (whole trained modules) is not supported")
    init = config.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        raise _refuse(path, f"init_lora_weights={init!r} adapters change the base model's weights; convert it "
                            "for the original model first (PEFT's path_initial_model_for_weight_conversion)")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _refuse(path, f"r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise _refuse(path, f"rank {rank} is above --max-lora-rank {max_lora_rank}")
    if not isinstance(config.get("lora_alpha", rank), (int, float)):
        raise _refuse(path, f"lora_alpha must be a number, got {config.get('lora_alpha')!r}")
    for key, kind in (("rank_pattern", int), ("alpha_pattern", (int, float))):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict) or not all(isinstance(v, kind) and v > 0 for v in pattern.values()):
            raise _refuse(path, f"{key} must map module patterns to positive numbers, got {pattern!r}")
        for regex in pattern:
            try:
                re.compile(regex)
            except re.error as e:
                raise _refuse(path, f"{key} key {regex!r} is not a regular expression ({e})") from None
    targets = config.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise _refuse(path, f"target_parameters must be a list of names, got {targets!r}")
    return config


def _pattern_value(pattern: dict, key: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: the first pattern matching the end of ``key``
    at a name boundary."""
    for regex, value in pattern.items():
        if re.match(rf"(.*\.)?({regex})$", key):
            return value
    return default


def _targets(target_parameters: list[str], key: str) -> bool:
    """Whether PEFT's target_parameters name the parameter ``key`` (PEFT's rule: the whole name, or its
    end after a dot)."""
    return any(key == t or key.endswith(f".{t}") for t in target_parameters)


def _targeted_parameter(config: dict, module: str, depth: int, path: Path) -> str:
    """The experts' parameter whose LoRA is named ``<module><".base_layer" x depth>.lora_A/B``
    (module its checkpoint name): the targeted ones nest in registration order, the first innermost."""
    targets = config.get("target_parameters") or []
    targeted = [p for p in _EXPERT_PARAMETERS if _targets(targets, f"{module}.{p}")]
    if depth >= len(targeted):
        raise _refuse(path, f"its LoRA weights on {module} match none of its target_parameters {targets}")
    parameter = targeted[len(targeted) - 1 - depth]
    if parameter.endswith("_bias"):
        raise _refuse(path, f"LoRA on the experts' bias {module}.{parameter} is not supported")
    return parameter


def load_peft_adapter(path: str | Path, max_lora_rank: int,
                      rename: Callable[[str], str | None] | None = None) -> PeftAdapter:
    """``rename``: the served model's name of each module the checkpoint names (PEFT names them as
    the model it was trained on has them), or None for one in a part of it that is not served (the
    vision tower of a vision-language model served as its language model): those are skipped."""
    path = Path(path)
    config = read_adapter_config(path, max_lora_rank)
    rank = config["r"]
    alpha = float(config.get("lora_alpha", rank))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}

    def scaling_of(rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    tensors = _read_tensors(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        if name.endswith(_A):
            pairs.setdefault(name[: -len(_A)], {})["A"] = tensor
        elif name.endswith(_B):
            pairs.setdefault(name[: -len(_B)], {})["B"] = tensor
        else:
            raise _refuse(path, f"tensor {key!r} is not a LoRA A/B weight of a linear layer")
    if not pairs:
        raise _refuse(path, "the checkpoint holds no LoRA weights")
    weights = {}
    scalings = {}
    skipped = []
    for wrapped, ab in pairs.items():
        # (PEFT's name of a targeted parameter's LoRA: its module's, with a ".base_layer" per wrapper
        # around its own.)
        module = wrapped.replace(_BASE_LAYER, "")
        depth = wrapped.count(_BASE_LAYER)
        stacked = module.rsplit(".", 1)[-1] == "experts"
        if depth and not stacked:
            raise _refuse(path, f"LoRA on several parameters of {module} (target_parameters) is not supported "
                                "(on the routed experts' stacked gate_up_proj / up_proj and down_proj it is)")
        # (A 2-D parameter targeted, a router's weight: its LoRA is the module's, but rank_pattern and
        # alpha_pattern are matched against the parameter's name.)
        weight_targeted = not stacked and _targets(config.get("target_parameters") or [], f"{module}.weight")
        key = (f"{module}.{_targeted_parameter(config, module, depth, path)}" if stacked
               else f"{module}.weight" if weight_targeted else module)
        ours = rename(module) if rename is not None else module
        if ours is None:  # (before the checks below: a vision tower's projections have other names)
            skipped.append(module)
            continue
        if stacked:
            ours = f"{ours}.{key.rsplit('.', 1)[-1]}"
        elif weight_targeted and ours.rsplit(".", 1)[-1] not in _ROUTERS:
            raise _refuse(path, f"LoRA on the parameter {key} (target_parameters) is not supported (on routed "
                                "experts' stacks and MoE routers it is)")
        elif ours.rsplit(".", 1)[-1] not in ADAPTER_MODULE_NAMES and not _ONE_EXPERT.search(ours):
            # (as the model names it: MiniCPM5's q_gate_proj)
            raise _refuse(path, f"module {module!r} is not one of {', '.join(ADAPTER_MODULE_NAMES)} or a "
                                "routed expert's projection")
        if set(ab) != {"A", "B"}:
            raise _refuse(path, f"module {module!r} has lora_{'A' if 'A' in ab else 'B'} without its pair")
        a, b = ab["A"], ab["B"]
        module_rank = int(_pattern_value(rank_pattern, key, rank))
        # (A stacked gate_up_proj stands for two projections: PEFT gives it twice the rank when it makes
        # one of the gate_proj and up_proj an adapter names.)
        limit = max_lora_rank * (2 if key.endswith(".gate_up_proj") else 1)
        if stacked:
            a, b = _per_expert_stacks(path, key, a, b, module_rank, limit)
        elif a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] > limit:
            raise _refuse(path, f"module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                                f"a rank <= {limit} pair")
        elif module_rank != rank and a.shape[0] != module_rank:  # (its scaling would be another rank's)
            raise _refuse(path, f"rank_pattern gives {key} rank {module_rank}, its lora_A has {a.shape[0]} rows")
        weights[ours] = (a, b)
        module_scaling = scaling_of(module_rank, float(_pattern_value(alpha_pattern, key, alpha)))
        if module_scaling != scaling_of(rank, alpha):
            scalings[ours] = module_scaling
    if not weights:  # (it would be served as the base model)
        raise _refuse(path, f"every module it adapts is in the vision tower or multimodal projector, which are not "
                            f"served (the language model is): {', '.join(sorted(skipped))}")
    return PeftAdapter(rank=rank, scaling=scaling_of(rank, alpha), weights=weights, skipped=sorted(skipped),
                       scalings=scalings)


def _per_expert_stacks(path: Path, key: str, a: torch.Tensor, b: torch.Tensor, rank: int, limit: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's LoRA on a stacked experts parameter, lora_A [experts x rank, in] (expert e's rows
    e x rank ...) and lora_B [out, rank x experts] (expert e's columns e, e + experts, ...), as
    (A [experts, rank, in], B [experts, out, rank])."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] % rank or rank > limit:
        raise _refuse(path, f"{key}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a rank {rank} "
                            f"(<= {limit}) LoRA of stacked experts")
    experts = a.shape[0] // rank
    return a.reshape(experts, rank, a.shape[1]), b.reshape(b.shape[0], rank, experts).permute(2, 0, 1)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    safetensors_file = path / "adapter_model.safetensors"
    if safetensors_file.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors_file))
    bin_file = path / "adapter_model.bin"
    if bin_file.is_file():
        return torch.load(str(bin_file), map_location="cpu", weights_only=True)
    raise _refuse(path, "no adapter_model.safetensors or adapter_model.bin")
