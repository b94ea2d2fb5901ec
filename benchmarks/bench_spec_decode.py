"""Speculative decoding (n-gram drafts) vs plain decoding on SmolLM2-135M-Instruct, in one run.

The same greedy requests go through LLM.generate three ways: plain, ngram with 3 draft tokens and
ngram with 5. Two workloads, since n-gram drafting only pays when the answer repeats its context:
  edit    "rewrite this passage with one change": the answer copies long spans of the prompt
  essay   open-ended essays: little to copy
For each: output tokens/s, the ratio to plain, engine passes, the draft acceptance rate and mean
tokens per verified draft; the greedy answers must be identical in all three (checked).
Usage: python benchmarks/bench_spec_decode.py [--num-prompts 8] [--max-tokens 96] [--max-num-seqs 8]
"""

from __future__ import annotations

import argparse
import random
import time

from cluster import LLM, SamplingParams

PASSAGES = [
    "The old lighthouse stood at the edge of the harbor for nearly two hundred years. Every night its keeper "
    "climbed the narrow stairs, trimmed the wick and polished the great lens until it shone.",
    "def moving_average(values, window):\n    result = []\n    total = 0.0\n    for i, value in enumerate(values):\n"
    "        total += value\n        if i >= window:\n            total -= values[i - window]\n"
    "        if i >= window - 1:\n            result.append(total / window)\n    return result\n",
    "Bees collect nectar from flowers and carry it back to the hive, where it is stored in wax cells. Over "
    "several days the workers fan their wings to evaporate the water, and the nectar slowly becomes honey.",
    "To bake bread, mix flour, water, salt and yeast into a dough. Knead it for ten minutes, let it rise "
    "until doubled, shape it into a loaf, let it rise again, and bake it in a hot oven for forty minutes.",
]
TOPICS = ["the history of Paris", "how rainbows form", "the rules of chess", "why the sky is blue"]


def make_prompts(tokenizer, kind: str, n: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for i in range(n):
        if kind == "edit":
            passage = PASSAGES[i % len(PASSAGES)]
            content = (f"Rewrite the following text exactly as it is, but replace the word 'the' with 'a' "
                       f"once:\n\n{passage}")
        else:
            content = f"Write a detailed essay about {TOPICS[i % len(TOPICS)]} (#{rng.randint(0, 999)})."
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def measure(prompts, max_tokens: int, max_num_seqs: int, spec: dict | None):
    llm = LLM(max_num_seqs=max_num_seqs, speculative_config=spec)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
        before = llm.get_stats()[0]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        after = llm.get_stats()[0]
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return {"answers": [o.outputs[0].token_ids for o in outputs], "tok_s": tokens / elapsed,
            "steps": after.num_steps - before.num_steps, "acceptance": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_len": 1 + accepted / drafts if drafts else 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="Batch size cap (1: one request at a time).")
    args = parser.parse_args()
    from gpu_worker.model_resolver import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct").model_dir)
    configs = [("plain", None),
               ("ngram k=3", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                              "prompt_lookup_max": 4}),
               ("ngram k=5", {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
                              "prompt_lookup_max": 4})]
    print(f"{args.num_prompts} prompts x {args.max_tokens} tokens, greedy, max_num_seqs={args.max_num_seqs}")
    print(f"{'workload':8} {'mode':10} {'tok/s':>8} {'vs plain':>9} {'passes':>7} {'accepted':>9} {'tok/draft':>10}")
    for kind in ("edit", "essay"):
        prompts = make_prompts(tokenizer, kind, args.num_prompts)
        base = None
        for name, spec in configs:
            r = measure(prompts, args.max_tokens, args.max_num_seqs, spec)
            if base is None:
                base = r
            same = r["answers"] == base["answers"]
            print(f"{kind:8} {name:10} {r['tok_s']:8.1f} {r['tok_s'] / base['tok_s']:8.2f}x {r['steps']:7d} "
                  f"{r['acceptance']:8.0%} {r['mean_len']:10.2f}" + ("" if same else "  ANSWERS DIFFER"))


if __name__ == "__main__":
    main()
