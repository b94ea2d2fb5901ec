"""Speculative decoding's EAGLE and EAGLE-3 heads (gpu_worker/models/eagle.py, read by
gpu_worker/eagle_config.py, run by gpu_worker/hidden_state_drafter.py) on tiny heads for a tiny
Llama: every draft proposed is the one an independent reference computes from the whole sequence
so far (the target's hidden states from transformers; the head written out here in plain torch,
over every position at once), through chunked prefill, accepted and rejected drafts and several
requests a pass; the answers are the model's own greedy ones; what does not fit is refused."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from gpu_worker.config import ModelConfig
from gpu_worker.eagle_config import eagle_head_config
from gpu_worker.kv_cache_groups import group_attention_layers
from gpu_worker.layers.weight_utils import materialize
from gpu_worker.model_runner import ModelRunner
from gpu_worker.weights import iter_checkpoint
from tests.gpu_worker.drafter_checks import check_every_draft, check_two_ranks_draft_as_one
from tests.gpu_worker.utils import (
    load_hf,
    save_near_bigram_target,
    save_tiny_eagle_head,
    save_tiny_model,
)

K = 3  # drafts a pass


class EagleReference:
    """An EAGLE or EAGLE-3 head's drafts computed from scratch for a whole sequence: the target's
    hidden states from transformers, then the head's layer over every position at once (causal
    attention written out here), fed at each position the next token and the feature there; each
    further draft appends the draft and the head's own output, and runs it all again."""

    def __init__(self, target: Path, head: Path, method: str) -> None:
        self.target = load_hf(target)
        self.method = method
        cfg = json.loads((head / "config.json").read_text())
        speculators = "speculators_model_type" in cfg
        self.cfg = {**cfg["transformer_layer_config"], **cfg} if speculators else cfg
        self.norm_before_residual = self.cfg.get("norm_before_residual", speculators)
        self.t = {name.removeprefix("model."): materialize(t) for name, t in iter_checkpoint(head)}
        prefix = "layers.0." if method == "eagle" or speculators else "midlayer."
        self.w = {name[len(prefix):]: t for name, t in self.t.items() if name.startswith(prefix)}
        self.eps = self.cfg["rms_norm_eps"]
        self.heads, self.kv_heads = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        self.head_dim = self.cfg["hidden_size"] // self.heads
        layers = self.target.config.num_hidden_layers
        ids = (self.cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
            or self.cfg.get("eagle_aux_hidden_state_layer_ids")
        # (Each layer's input once, in the layers' order, as vLLM's decoder keeps them; none where the
        # head reads the last hidden state.)
        reads_aux = method == "eagle3" and (self.cfg.get("eagle_config") or {}).get("use_aux_hidden_state", True)
        self.aux_ids = tuple(sorted(set(ids or (2, layers // 2, layers - 3)))) if reads_aux else ()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q = (x @ self.w["self_attn.q_proj.weight"].T).view(n, self.heads, d)
        k = (x @ self.w["self_attn.k_proj.weight"].T).view(n, self.kv_heads, d)
        v = (x @ self.w["self_attn.v_proj.weight"].T).view(n, self.kv_heads, d)
        inv_freq = 1.0 / (self.cfg.get("rope_theta", 10000.0) ** (torch.arange(0, d, 2).float() / d))
        angles = torch.arange(n).float()[:, None] * inv_freq[None]
        cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None]
        sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None]

        def rotate(t: torch.Tensor) -> torch.Tensor:
            return t * cos + torch.cat((-t[..., d // 2:], t[..., : d // 2]), -1) * sin

        q, k = rotate(q), rotate(k)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, self.heads * d)
        return out @ self.w["self_attn.o_proj.weight"].T

    def _layer(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        w = self.w
        if self.method == "eagle":
            fc = torch.cat((embeds, features), -1) @ self.t["fc.weight"].T
            residual = attention_in = fc + self.t["fc.bias"] if "fc.bias" in self.t else fc
        else:
            normed = self._norm(features, w["hidden_norm.weight"])
            residual = normed if self.norm_before_residual else features
            attention_in = torch.cat((self._norm(embeds, w["input_layernorm.weight"]), normed), -1)
        residual = residual + self._attention(attention_in)
        h = self._norm(residual, w["post_attention_layernorm.weight"])
        mlp = (torch.nn.functional.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) \
            @ w["mlp.down_proj.weight"].T
        return mlp + residual

    def _pick(self, out: torch.Tensor) -> int:
        if self.method == "eagle":
            return int(self.target.lm_head(out).argmax())
        logits = self._norm(out, self.t["norm.weight"]) @ self.t["lm_head.weight"].T
        draft_id = int(logits.argmax())
        return draft_id + int(self.t["d2t"][draft_id])

    @torch.no_grad()
    def drafts(self, sequence: list[int], k: int) -> list[int]:
        ids = torch.tensor([sequence])
        out = self.target.model(input_ids=ids[:, :-1], output_hidden_states=True)
        if not self.aux_ids:
            features = out.last_hidden_state[0]
        else:
            features = torch.cat([out.hidden_states[i][0] for i in self.aux_ids], -1) @ self.t["fc.weight"].T
        embed = self.target.model.embed_tokens
        embeds = embed(ids[0, 1:])
        drafts = []
        for _ in range(k):
            outputs = self._layer(embeds, features)
            drafts.append(self._pick(outputs[-1]))
            embeds = torch.cat((embeds, embed(torch.tensor([drafts[-1]]))))
            features = torch.cat((features, outputs[-1:]))
        return drafts


def eagle_runner(target: Path, head: Path, method: str, num_blocks: int, block_size: int,
                 max_num_batched_tokens: int, hybrid_kv_cache: bool = False) -> ModelRunner:
    """``hybrid_kv_cache``: the target's layers (full-attention and windowed) in KV cache groups."""
    config = ModelConfig.from_pretrained(target)
    grouping = None
    if hybrid_kv_cache:
        grouping = group_attention_layers([config.layer_sliding_window(i) for i in range(config.num_hidden_layers)])
        assert grouping is not None
    runner = ModelRunner(config, device="cpu", dtype=torch.float32, max_model_len=256,
                         max_num_batched_tokens=max_num_batched_tokens, num_spec_tokens=K, kv_cache_grouping=grouping)
    runner.load_model(target)
    runner.load_eagle_drafter(eagle_head_config(head, method, config), head, K)
    runner.initialize_kv_cache(num_blocks, block_size)
    return runner


HEADS = {  # method, head kwargs, target kind
    "eagle": ("eagle", {}, "llama"),
    "eagle-no-fc-bias-bin": ("eagle", {"fc_bias": False, "pytorch_bin": True}, "llama"),
    "eagle-names-under-model": ("eagle", {"name_prefix": "model."}, "llama"),
    "eagle3": ("eagle3", {"draft_vocab_size": 200}, "llama"),
    "eagle3-layer-ids": ("eagle3", {"draft_vocab_size": 200, "config_overrides": {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 6, 1]}}}, "llama"),
    "eagle3-qwen3-moe": ("eagle3", {"draft_vocab_size": 200}, "qwen3_moe"),
    "eagle3-last-hidden-state": ("eagle3", {"draft_vocab_size": 200, "config_overrides": {
        "eagle_config": {"use_aux_hidden_state": False}}}, "llama"),
    "eagle3-whole-vocab-names-under-model": ("eagle3", {"name_prefix": "model."}, "llama"),
    "eagle3-speculators-format": ("eagle3", {"draft_vocab_size": 200, "speculators": True, "config_overrides": {
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, "llama"),
}


@pytest.mark.parametrize("case", list(HEADS))
def test_every_eagle_draft_is_the_references_through_chunks_and_rejections(case, tmp_path):
    method, kwargs, kind = HEADS[case]
    # (EAGLE-3's built guess goes through the target's bigram twice: a target closer to one.)
    target = save_near_bigram_target(tmp_path / "target", kind=kind, near_bigram=0.02 if method == "eagle" else 0.005)
    head = save_tiny_eagle_head(tmp_path / "head", target, method, near_bigram=0.02, **kwargs)
    reference = EagleReference(target, head, method)
    runner = eagle_runner(target, head, method, 96, 4, 24)
    check_every_draft(runner, reference, K)
    # (EAGLE-3: the target kept its layers' inputs for the head, and the head took them.)
    stack = runner.model.model
    assert stack.aux_layer_ids == reference.aux_ids
    assert stack.aux_hidden_states == []


def test_eagle3_drafts_for_a_model_whose_windowed_layers_keep_a_kv_cache_group_of_their_own(tmp_path):
    """GPT-OSS (windowed layers of 8 keys between full-attention ones, attention sinks) under the hybrid
    KV cache manager: the head's cache sits on the full-attention group's blocks while the windowed
    group's blocks behind the window go back to a pool of 40 blocks the four requests share; every draft
    of a head of random weights (its attention counts in every draft) is still the reference's."""
    target = save_tiny_model(tmp_path / "target", "gpt_oss", num_hidden_layers=8)
    # (A head of plain RoPE and no attention biases, as the released GPT-OSS EAGLE-3 heads are Llama layers.)
    head = save_tiny_eagle_head(tmp_path / "head", target, "eagle3", draft_vocab_size=200,
                                config_overrides={"attention_bias": False,
                                                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    runner = eagle_runner(target, head, "eagle3", 40, 4, 24, hybrid_kv_cache=True)
    assert runner.kv_cache_grouping.windows == (None, 8)
    check_every_draft(runner, EagleReference(target, head, "eagle3"), K, num_blocks=40, some_accepted=False)


def test_the_memory_profile_keeps_no_inner_hidden_states_after_it(tmp_path):
    """The profile's largest pass keeps the inputs of the layers an EAGLE-3 head reads (their memory
    counts in its peak), and lets go of them after it."""
    target = save_near_bigram_target(tmp_path / "target")
    head = save_tiny_eagle_head(tmp_path / "head", target, "eagle3", draft_vocab_size=200)
    runner = eagle_runner(target, head, "eagle3", 16, 4, 64)
    kept = []
    stack = runner.model.model
    forward = stack.forward

    def counting(*args, **kwargs):
        out = forward(*args, **kwargs)
        kept.append(len(stack.aux_hidden_states))
        return out

    stack.forward = counting  # (the decoder's forward is called directly, not through hooks)
    runner.profile_run(4)
    assert kept == [3] and stack.aux_hidden_states == []


def test_what_does_not_fit_is_refused(tmp_path):
    target = save_tiny_model(tmp_path / "target", num_hidden_layers=8)
    config = ModelConfig.from_pretrained(target)
    eagle = save_tiny_eagle_head(tmp_path / "eagle", target, "eagle")
    eagle3 = save_tiny_eagle_head(tmp_path / "eagle3", target, "eagle3", draft_vocab_size=100)
    with pytest.raises(ValueError, match=r"is an EAGLE-3 head \(LlamaForCausalLMEagle3\): serve it with "
                                         r"speculative method 'eagle3'"):
        eagle_head_config(eagle3, "eagle", config)
    with pytest.raises(ValueError, match=r"is an EAGLE head .* with speculative method 'eagle', not 'eagle3'"):
        eagle_head_config(eagle, "eagle3", config)
    wider = ModelConfig.from_pretrained(save_tiny_model(tmp_path / "wider", hidden_size=96, num_hidden_layers=8))
    with pytest.raises(ValueError, match=r"width \(64\) is not the target's \(96\)"):
        eagle_head_config(eagle, "eagle", wider)
    other_vocab = ModelConfig.from_pretrained(save_tiny_model(tmp_path / "v", vocab_size=300, num_hidden_layers=8))
    with pytest.raises(ValueError, match=r"vocabulary \(256 tokens\) is not the target's \(300\)"):
        eagle_head_config(eagle, "eagle", other_vocab)
    shallow = ModelConfig.from_pretrained(save_tiny_model(tmp_path / "shallow", num_hidden_layers=2))
    with pytest.raises(ValueError, match=r"reads the inputs of the target's layers \[2, 1, -1\]; the target has 2"):
        eagle_head_config(eagle3, "eagle3", shallow)
    for ids, message in (([], r"layers \[\]"), ([1, 2], r"fc reads 192 features, not the 2 x 64 of the target's "
                                                        r"layers \[1, 2\]"), ([2, 2, 4], "not the 2 x 64")):
        with_ids = save_tiny_eagle_head(tmp_path / f"ids{len(ids)}{ids[:1]}", target, "eagle3", config_overrides={
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}})
        with pytest.raises(ValueError, match=message):
            eagle_head_config(with_ids, "eagle3", config)
    larger = save_tiny_eagle_head(tmp_path / "larger", target, "eagle3", config_overrides={"draft_vocab_size": 300})
    with pytest.raises(ValueError, match=r"draft vocabulary \(300 tokens\) is larger than the target's \(256\)"):
        eagle_head_config(larger, "eagle3", config)
    with pytest.raises(ValueError, match=r"holds no EAGLE head .* or the model to method draft_model"):
        eagle_head_config(target, "eagle", config)
    with pytest.raises(ValueError, match="is not one"):
        eagle_head_config(target / "model.safetensors", "eagle", config)
    (eagle3 / "model.safetensors").unlink()
    no_map = save_tiny_eagle_head(tmp_path / "no_map", target, "eagle3", draft_vocab_size=100)
    from safetensors.torch import load_file, save_file
    tensors = load_file(no_map / "model.safetensors")
    del tensors["d2t"]
    save_file(tensors, no_map / "model.safetensors")
    with pytest.raises(ValueError, match="holds no d2t"):
        eagle_head_config(no_map, "eagle3", config)
    speculators = tmp_path / "speculators"
    speculators.mkdir()
    (speculators / "config.json").write_text(json.dumps({"architectures": ["EagleSpeculator"],
                                                         "speculators_model_type": "eagle"}))
    with pytest.raises(ValueError, match="speculators library's format of type 'eagle': only its EAGLE-3"):
        eagle_head_config(speculators, "eagle", config)


def test_a_head_whose_positions_reach_less_than_max_model_len_is_refused(tmp_path):
    target = save_tiny_model(tmp_path / "target", num_hidden_layers=8)
    config = ModelConfig.from_pretrained(target)
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    head = save_tiny_eagle_head(tmp_path / "head", target, "eagle", config_overrides={"rope_parameters": yarn})
    runner = ModelRunner(config, device="cpu", dtype=torch.float32, max_model_len=128, num_spec_tokens=K)
    runner.load_model(target)
    with pytest.raises(ValueError, match=r"positions reach 64 tokens, short of max_model_len \(128\)"):
        runner.load_eagle_drafter(eagle_head_config(head, "eagle", config), head, K)


def test_eagle3_is_refused_where_the_target_gives_no_inner_hidden_states(tmp_path):
    target = save_tiny_model(tmp_path / "gemma", "gemma", num_hidden_layers=8)
    config = ModelConfig.from_pretrained(target)
    head = save_tiny_eagle_head(tmp_path / "head", target, "eagle3")
    runner = ModelRunner(config, device="cpu", dtype=torch.float32, max_model_len=64, num_spec_tokens=K)
    runner.load_model(target)
    with pytest.raises(ValueError, match="reads the target's inner hidden states, which GemmaForCausalLM does not"):
        runner.load_eagle_drafter(eagle_head_config(head, "eagle3", config), head, K)


@pytest.mark.slow
def test_two_tensor_parallel_ranks_draft_as_one_with_eagle3(tmp_path, tp_hosts):
    """The EAGLE-3 head shards over the target's two workers (its attention by heads, its own head
    by vocabulary); each rank keeps its target's inner hidden states: the same drafts, pass for
    pass, and the same answers as one rank, and those are the plain greedy ones."""
    pytest.importorskip("ray")

    target = save_near_bigram_target(tmp_path / "target", num_key_value_heads=2)
    head = save_tiny_eagle_head(tmp_path / "head", target, "eagle3", near_bigram=0.02, draft_vocab_size=200)
    rng = random.Random(5)
    prompts = {f"r{i}": [rng.randrange(3, 256) for _ in range(rng.randrange(2, 20))] for i in range(4)}
    kwargs = dict(device="cpu", dtype="float32", max_model_len=128, num_cpus=1)
    # (One more layer's cache beside the target's eight: of the same geometry.)
    check_two_ranks_draft_as_one(target, prompts, K, kwargs, {"draft_model": str(head), "draft_method": "eagle3"},
                                 (9, 8), tp_hosts)
