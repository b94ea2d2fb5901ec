"""Prefix caching for a model with recurrent layers (--mamba-cache-mode align) vs without it
(--mamba-cache-mode none: prefix caching off, vLLM's default for such models), in one run.

The model: a random Granite 4.0-H of SmolLM2-135M's widths (576 hidden, 9 heads; Mamba-2 layers of 18
heads of 64 with states of 128, one attention layer in six), with SmolLM2's tokenizer. The workload,
chat: N conversations that share a system prompt, each turn the whole conversation so far (the
previous answers included) and a new user message, every conversation once per turn. Without kept
states every turn computes its whole prompt; with them a turn starts after the last full block of the
answer before it (and the first turn after the system prompt's blocks, once an earlier prompt kept
a state where they end). Printed per mode: wall time and its ratio to none, prompt tokens computed and
cached, mean time to first token, and how many answers are the same both ways (greedy; fp32 sums
taken in other chunks may differ in the last bits). Then what align costs where nothing is reused:
the same number of distinct prompts (no shared system prompt), one turn with longer answers (states
copied out where each prefill pass reaches its last block boundary and before each prompt's last
token, the chunk's recurrent scan in pieces that end there, and every block of answer).
Usage: python benchmarks/bench_recurrent_prefix_cache.py [--conversations 8] [--turns 4] [--layers 12]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import LLM, SamplingParams
from tests.gpu_worker.utils import save_tiny_model

SHAPES = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
          "max_position_embeddings": 8192, "num_local_experts": 0, "shared_intermediate_size": 1536,
          "mamba_n_heads": 18, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
          "mamba_chunk_size": 256, "tie_word_embeddings": True}


def build_model(out_dir: Path, layers: int) -> Path:
    from gpu_worker.model_resolver import resolve_model

    kinds = ["attention" if i % 6 == 5 else "mamba" for i in range(layers)]
    path = save_tiny_model(out_dir / "granite-h", "granitemoehybrid", layer_types=kinds, **SHAPES)
    smollm2 = Path(resolve_model("SmolLM2-135M-Instruct").model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, path / name)
    return path


def run(model: Path, mode: str, system: list[int], messages: list[list[list[int]]], answer_len: int) -> dict:
    llm = LLM(model=str(model), dtype="float32", num_gpu_blocks=1024, max_num_seqs=len(messages[0]),
              max_model_len=4096, mamba_cache_mode=mode)
    params = SamplingParams(max_tokens=answer_len, temperature=0.0, ignore_eos=True)
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
        history = [list(system) for _ in messages[0]]
        answers, ttfts, cached, total = [], [], 0, 0
        t0 = time.perf_counter()
        for turn in messages:
            prompts = [h + m for h, m in zip(history, turn, strict=True)]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            for i, out in enumerate(outputs):
                answer = out.outputs[0].token_ids
                answers.append(answer)
                history[i] = prompts[i] + answer
                cached += out.num_cached_tokens
                total += len(prompts[i])
                ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return {"answers": answers, "seconds": elapsed, "computed": total - cached, "cached": cached,
            "ttft_ms": 1000 * sum(ttfts) / len(ttfts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--message-tokens", type=int, default=60)
    parser.add_argument("--answer-tokens", type=int, default=40)
    args = parser.parse_args()
    rng = random.Random(0)
    system = [rng.randrange(100, 49000) for _ in range(args.system_tokens)]
    messages = [[[rng.randrange(100, 49000) for _ in range(args.message_tokens)]
                 for _ in range(args.conversations)] for _ in range(args.turns)]
    unique = [[[rng.randrange(100, 49000) for _ in range(args.system_tokens + args.message_tokens)]
               for _ in range(args.conversations)]]
    with tempfile.TemporaryDirectory() as scratch:
        model = build_model(Path(scratch), args.layers)
        chat = {mode: run(model, mode, system, messages, args.answer_tokens) for mode in ("none", "align")}
        alone = {mode: run(model, mode, [], unique, 4 * args.answer_tokens) for mode in ("none", "align")}
    print(f"Granite 4.0-H ({args.layers} layers), random weights, fp32")
    report(f"chat: {args.conversations} conversations x {args.turns} turns, system prompt {args.system_tokens} "
           f"tokens, messages {args.message_tokens}, answers {args.answer_tokens}", chat)
    report(f"nothing reused: {args.conversations} distinct prompts of {args.system_tokens + args.message_tokens} "
           f"tokens, answers {4 * args.answer_tokens}", alone)


def report(title: str, results: dict[str, dict]) -> None:
    base = results["none"]
    print(title)
    print(f"  {'mode':8} {'seconds':>8} {'vs none':>8} {'computed':>9} {'cached':>7} {'mean TTFT ms':>13}")
    for mode, r in results.items():
        print(f"  {mode:8} {r['seconds']:8.2f} {base['seconds'] / r['seconds']:7.2f}x {r['computed']:9d} "
              f"{r['cached']:7d} {r['ttft_ms']:13.1f}")
    same = sum(a == b for a, b in zip(base["answers"], results["align"]["answers"], strict=True))
    print(f"  answers the same both ways: {same} of {len(base['answers'])}")


if __name__ == "__main__":
    main()
