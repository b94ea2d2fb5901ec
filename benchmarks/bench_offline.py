"""Offline throughput on SmolLM2-135M-Instruct: our LLM.generate vs transformers, in one run.

64 chat prompts of ~200 tokens, 128 output tokens each, greedy, ignore_eos. Compared:
  ours        LLM.generate, 1 engine, TP=1 (in-process engine)
  hf-seq      transformers generate, one prompt at a time (on --seq-prompts of the prompts; tokens/s
              does not depend on how many prompts are timed)
  hf-batched  transformers generate, left padding, batch = all prompts
Also prints the engine overhead: the share of engine step time spent outside the model forward.
Usage: python benchmarks/bench_offline.py [--num-prompts 64] [--max-tokens 128] [--seq-prompts 4]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from cluster import LLM, SamplingParams

TOPICS = ["the history of Paris", "how rainbows form", "the rules of chess", "why the sky is blue",
          "how bread is baked", "the life of honey bees", "how a steam engine works", "the water cycle"]


def make_prompts(tokenizer, n: int, target_tokens: int = 200, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = ("light river stone garden market winter engine harbor music orchard lantern valley signal "
             "copper meadow bridge thunder candle forest mirror").split()
    prompts = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        filler = " ".join(rng.choice(words) for _ in range(400))
        content = f"Write a detailed essay about {topic}. Background notes: {filler}"
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        # Trim the notes so the rendered prompt is ~target_tokens long (uniform within +-25%, as real
        # prompts differ), keeping the template's tail.
        length = rng.randint(target_tokens * 3 // 4, target_tokens * 5 // 4)
        head, tail = ids[: length - 8], ids[-8:]
        prompts.append(head + tail)
    return prompts


class ForwardTimer:
    """Wraps the model's forward and its LM head (logits) to add up the time spent in the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.total = 0.0
        for name in ("forward", "compute_logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.total += time.perf_counter() - t0
            return out

        return timed


def bench_ours(model: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
    longest = max(map(len, prompts))
    llm = LLM(model=model, max_num_seqs=len(prompts), max_num_batched_tokens=4096, max_model_len=2048,
              num_gpu_blocks=len(prompts) * ((longest + max_tokens) // 16 + 2))
    engine = llm._engine
    assert engine is not None
    runner = engine.executor.worker.runner
    timer = ForwardTimer(runner.model)
    step_time = 0.0
    original_step = engine.step

    def timed_step():
        nonlocal step_time
        t0 = time.perf_counter()
        out = original_step()
        step_time += time.perf_counter() - t0
        return out

    engine.step = timed_step
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    timer.total, step_time = 0.0, 0.0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    overhead = 1.0 - timer.total / step_time if step_time else 0.0
    llm.shutdown()
    return tokens / elapsed, overhead, tokens


def bench_hf(model_dir: str, prompts: list[list[int]], max_tokens: int, batched: bool) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    kwargs = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False, "pad_token_id": pad}
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), **(kwargs | {"max_new_tokens": 2, "min_new_tokens": 2}))
        t0 = time.perf_counter()
        if batched:
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            out = model.generate(ids, attention_mask=mask, **kwargs)
            tokens = (out.shape[1] - width) * len(prompts)
        else:
            tokens = 0
            for p in prompts:
                out = model.generate(torch.tensor([p]), **kwargs)
                tokens += out.shape[1] - len(p)
        return tokens / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seq-prompts", type=int, default=4)
    args = parser.parse_args()
    from gpu_worker.model_resolver import load_tokenizer, resolve_model

    model_dir = str(resolve_model("SmolLM2-135M-Instruct").model_dir)
    prompts = make_prompts(load_tokenizer(model_dir), args.num_prompts)
    mean_len = sum(map(len, prompts)) / len(prompts)
    print(f"SmolLM2-135M-Instruct fp32, {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens (mean {mean_len:.0f}), "
          f"{args.max_tokens} output tokens, greedy, torch threads={torch.get_num_threads()}\n")
    ours, overhead, tokens = bench_ours(model_dir, prompts, args.max_tokens)
    print(f"ours        LLM.generate       {ours:8.1f} output tokens/s  ({tokens} tokens)")
    seq = bench_hf(model_dir, prompts[: args.seq_prompts], args.max_tokens, batched=False)
    print(f"hf-seq      generate, batch 1  {seq:8.1f} output tokens/s  ({args.seq_prompts} prompts timed)")
    batched = bench_hf(model_dir, prompts, args.max_tokens, batched=True)
    print(f"hf-batched  generate, batch {len(prompts):<3}{batched:8.1f} output tokens/s")
    print(f"\nours / hf-seq     = {ours / seq:5.2f}x   (target >= 4x)")
    print(f"ours / hf-batched = {ours / batched:5.2f}x   (target >= 1.5x)")
    print(f"engine overhead (step time outside the model forward) = {overhead * 100:.1f}%   (target < 5%)")


if __name__ == "__main__":
    main()
