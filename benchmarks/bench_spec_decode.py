"""Speculative decoding (n-gram and suffix drafts, a draft model) vs plain decoding on SmolLM2-135M-Instruct,
in one run.

The same greedy requests go through LLM.generate several ways: plain, ngram with 3 draft tokens and
ngram with 5, suffix decoding with at most 8 and 24 (its default), and with ``--draft-layers N`` a
draft model: SmolLM2's own first N layers with its final norm and head (a layer-skip draft;
SmolLM2-135M is the smallest model shipped here, so no smaller relative exists). Several workloads,
since model-free drafting only pays when the answer repeats what was seen:
  edit    "rewrite this passage with one change": the answer copies long spans of the prompt
  essay   open-ended essays: little to copy
  json    records copied out of a text into a JSON schema (structured output: drafts are cut at the
          first token the grammar refuses, each position verified under its mask)
  again   the essays asked a second time (an agent's retries, resampled questions): suffix decoding
          drafts from the answers it keeps
For each: output tokens/s, the ratio to plain, engine passes, the draft acceptance rate and mean
tokens per verified draft; the greedy answers must be identical in all three (checked).
``--granite-hybrid``: the same on a model with recurrent layers, the random Granite 4.0-H of
SmolLM2-135M's widths of bench_recurrent_prefix_cache.py (Mamba-2 layers, one attention layer in
six), whose verifying passes take each request's tokens one at a time through the recurrent layers
and keep the state before each draft; its answers are a random model's, so only the essays (nothing
to copy) and their second asking (suffix decoding's own answers to draft from) are run.
Usage: python benchmarks/bench_spec_decode.py [--num-prompts 8] [--max-tokens 96] [--max-num-seqs 8]
       [--draft-layers 10] [--granite-hybrid]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

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
PEOPLE = [("Alice Martin", "Lyon", "a baker who opens her shop at five every morning"),
          ("Tomas Berg", "Oslo", "a ship engineer who repairs ferry engines"),
          ("Mei Chen", "Taipei", "a teacher of mathematics at a secondary school"),
          ("Omar Haddad", "Amman", "a nurse on the night shift of a city hospital")]
RECORD_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                                  "description": {"type": "string"}},
                 "required": ["name", "city", "description"], "additionalProperties": False}


def make_prompts(tokenizer, kind: str, n: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for i in range(n):
        if kind == "edit":
            passage = PASSAGES[i % len(PASSAGES)]
            content = (f"Rewrite the following text exactly as it is, but replace the word 'the' with 'a' "
                       f"once:\n\n{passage}")
        elif kind == "json":
            name, city, what = PEOPLE[i % len(PEOPLE)]
            content = (f"Here is a note: {name} lives in {city} and is {what}. Return a JSON object with the "
                       f"keys name, city and description, copying the words of the note.")
        else:
            content = f"Write a detailed essay about {TOPICS[i % len(TOPICS)]} (#{rng.randint(0, 999)})."
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def layer_skip_draft(model_dir: Path, num_layers: int, out_dir: Path) -> Path:
    """A draft model made of ``model_dir``'s first ``num_layers`` layers, its final norm and its head."""
    from safetensors.torch import load_file, save_file

    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out_dir / name)
    config = json.loads((model_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}))
    kept = {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
            continue
        kept[name] = tensor
    save_file(kept, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def measure(prompts, max_tokens: int, max_num_seqs: int, spec: dict | None, structured: dict | None = None,
            asked_before: bool = False, **llm_flags):
    """One engine (the default model, unless ``llm_flags`` name another) through the prompts, after a
    warm-up (``asked_before``: the same prompts answered once already): its greedy answers, output
    tokens/s, passes, acceptance rate and tokens per draft."""
    llm = LLM(max_num_seqs=max_num_seqs, speculative_config=spec, **llm_flags)
    try:
        params = (SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) if structured is None
                  else SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=structured))
        # Warm-up (and the grammar compiled: its wait is not a pass of the measured work).
        llm.generate(prompts if asked_before else [prompts[0]],
                     params if asked_before else SamplingParams(max_tokens=8, temperature=0.0,
                                                                structured_outputs=structured), use_tqdm=False)
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


def drafter_bench(description: str, vocab_size: int) -> tuple[argparse.Namespace, list[list[int]]]:
    """The arguments of a drafter's benchmark on a random target (bench_mtp, bench_eagle) and its
    random prompts; prints the header."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="Batch size cap (1: one request at a time).")
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab_size) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    print(f"{args.num_prompts} prompts of {args.prompt_len} tokens x {args.max_tokens} tokens, greedy, "
          f"max_num_seqs={args.max_num_seqs}, fp32, {torch.get_num_threads()} threads")
    print(f"{'model':10} {'mode':11} {'tok/s':>8} {'vs plain':>9} {'passes':>7} {'accepted':>9}")
    return args, prompts


def report_modes(variant: str, model: Path, modes: list[tuple[str, dict | None]], prompts: list[list[int]],
                 args: argparse.Namespace) -> None:
    """Each mode (the first: plain decoding) on ``model``, a line each: tokens/s, the ratio to the
    first, passes, acceptance; answers that differ from the first's are flagged."""
    base = None
    for name, spec in modes:
        r = measure(prompts, args.max_tokens, args.max_num_seqs, spec, model=str(model), dtype="float32",
                    max_model_len=512)
        base = base or r
        same = r["answers"] == base["answers"]
        print(f"{variant:10} {name:11} {r['tok_s']:8.1f} {r['tok_s'] / base['tok_s']:8.2f}x {r['steps']:7d} "
              f"{r['acceptance']:8.0%}" + ("" if same else "  ANSWERS DIFFER"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="Batch size cap (1: one request at a time).")
    parser.add_argument("--draft-layers", type=int, default=0,
                        help="Also a draft model of SmolLM2's first N of its 30 layers (0: none).")
    parser.add_argument("--granite-hybrid", action="store_true",
                        help="A random Granite 4.0-H of SmolLM2's widths (recurrent layers) instead of SmolLM2.")
    args = parser.parse_args()
    from gpu_worker.model_resolver import load_tokenizer, resolve_model

    model_dir = Path(resolve_model("SmolLM2-135M-Instruct").model_dir)
    tokenizer = load_tokenizer(model_dir)
    configs = [("plain", None),
               ("ngram k=3", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                              "prompt_lookup_max": 4}),
               ("ngram k=5", {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
                              "prompt_lookup_max": 4}),
               ("suffix k=8", {"method": "suffix", "num_speculative_tokens": 8}),
               ("suffix k=24", {"method": "suffix"})]
    scratch = tempfile.TemporaryDirectory()
    flags: dict = {}
    workloads = ("edit", "essay", "json", "again")
    if args.granite_hybrid:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_recurrent_prefix_cache import build_model

        flags = {"model": str(build_model(Path(scratch.name), 12)), "dtype": "float32", "max_model_len": 2048}
        workloads = ("essay", "again")
        print("model: a random Granite 4.0-H of SmolLM2-135M's widths, 12 layers (10 Mamba-2, 2 attention)")
    if args.draft_layers:
        draft = layer_skip_draft(model_dir, args.draft_layers, Path(scratch.name))
        configs.append((f"draft L{args.draft_layers} k=3", {"model": str(draft), "num_speculative_tokens": 3}))
    print(f"{args.num_prompts} prompts x {args.max_tokens} tokens, greedy, max_num_seqs={args.max_num_seqs}")
    print(f"{'workload':8} {'mode':14} {'tok/s':>8} {'vs plain':>9} {'passes':>7} {'accepted':>9} {'tok/draft':>10}")
    for kind in workloads:
        prompts = make_prompts(tokenizer, "essay" if kind == "again" else kind, args.num_prompts)
        base = None
        for name, spec in configs:
            r = measure(prompts, args.max_tokens, args.max_num_seqs, spec,
                        {"json": RECORD_SCHEMA} if kind == "json" else None, asked_before=kind == "again", **flags)
            if base is None:
                base = r
            same = r["answers"] == base["answers"]
            print(f"{kind:8} {name:14} {r['tok_s']:8.1f} {r['tok_s'] / base['tok_s']:8.2f}x {r['steps']:7d} "
                  f"{r['acceptance']:8.0%} {r['mean_len']:10.2f}" + ("" if same else "  ANSWERS DIFFER"))


if __name__ == "__main__":
    main()
