"""Random LoRA adapters written by PEFT itself (the format users bring), and PEFT's own outputs as
the reference for what serving them must produce."""

from __future__ import annotations

from pathlib import Path

import torch


def peft_model(base_dir: Path, seed: int = 0, r: int = 8, alpha: float = 16.0,
               targets: tuple[str, ...] | str = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"),
               use_rslora: bool = False, scale: float = 0.15, parameters: tuple[str, ...] = (), **settings):
    """The base model with a random LoRA adapter on ``targets`` (a list of names, or one string PEFT reads
    as a regular expression or "all-linear") and on the parameters ``parameters`` names (PEFT's
    target_parameters), with LoraConfig's other ``settings`` (rank_pattern, ...) (B is not zero, unlike
    PEFT's default init, so the adapter changes the outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    torch.manual_seed(seed)
    modules = targets if isinstance(targets, str) else list(targets)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=modules,
                                            target_parameters=list(parameters) or None, use_rslora=use_rslora,
                                            lora_dropout=0.0, init_lora_weights=False, **settings))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, scale)
    return model.eval()


def save_adapter(base_dir: Path, out_dir: Path, **kwargs) -> Path:
    """Write a random adapter for the model in ``base_dir`` to ``out_dir`` (PEFT's save_pretrained)."""
    peft_model(base_dir, **kwargs).save_pretrained(out_dir)
    return out_dir


def peft_greedy(base_dir: Path, prompts: list[str], max_tokens: int, **adapter) -> list[list[int]]:
    """PEFT's own greedy tokens for each text prompt, under the adapter ``peft_model(**adapter)``."""
    from transformers import AutoTokenizer

    model = peft_model(base_dir, **adapter)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    outs = []
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt").input_ids
        with torch.no_grad():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                               min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(g[0, ids.shape[1]:].tolist())
    return outs
