"""KV offloading to host memory vs a KV cache alone, on SmolLM2-135M-Instruct, in one run.

A workload that revisits more long prefixes than the KV cache holds: N conversations, each with a
long document of its own, asked several questions in rounds (every conversation once per round).
The KV cache holds a few documents; the rest are evicted between their turns. Without offloading
each turn recomputes its document's prefill; with ``--kv-offloading-size`` the evicted blocks come
back from host memory. The same greedy requests run both ways; the answers must be identical.
Printed per mode: wall time, the ratio to no offloading, prompt tokens computed, cached and loaded
from the host tier, and mean time to first token.
Usage: python benchmarks/bench_kv_offload.py [--conversations 12] [--rounds 3] [--kv-blocks 160]
"""

from __future__ import annotations

import argparse
import time

from cluster import LLM, SamplingParams

TOPICS = ["lighthouses", "honey bees", "bread baking", "chess openings", "rainbows", "volcanoes", "tides",
          "glaciers", "the printing press", "coral reefs", "comets", "windmills", "silk roads", "paper making"]
QUESTIONS = ["Summarise it in one sentence.", "What is the most surprising fact?", "Give it a title.",
             "Who would enjoy reading it?"]


def document(topic: str) -> str:
    sentences = [f"Paragraph {i} about {topic}: people have studied {topic} for centuries, writing down what they "
                 f"saw, measuring what they could, and arguing about the rest in long letters." for i in range(12)]
    return " ".join(sentences)


def run(prompts: list[list[list[int]]], kv_blocks: int, offload_gib: float | None) -> dict:
    llm = LLM(num_gpu_blocks=kv_blocks, max_num_seqs=4, max_model_len=2048, kv_offloading_size=offload_gib)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        llm.generate([prompts[0][0][:32]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
        answers, cached, ttfts = [], 0, []
        before = llm.get_stats()[0]
        t0 = time.perf_counter()
        for round_prompts in prompts:
            for out in llm.generate(round_prompts, params, use_tqdm=False):
                answers.append(out.outputs[0].token_ids)
                cached += out.num_cached_tokens
                ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        elapsed = time.perf_counter() - t0
        after = llm.get_stats()[0]
    finally:
        llm.shutdown()
    total_prompt = sum(len(p) for r in prompts for p in r)
    return {"answers": answers, "seconds": elapsed, "computed": total_prompt - cached, "cached": cached,
            "loaded_blocks": after.kv_offload_loaded_blocks - before.kv_offload_loaded_blocks,
            "ttft_ms": 1000 * sum(ttfts) / len(ttfts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-blocks", type=int, default=160, help="KV cache blocks of 16 tokens.")
    parser.add_argument("--offload-gib", type=float, default=0.5, help="Host tier size (GiB).")
    args = parser.parse_args()
    from gpu_worker.model_resolver import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct").model_dir)
    docs = [document(TOPICS[i % len(TOPICS)] + f" (#{i})") for i in range(args.conversations)]
    prompts = []
    for r in range(args.rounds):
        round_prompts = []
        for doc in docs:
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": doc}, {"role": "user", "content": QUESTIONS[r % len(QUESTIONS)]}],
                add_generation_prompt=True, tokenize=False)
            round_prompts.append(tokenizer.encode(text, add_special_tokens=False))
        prompts.append(round_prompts)
    doc_tokens = sum(len(p) for p in prompts[0]) // len(prompts[0])
    print(f"{args.conversations} conversations x {args.rounds} rounds, ~{doc_tokens} prompt tokens each, "
          f"KV cache {args.kv_blocks} blocks ({args.kv_blocks * 16} tokens), greedy 8 tokens")
    print(f"{'mode':16} {'seconds':>8} {'speedup':>9} {'computed':>9} {'cached':>8} {'loaded blk':>10} "
          f"{'TTFT ms':>8}")
    base = None
    for name, gib in (("KV cache only", None), (f"offload {args.offload_gib} GiB", args.offload_gib)):
        r = run(prompts, args.kv_blocks, gib)
        base = base or r
        same = r["answers"] == base["answers"]
        print(f"{name:16} {r['seconds']:8.2f} {base['seconds'] / r['seconds']:8.2f}x {r['computed']:9d} "
              f"{r['cached']:8d} {r['loaded_blocks']:10d} {r['ttft_ms']:8.1f}" + ("" if same else "  ANSWERS DIFFER"))


if __name__ == "__main__":
    main()
