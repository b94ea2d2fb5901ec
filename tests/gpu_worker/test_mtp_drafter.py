"""Speculative decoding's MTP drafter (gpu_worker/hidden_state_drafter.py, gpu_worker/models/mtp.py) on tiny
GLM-4.5, DeepSeek-V3, Qwen3-Next and Qwen3.5 checkpoints holding an MTP layer: every draft it proposes is the one an
independent reference computes from the whole sequence so far (transformers' decoder layer of the
same kind, loaded with the MTP layer's weights, over every position at once), through chunked
prefill, accepted and rejected drafts, and several requests a pass; and the answers are the model's
own greedy ones."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.config import ModelConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.mtp import mtp_config
from tests.gpu_worker.drafter_checks import check_every_draft, check_two_ranks_draft_as_one
from tests.gpu_worker.utils import (
    load_hf,
    save_tiny_model,
    save_tiny_model_with_mtp,
    save_tiny_qwen3_next_with_mtp,
)

K = 3  # drafts a pass


class MtpReference:
    """The MTP layer's drafts computed from scratch for a whole sequence: the target's final hidden
    states (transformers), then a one-layer transformers model of the same kind whose layer is the
    MTP layer, whose final norm is its shared_head.norm and whose embedding and head are the
    target's, fed eh_proj([enorm(next token's embedding), hnorm(hidden state)]) at every position."""

    def __init__(self, path: Path, tmp: Path) -> None:
        self.target = load_hf(path)
        config = json.loads((path / "config.json").read_text())
        index = config["num_hidden_layers"]
        prefix = f"model.layers.{index}."
        tensors = load_file(path / "model.safetensors")
        own = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
        self.enorm, self.hnorm, self.eh_proj = own["enorm.weight"], own["hnorm.weight"], own["eh_proj.weight"]
        self.eps = config["rms_norm_eps"]
        layer = {name: t for name, t in own.items()
                 if not name.startswith(("enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head"))}
        # (Its one layer routed, as the MTP layer of its number is.)
        self.layer = one_layer_model(tmp, tensors, layer, own["shared_head.norm.weight"], {
            **config, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0,
            **({"mlp_layer_types": ["sparse"]} if "mlp_layer_types" in config else {}),
            **({"layer_types": config["layer_types"][:1]} if "layer_types" in config else {})})

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    @torch.no_grad()
    def drafts(self, sequence: list[int], k: int) -> list[int]:
        ids = torch.tensor([sequence])
        hidden = self.target.model(input_ids=ids[:, :-1]).last_hidden_state[0]
        embed = self.target.model.embed_tokens
        inputs = embed(ids[0, 1:]).clone()
        inputs[0] = 0.0  # (position 0's token is not an input, as vLLM masks it)
        captured: list[torch.Tensor] = []
        hook = self.layer.model.norm.register_forward_pre_hook(lambda _, args: captured.append(args[0][0]))
        try:
            drafts = []
            for _ in range(k):
                rows = torch.cat((self._norm(inputs, self.enorm), self._norm(hidden, self.hnorm)), dim=-1)
                captured.clear()
                logits = self.layer(inputs_embeds=(rows @ self.eh_proj.T)[None]).logits[0]
                drafts.append(int(logits[-1].argmax()))
                # The next draft: the one just made in, the layer's own output as the hidden state.
                inputs = torch.cat((inputs, embed(torch.tensor([drafts[-1]]))))
                hidden = torch.cat((hidden, captured[0][-1:]))
            return drafts
        finally:
            hook.remove()


class QwenMtpReference(MtpReference):
    """Qwen3-Next's / Qwen3.5's MTP layer computed from scratch (its tensors under ``mtp.``): as
    MtpReference, with Gemma-style norms (1 + w), position 0's embedding not zeroed, and the layer's
    normed output going on as the next draft's hidden state."""

    def __init__(self, path: Path, tmp: Path) -> None:
        self.target = load_hf(path)
        config = json.loads((path / "config.json").read_text())
        tensors = load_file(path / "model.safetensors")
        self.enorm = 1.0 + tensors["mtp.pre_fc_norm_embedding.weight"]
        self.hnorm = 1.0 + tensors["mtp.pre_fc_norm_hidden.weight"]
        self.eh_proj, self.eps = tensors["mtp.fc.weight"], config["rms_norm_eps"]
        prefix = "mtp.layers.0."
        layer = {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}
        self.layer = one_layer_model(tmp, tensors, layer, tensors["mtp.norm.weight"], {
            **config, "layer_types": ["full_attention"], "mtp_num_hidden_layers": 0})

    @torch.no_grad()
    def drafts(self, sequence: list[int], k: int) -> list[int]:
        ids = torch.tensor([sequence])
        hidden = self.target.model(input_ids=ids[:, :-1]).last_hidden_state[0]
        embed = self.target.model.embed_tokens
        inputs = embed(ids[0, 1:])
        drafts = []
        for _ in range(k):
            rows = torch.cat((self._norm(inputs, self.enorm), self._norm(hidden, self.hnorm)), dim=-1)
            out = self.layer.model(inputs_embeds=(rows @ self.eh_proj.T)[None]).last_hidden_state[0]
            drafts.append(int(self.layer.lm_head(out[-1]).argmax()))
            # The next draft: the one just made in, the layer's normed output as the hidden state.
            inputs = torch.cat((inputs, embed(torch.tensor([drafts[-1]]))))
            hidden = torch.cat((hidden, out[-1:]))
        return drafts


def one_layer_model(tmp: Path, target: dict[str, torch.Tensor], layer: dict[str, torch.Tensor],
                    final_norm: torch.Tensor, config: dict):
    """A one-layer transformers model of the target's kind (``config``, its layer count set to 1):
    ``layer``'s tensors (named within the layer) as its layer, ``final_norm`` as its final norm, the
    target's embedding and LM head."""
    tensors = {f"model.layers.0.{name}": t for name, t in layer.items()}
    tensors.update({"model.norm.weight": final_norm, "model.embed_tokens.weight": target["model.embed_tokens.weight"],
                    "lm_head.weight": target["lm_head.weight"]})
    (tmp / "mtp_reference").mkdir()
    save_file(tensors, tmp / "mtp_reference" / "model.safetensors", metadata={"format": "pt"})
    (tmp / "mtp_reference" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    return load_hf(tmp / "mtp_reference")


def mtp_runner(path: Path, num_blocks: int, block_size: int, max_num_batched_tokens: int) -> ModelRunner:
    runner = ModelRunner(ModelConfig.from_pretrained(path), device="cpu", dtype=torch.float32, max_model_len=256,
                         max_num_batched_tokens=max_num_batched_tokens, num_spec_tokens=K)
    runner.load_model(path)
    runner.load_mtp_drafter(path, K)
    runner.initialize_kv_cache(num_blocks, block_size)
    return runner


@pytest.mark.parametrize("kind", ["glm4_moe", "deepseek_v3", "glm4_moe_lite", "deepseek_v32"])
def test_every_mtp_draft_is_the_references_through_chunks_and_rejections(kind, tmp_path):
    """(DeepSeek-V3.2's MTP layer attends sparsely too: its indexer over its own cache, queries past the
    test model's 6 keys choosing.)"""
    path = save_tiny_model_with_mtp(tmp_path / "model", kind, near_bigram=0.02)
    check_every_draft(mtp_runner(path, 96, 4, 24), MtpReference(path, tmp_path), K)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_every_qwen3_next_mtp_draft_is_the_references(kind, tmp_path):
    """Qwen3-Next's and Qwen3.5's MTP layer, read from its own names (mtp.*), over a target with
    recurrent layers: every draft is the reference's, through chunks, accepted and rejected drafts
    (whose recurrent states the target puts back), and the answers are transformers' greedy ones."""
    path = save_tiny_qwen3_next_with_mtp(tmp_path / "model", kind, near_bigram=0.02)
    check_every_draft(mtp_runner(path, 96, 4, 24), QwenMtpReference(path, tmp_path), K)


def test_every_draft_of_a_qwen3_next_mtp_layer_of_random_weights_is_the_references(tmp_path):
    """Without near_bigram's scaling the layer's attention (gated, partial RoPE, q/k norms) and routed
    experts decide its drafts, not its projection alone: still every draft the reference's (few accepted)."""
    path = save_tiny_qwen3_next_with_mtp(tmp_path / "model")
    check_every_draft(mtp_runner(path, 96, 4, 24), QwenMtpReference(path, tmp_path), K, some_accepted=False)


def test_a_model_without_an_mtp_layer_is_refused(tmp_path):
    # (transformers' GLM-4.5 config names one MTP layer by default; a checkpoint may still leave it out.)
    path = save_tiny_model(tmp_path / "glm", "glm4_moe")
    runner = ModelRunner(ModelConfig.from_pretrained(path), device="cpu", dtype=torch.float32, max_model_len=64,
                         num_spec_tokens=K)
    runner.load_model(path)
    with pytest.raises(ValueError, match=r"holds no multi-token-prediction layer \(model.layers.2.\*\)"):
        runner.load_mtp_drafter(path, K)
    config = ModelConfig.from_pretrained(save_tiny_model(tmp_path / "v3", "deepseek_v3", num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="its config names no multi-token-prediction layer"):
        mtp_config(config)
    llama = ModelConfig.from_pretrained(save_tiny_model(tmp_path / "llama"))
    with pytest.raises(ValueError, match="its architecture has none"):
        mtp_config(llama)
    glm5 = ModelConfig.from_pretrained(save_tiny_model(tmp_path / "glm5_mtp", "glm_moe_dsa",
                                                       num_nextn_predict_layers=1))
    with pytest.raises(ValueError, match="an indexer of its own"):
        mtp_config(glm5)
    with pytest.raises(ValueError, match="its architecture has none"):  # (no MTP layer named)
        mtp_config(ModelConfig.from_pretrained(save_tiny_model(tmp_path / "glm5", "glm_moe_dsa")))
    qwen = save_tiny_model(tmp_path / "qwen3_next", "qwen3_next")
    with pytest.raises(ValueError, match="names no multi-token-prediction layer"):
        mtp_config(ModelConfig.from_pretrained(qwen))
    config = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    runner = ModelRunner(ModelConfig.from_pretrained(qwen), device="cpu", dtype=torch.float32, max_model_len=64,
                         num_spec_tokens=K)
    runner.load_model(qwen)
    with pytest.raises(ValueError, match=r"holds no multi-token-prediction layer \(mtp\.\*\)"):
        runner.load_mtp_drafter(qwen, K)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "expert_parallel"), [("glm4_moe", True), ("deepseek_v3", False),
                                                      ("deepseek_v32", True)])
def test_two_tensor_parallel_ranks_draft_as_one(tmp_path, kind, expert_parallel, tp_hosts):
    """The MTP layer shards over the target's two workers (its experts split by width or by expert,
    its latent attention by heads); the sampling rank shares what it accepted and sampled: the same
    drafts, pass for pass, and the same answers as one rank, and those are the plain greedy ones."""
    pytest.importorskip("ray")

    path = save_tiny_model_with_mtp(tmp_path / "model", kind, near_bigram=0.02, num_key_value_heads=1,
                                    vocab_size=251)
    rng = random.Random(5)
    prompts = {f"r{i}": [rng.randrange(3, 251) for _ in range(rng.randrange(2, 20))] for i in range(4)}
    kwargs = dict(device="cpu", dtype="float32", max_model_len=128, num_cpus=1, enable_expert_parallel=expert_parallel)
    # (One more layer's cache beside the target's two: its own, of the same geometry.)
    check_two_ranks_draft_as_one(path, prompts, K, kwargs, {"mtp_drafter": True}, (3, 2), tp_hosts)
