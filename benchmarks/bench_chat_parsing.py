"""What the chat output parsers (reasoning, tool calls) cost per streamed chunk, beside the plain
path that encodes the chunk alone, in one run.

Each case streams the same kind of answer, in pieces of about one token (4 characters), through
the router's per-chunk work: the parser's ``feed`` (and ``finish`` at the end) and the chunk's JSON
encoding. Prints microseconds per chunk and the ratio to the plain path.
Usage: python benchmarks/bench_chat_parsing.py [--chunks-per-answer 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.chat_parsing import ChatOutputParser
from router.reasoning_parsers import create_reasoning_parser
from router.serving import chat_token_chunk
from router.tool_parsers import (
    HermesToolCallParser,
    Llama3JsonToolCallParser,
    PythonicToolCallParser,
    RequiredToolCallParser,
)


def answers(size: int) -> dict[str, str]:
    """Answers of about ``size`` chunks each, in each case's format."""
    words = " ".join(f"word{i}" for i in range(size))[: size * 4]
    arguments = json.dumps({"query": words[: size * 2], "limit": 10})
    thinking = words[: size * 2]
    return {
        "plain": words,
        "hermes": f"Let me look. <tool_call>{json.dumps({'name': 'search', 'arguments': json.loads(arguments)})}"
                  "</tool_call>",
        "required": json.dumps([{"name": "search", "parameters": json.loads(arguments)}]),
        "llama3_json": json.dumps({"name": "search", "parameters": json.loads(arguments)}),
        "pythonic": f'[search(query="{words[: size * 2]}", limit=10)]',
        "deepseek_r1 + hermes": f"{thinking}</think><tool_call>{json.dumps({'name': 'search', 'arguments': {}})}"
                                "</tool_call>",
    }


PARSERS: dict[str, Callable[[], ChatOutputParser | None]] = {
    "plain": lambda: None,
    "hermes": lambda: ChatOutputParser(None, HermesToolCallParser()),
    "required": lambda: ChatOutputParser(None, RequiredToolCallParser()),
    "llama3_json": lambda: ChatOutputParser(None, Llama3JsonToolCallParser()),
    "pythonic": lambda: ChatOutputParser(None, PythonicToolCallParser()),
    "deepseek_r1 + hermes": lambda: ChatOutputParser(create_reasoning_parser("deepseek_r1"), HermesToolCallParser()),
}


def stream_once(parser: ChatOutputParser | None, pieces: list[str]) -> int:
    """The router's per-chunk work for one answer; returns the bytes it would send."""
    sent = 0
    last = len(pieces) - 1
    for i, piece in enumerate(pieces):
        finish = "stop" if i == last else None
        if parser is None:
            sent += len(chat_token_chunk("chatcmpl-1", 0, "m", 0, piece, None, finish))
            continue
        parsed = parser.feed(piece)
        if finish is not None:
            parsed.extend(parser.finish())
            finish = parser.finish_reason(finish)
        if parsed or finish:
            sent += len(chat_token_chunk("chatcmpl-1", 0, "m", 0, parsed.content, None, finish, parsed))
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks-per-answer", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--answers-per-round", type=int, default=50)
    args = parser.parse_args()
    texts = answers(args.chunks_per_answer)
    pieces = {name: [text[i:i + 4] for i in range(0, len(text), 4)] for name, text in texts.items()}
    timings: dict[str, list[float]] = {name: [] for name in PARSERS}
    for _ in range(args.rounds):  # the cases alternate, so machine noise hits them alike
        for name, make in PARSERS.items():
            t0 = time.perf_counter()
            for _ in range(args.answers_per_round):
                stream_once(make(), pieces[name])
            elapsed = time.perf_counter() - t0
            timings[name].append(elapsed / (args.answers_per_round * len(pieces[name])) * 1e6)
    base = statistics.median(timings["plain"])
    print(f"{args.rounds} rounds x {args.answers_per_round} answers, about {args.chunks_per_answer} chunks "
          "of 4 characters each\n")
    print(f"{'case':<22}{'chunks':>8}{'us/chunk (median)':>20}{'vs plain':>10}")
    for name in PARSERS:
        median = statistics.median(timings[name])
        print(f"{name:<22}{len(pieces[name]):>8}{median:>20.2f}{median / base:>10.2f}")


if __name__ == "__main__":
    main()
