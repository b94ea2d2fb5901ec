"""Embeddings (LLM.embed, what /v1/embeddings runs) against transformers on the same texts, in one run.

SmolLM2-135M-Instruct on this machine's device, fp32: the same texts embedded by
  ours           LLM.embed: the engine's scheduler batches the prompts into passes of
                 --max-num-batched-tokens (no padding), last-token pooling, L2-normalised
  transformers   the HF model in batches of --hf-batch-size texts, left-padded with an attention
                 mask, the last position's final hidden state, L2-normalised
With --bert, a BERT encoder at all-MiniLM-L6-v2's shapes (6 layers, 384 wide, 12 heads; random
weights, a small WordPiece vocabulary) saved with sentence-transformers files for MEAN pooling and
normalisation, as all-MiniLM ships:
  ours           LLM.embed: whole prompts per pass, bidirectional attention, no KV cache
  transformers   BertModel in batches, right-padded with an attention mask, the masked mean of the
                 final hidden states (sentence-transformers' MEAN pooling), L2-normalised
With --nomic, a NomicBERT encoder (rotary positions, SwiGLU; 6 layers, 384 wide, 12 heads; random
weights, the small WordPiece vocabulary) with MEAN-pooling sentence-transformers files, as
nomic-embed-text ships, against transformers' NomicBertModel the same way.
With --reward, a process reward model (Qwen2.5-Math-PRM's architecture, Qwen2ForProcessRewardModel:
8 layers, 512 wide; random weights, our small tokenizer) scoring texts of reasoning steps, each step
closed by the step separator "<extra_0>":
  ours           LLM.reward: chunked prefill, STEP pooling (the score head's two class
                 probabilities at each separator)
  transformers   Qwen2Model and the same score head (Linear, ReLU, Linear) in right-padded batches
                 with an attention mask, the softmax at each separator, as its reference code does
Rounds alternate between the two, each round with texts of its own (the engine's prefix cache would
otherwise answer a repeated text from its cached blocks); prints each one's median texts/s, the
ratio, and the largest difference between the two embeddings of any text (they must agree to float
rounding).
Usage: python benchmarks/bench_embeddings.py [--num-texts 256] [--rounds 3] [--hf-batch-size 32]
                                            [--bert | --nomic | --reward]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from cluster import LLM

WORDS = ("the cluster serves many models on engines with paged attention while the router streams tokens "
         "to clients that ask about rivers mountains cities history science music and food").split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(8, 120))) for _ in range(n)]


def hf_embed(model, tokenizer, texts: list[str], batch_size: int, device: torch.device) -> torch.Tensor:
    out = []
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(texts[i:i + batch_size], return_tensors="pt", padding=True).to(device)
        with torch.inference_mode():
            hidden = model.model(**batch).last_hidden_state[:, -1]  # (left padding: the last position is real)
        out.append(torch.nn.functional.normalize(hidden.float(), dim=-1).cpu())
    return torch.cat(out)


def hf_mean_embed(model, tokenizer, texts: list[str], batch_size: int, device: torch.device) -> torch.Tensor:
    """sentence-transformers' MEAN pooling over a right-padded batch, L2-normalised."""
    out = []
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(texts[i:i + batch_size], return_tensors="pt", padding=True).to(device)
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        mean = (hidden * mask).sum(1) / mask.sum(1)
        out.append(torch.nn.functional.normalize(mean.float(), dim=-1).cpu())
    return torch.cat(out)


def make_steps(n: int, seed: int = 0) -> list[str]:
    """Texts of 2 to 8 reasoning steps of random words, each closed by the step separator."""
    rng = random.Random(seed)
    return ["".join(" ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 24))) + "<extra_0>"
                    for _ in range(rng.randrange(2, 9))) for _ in range(n)]


def hf_step_rewards(reference, tokenizer, texts: list[str], batch_size: int, device: torch.device) -> torch.Tensor:
    """A process reward model's two class probabilities at each step separator, every text's rows
    one after another (right-padded batches, as its reference code runs)."""
    tag = tokenizer.convert_tokens_to_ids("<extra_0>")
    out = []
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(texts[i:i + batch_size], return_tensors="pt", padding=True).to(device)
        with torch.inference_mode():
            probs = torch.softmax(reference.score(reference.model(**batch).last_hidden_state), dim=-1)
        out.extend(row[ids == tag].cpu() for row, ids in zip(probs, batch["input_ids"], strict=True))
    return torch.cat(out)


def save_minilm_shaped_bert(path: Path, nomic: bool = False) -> Path:
    """A random BERT at all-MiniLM-L6-v2's shapes (``nomic``: a NomicBERT of the same size), with
    MEAN-pooling sentence-transformers files."""
    from transformers import BertConfig, BertModel, NomicBertConfig, NomicBertModel

    from tests.tiny_model import _write_sentence_transformers_files, build_wordpiece_tokenizer

    tokenizer = build_wordpiece_tokenizer(WORDS)
    torch.manual_seed(0)
    shape = dict(vocab_size=30522, hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                 num_attention_heads=12, max_position_embeddings=512)
    model = NomicBertModel(NomicBertConfig(**shape)) if nomic else BertModel(BertConfig(**shape))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _write_sentence_transformers_files(path, "pooling_mode_mean_tokens", normalize=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-texts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--bert", action="store_true", help="a BERT encoder at all-MiniLM-L6-v2's shapes")
    parser.add_argument("--nomic", action="store_true", help="a NomicBERT encoder (rotary, SwiGLU), MEAN pooling")
    parser.add_argument("--reward", action="store_true", help="a process reward model scoring reasoning steps")
    args = parser.parse_args()

    import tempfile

    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    make = make_steps if args.reward else make_texts
    rounds = [make(args.num_texts, seed=r + 1) for r in range(args.rounds)]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run_ours = "embed"
    if args.reward:
        from tests.tiny_model import build_tiny_reward_model

        model_dir = tempfile.mkdtemp(prefix="bench-prm-")
        reward_reference = build_tiny_reward_model(Path(model_dir), hidden=512, num_layers=8, max_positions=1024)
        reward_reference.model.to(device)
        reward_reference.score.to(device)
        llm = LLM(model=model_dir, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256,
                  dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        run_ours = "reward"

        def reference_embed(texts: list[str]) -> torch.Tensor:
            return hf_step_rewards(reward_reference, tokenizer, texts, args.hf_batch_size, device)
    elif args.bert or args.nomic:
        model_dir = str(save_minilm_shaped_bert(Path(tempfile.mkdtemp(prefix="bench-bert-")), nomic=args.nomic))
        llm = LLM(model=model_dir, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256,
                  dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()

        def reference_embed(texts: list[str]) -> torch.Tensor:
            return hf_mean_embed(model, tokenizer, texts, args.hf_batch_size, device)
    else:
        llm = LLM(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256, dtype="float32")
        model_dir = llm.model_dir
        tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()

        def reference_embed(texts: list[str]) -> torch.Tensor:
            return hf_embed(model, tokenizer, texts, args.hf_batch_size, device)
    num_tokens = statistics.mean(sum(len(tokenizer.encode(t)) for t in texts) for texts in rounds)
    rates: dict[str, list[float]] = {"ours": [], "transformers": []}
    ours = reference = None
    try:
        warmup = make(4, seed=0)
        getattr(llm, run_ours)(warmup, use_tqdm=False)
        reference_embed(warmup)
        for r, texts in enumerate(rounds):
            for name in (("ours", "transformers") if r % 2 == 0 else ("transformers", "ours")):
                t0 = time.perf_counter()
                if name == "ours" and args.reward:
                    ours = torch.cat([o.outputs.data for o in llm.reward(texts, use_tqdm=False)])
                elif name == "ours":
                    ours = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
                else:
                    reference = reference_embed(texts)
                rates[name].append(len(texts) / (time.perf_counter() - t0))
    finally:
        llm.shutdown()
    assert ours is not None and reference is not None
    ours_rate, hf_rate = statistics.median(rates["ours"]), statistics.median(rates["transformers"])
    model_name = ("process reward model (8 layers, 512 wide), " if args.reward
                  else "NomicBERT (6 layers, 384 wide), " if args.nomic
                  else "BERT (all-MiniLM-L6-v2 shapes), " if args.bert else "")
    print(f"\n{model_name}{args.num_texts} texts a round (about {num_tokens:.0f} tokens), {args.rounds} rounds, "
          f"device {device}, "
          f"budget {args.max_num_batched_tokens} tokens per pass, HF batches of {args.hf_batch_size}\n")
    print(f"{'':<14}{'texts/s':>10}{'tokens/s':>12}{'vs transformers':>18}")
    for name, rate in (("ours", ours_rate), ("transformers", hf_rate)):
        print(f"{name:<14}{rate:>10.1f}{rate * num_tokens / args.num_texts:>12.0f}{rate / hf_rate:>17.2f}x")
    what = "step probabilities" if args.reward else "embeddings of a text"
    print(f"\nlargest difference between the two {what}: {(ours - reference).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
