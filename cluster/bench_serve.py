"""``llm-cluster bench serve``: load an OpenAI-compatible server and report its latencies, as vLLM's
``vllm bench serve`` does (same flags and same report), against this service or any other (vLLM's
own included, for a comparison on the same machines).

Random prompts (vLLM's random dataset) are ``--random-input-len`` tokens each (within
``--random-range-ratio``), after an optional shared prefix of ``--random-prefix-len`` tokens, drawn
from token ids the server's own ``/tokenize`` gives for a neutral text (so they are real tokens of
its tokenizer, whatever the model), sent as token ids to ``/v1/completions`` (exact lengths) or as
their text (``/detokenize``) to ``/v1/chat/completions``. With ``--dataset-name sharegpt``, they are
the first turns of a ShareGPT file's conversations, sampled as vLLM samples them. With
``--dataset-name random-mm`` (vLLM's random multimodal dataset, for a vision-language model), each
random chat prompt also shows random-noise images, their count and sizes drawn as
``--random-mm-*`` say. Requests
stream; arrivals are Poisson at ``--request-rate`` (gamma with ``--burstiness``; ``inf``: all at
once), at most ``--max-concurrency`` in flight. Each request's
time to first token, time per output token after it, inter-token latencies and end-to-end latency
are measured here; token counts come from the server's usage (``stream_options.include_usage``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

# A neutral text whose tokens the prompts are drawn from (any tokenizer splits it into many tokens).
_SOURCE_TEXT = (
    "The quick brown fox jumps over the lazy dog while the river flows past old stone bridges, green "
    "fields, quiet villages and busy markets where people trade bread, cheese, apples, copper pots and "
    "woollen cloth. Scientists measure temperature, pressure and humidity; engineers design engines, "
    "bridges, circuits and software; musicians play violins, pianos, drums and flutes in concert halls. ")


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first generated text
    latency: float = 0.0  # seconds to the last byte
    itl: list[float] = field(default_factory=list)  # seconds between generated chunks after the first


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server (scheme, host, port).")
    parser.add_argument("--backend", default="openai", choices=["openai", "vllm", "openai-chat"],
                        help="vLLM's names: openai and vllm load /v1/completions, openai-chat /v1/chat/completions "
                             "(unless --endpoint says otherwise).")
    parser.add_argument("--endpoint", default=None, choices=["/v1/completions", "/v1/chat/completions"],
                        help="The endpoint loaded (default: the backend's).")
    parser.add_argument("--model", default=None, help="The model to ask for (default: the server's first).")
    parser.add_argument("--dataset-name", default="random", choices=["random", "random-mm", "sharegpt", "custom"],
                        help="Prompts: random token ids (vLLM's random dataset); the same with random images "
                             "(random-mm, chat only); conversations from a ShareGPT JSON file (--dataset-path): "
                             "each first turn, asking for as many tokens as its reply has; or a JSONL file of "
                             '{"prompt": ...} lines (vLLM\'s custom dataset).')
    parser.add_argument("--random-mm-base-items-per-request", type=int, default=1,
                        help="random-mm: images per prompt (before the range ratio).")
    parser.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0,
                        help="random-mm: image counts drawn uniformly within [n * (1 - r), n * (1 + r)].")
    parser.add_argument("--random-mm-limit-mm-per-prompt", type=json.loads, default={"image": 255},
                        help='random-mm: the most images a prompt shows (JSON, e.g. {"image": 4}).')
    parser.add_argument("--random-mm-bucket-config", default="{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}",
                        help="random-mm: image (height, width, frames) shapes and their probabilities, as vLLM "
                             "writes them; frames must be 1 (images: no video).")
    parser.add_argument("--custom-output-len", type=int, default=256,
                        help="Output tokens each prompt of a custom dataset asks for.")
    parser.add_argument("--dataset-path", default=None, help="The ShareGPT file (a JSON list of "
                                                              '{"conversations": [{"from", "value"}, ...]}).')
    parser.add_argument("--sharegpt-output-len", type=int, default=None,
                        help="Ask every ShareGPT prompt for this many tokens instead of its reply's length.")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="Lengths drawn uniformly within [len * (1 - r), len * (1 + r)].")
    parser.add_argument("--random-prefix-len", type=int, default=0, help="A prefix every prompt shares.")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Requests per second (inf: all sent at once, up to --max-concurrency).")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="Gamma shape of the arrival gaps (1: Poisson; lower: burstier).")
    parser.add_argument("--max-concurrency", type=int, default=None, help="Requests in flight at most.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true", help="Every answer runs to its output length.")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                        help="Which metrics get percentiles: ttft, tpot, itl, e2el.")
    parser.add_argument("--metric-percentiles", default="99", help="Which percentiles, e.g. 50,90,99.")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="Service-level objectives, e.g. ttft:500 tpot:50 e2el:8000: the report adds the "
                             "requests per second that met all of them (vLLM's goodput).")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key (default: "
                                                                                    "$OPENAI_API_KEY).")
    parser.add_argument("--save-result", action="store_true", help="Write the results as JSON.")
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--disable-tqdm", action="store_true", help="(vLLM's; no progress bar is drawn here)")


def _lengths(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


async def _post_json(session: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {(await response.text())[:300]}")
        return await response.json()


async def _server_model(session: Any, base: str) -> str:
    async with session.get(f"{base}/v1/models") as response:
        if response.status != 200:
            raise RuntimeError(f"{base}/v1/models: HTTP {response.status}")
        return (await response.json())["data"][0]["id"]


async def _token_count(session: Any, base: str, model: str, text: str) -> int:
    return (await _post_json(session, f"{base}/tokenize", {"model": model, "prompt": text,
                                                           "add_special_tokens": False}))["count"]


async def sharegpt_prompts(session: Any, base: str, model: str, args: argparse.Namespace
                           ) -> list[tuple[list[int] | str, int, int]]:
    """vLLM's ShareGPT sampling: conversations with a first turn and a reply, shuffled by the seed;
    each first turn asks for as many tokens as its reply has (counted by the server's tokenizer),
    pairs too short (under 4 tokens either side) or too long (a prompt over 1,024 tokens, both over
    2,048) left out, until ``num_prompts`` are found."""
    with open(args.dataset_path, encoding="utf-8") as f:
        data = json.load(f)
    def turns(entry: Any) -> tuple[str, str] | None:
        conversation = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(conversation, list) or len(conversation) < 2:
            return None
        values = [turn.get("value") if isinstance(turn, dict) else None for turn in conversation[:2]]
        return (values[0], values[1]) if all(isinstance(v, str) and v for v in values) else None

    pairs = [pair for entry in (data if isinstance(data, list) else []) if (pair := turns(entry)) is not None]
    random.Random(args.seed).shuffle(pairs)
    prompts: list[tuple[list[int] | str, int, int]] = []
    batch = 32  # (conversations tokenized at once)
    for at in range(0, len(pairs), batch):
        if len(prompts) == args.num_prompts:
            break
        chunk = pairs[at:at + batch]
        prompt_lens = await asyncio.gather(*(_token_count(session, base, model, p) for p, _ in chunk))
        reply_lens = ([args.sharegpt_output_len] * len(chunk) if args.sharegpt_output_len else
                      await asyncio.gather(*(_token_count(session, base, model, r) for _, r in chunk)))
        for (prompt, _), prompt_len, output_len in zip(chunk, prompt_lens, reply_lens, strict=True):
            if len(prompts) == args.num_prompts or prompt_len < 4 or (output_len < 4 and not args.sharegpt_output_len):
                continue
            if prompt_len > 1024 or prompt_len + output_len > 2048:
                continue
            prompts.append((prompt, prompt_len, output_len))
    if len(prompts) < args.num_prompts:
        raise RuntimeError(f"{args.dataset_path}: {len(prompts)} usable conversations, {args.num_prompts} asked")
    return prompts


async def custom_prompts(session: Any, base: str, model: str, args: argparse.Namespace
                         ) -> list[tuple[list[int] | str, int, int]]:
    """vLLM's custom dataset: a JSONL file's ``prompt`` fields, in order (repeated to ``num_prompts``
    when the file has fewer), each asking for ``--custom-output-len`` tokens."""
    texts = []
    with open(args.dataset_path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                entry = json.loads(line)
                if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
                    raise RuntimeError(f"{args.dataset_path}:{number}: expected a JSON object with a \"prompt\" string")
                texts.append(entry["prompt"])
    if not texts:
        raise RuntimeError(f"{args.dataset_path}: no prompts")
    chosen = [texts[i % len(texts)] for i in range(args.num_prompts)]
    return [(text, await _token_count(session, base, model, text), args.custom_output_len) for text in chosen]


async def make_prompts(session: Any, base: str, model: str, args: argparse.Namespace
                       ) -> list[tuple[list[int] | str | list[dict[str, Any]], int, int]]:
    """(prompt, its token count, output tokens asked) per request."""
    if args.dataset_name == "sharegpt":
        return await sharegpt_prompts(session, base, model, args)
    if args.dataset_name == "custom":
        return await custom_prompts(session, base, model, args)
    rng = random.Random(args.seed)
    images = random_mm_images(args, rng) if args.dataset_name == "random-mm" else None
    pool = (await _post_json(session, f"{base}/tokenize", {"model": model, "prompt": _SOURCE_TEXT * 4,
                                                           "add_special_tokens": False}))["tokens"]
    if not pool:
        raise RuntimeError("the server's /tokenize gave no tokens")

    def draw(n: int) -> list[int]:
        return [pool[rng.randrange(len(pool))] for _ in range(n)]

    prefix = draw(args.random_prefix_len)
    inputs = _lengths(args.random_input_len, args.random_range_ratio, args.num_prompts, rng)
    outputs = _lengths(args.random_output_len, args.random_range_ratio, args.num_prompts, rng)
    prompts: list[tuple[list[int] | str | list[dict[str, Any]], int, int]] = []
    for index, (input_len, output_len) in enumerate(zip(inputs, outputs, strict=True)):
        ids = prefix + draw(input_len)
        if args.endpoint == "/v1/chat/completions":
            text = (await _post_json(session, f"{base}/detokenize", {"model": model, "tokens": ids}))["prompt"]
            if images is not None:  # (the text, then the images, as OpenAI parts)
                parts = [{"type": "text", "text": text},
                         *({"type": "image_url", "image_url": {"url": url}} for url in images[index])]
                prompts.append((parts, len(ids), output_len))
            else:
                prompts.append((text, len(ids), output_len))
        else:
            prompts.append((ids, len(ids), output_len))
    return prompts


def parse_bucket_config(text: str) -> list[tuple[tuple[int, int], float]]:
    """vLLM's --random-mm-bucket-config, '{(height, width, frames): probability, ...}': the image
    shapes with their weights (frames must be 1; shapes of probability 0 are left out)."""
    import ast

    try:
        buckets = ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"--random-mm-bucket-config must be a dict of (height, width, frames): probability, "
                         f"got {text!r} ({e})") from None
    if not isinstance(buckets, dict) or not buckets:
        raise ValueError(f"--random-mm-bucket-config must be a non-empty dict, got {text!r}")
    shapes = []
    for key, weight in buckets.items():
        if (not isinstance(key, tuple) or len(key) != 3 or not all(isinstance(n, int) and n >= 1 for n in key)
                or not isinstance(weight, int | float) or weight < 0):
            raise ValueError(f"--random-mm-bucket-config: {key!r}: {weight!r} is not (height, width, frames): "
                             "probability")
        if weight and key[2] != 1:
            raise ValueError(f"--random-mm-bucket-config: {key!r} has {key[2]} frames: only images (1 frame) "
                             "are generated")
        if weight:
            shapes.append(((key[0], key[1]), float(weight)))
    if not shapes:
        raise ValueError("--random-mm-bucket-config gives every shape probability 0")
    return shapes


def random_mm_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the random-mm flags (as vLLM checks them), or None."""
    if args.endpoint != "/v1/chat/completions":
        return "--dataset-name random-mm loads /v1/chat/completions (--backend openai-chat)"
    if args.random_mm_base_items_per_request < 0:
        return "--random-mm-base-items-per-request must be at least 0"
    if not 0 <= args.random_mm_num_mm_items_range_ratio <= 1:
        return "--random-mm-num-mm-items-range-ratio must be in [0, 1]"
    limits = args.random_mm_limit_mm_per_prompt
    if not isinstance(limits, dict) or not isinstance(limits.get("image"), int) or limits["image"] < 0:
        return '--random-mm-limit-mm-per-prompt must give the images\' limit, e.g. {"image": 4}'
    if limits["image"] < math.floor(args.random_mm_base_items_per_request
                                    * (1 - args.random_mm_num_mm_items_range_ratio)):
        return "--random-mm-base-items-per-request (within its range ratio) is beyond --random-mm-limit-mm-per-prompt"
    try:
        parse_bucket_config(args.random_mm_bucket_config)
    except ValueError as e:
        return str(e)
    return None


def random_mm_images(args: argparse.Namespace, rng: random.Random) -> list[list[str]]:
    """Per prompt, its random-noise images (JPEG data URLs): as many as the base count within the
    range ratio (at most the limit), each of a shape drawn by the bucket weights."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    shapes = parse_bucket_config(args.random_mm_bucket_config)
    limit = args.random_mm_limit_mm_per_prompt["image"]
    base, ratio = args.random_mm_base_items_per_request, args.random_mm_num_mm_items_range_ratio
    low, high = max(0, math.floor(base * (1 - ratio))), min(limit, math.ceil(base * (1 + ratio)))
    if low > high:
        raise ValueError(f"--random-mm-base-items-per-request {base} is beyond the limit of {limit} images")
    noise = np.random.default_rng(args.seed)
    out = []
    for _ in range(args.num_prompts):
        urls = []
        for _ in range(rng.randint(low, high)):
            (height, width), = rng.choices([shape for shape, _ in shapes], [w for _, w in shapes])
            buffer = io.BytesIO()
            Image.fromarray(noise.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="JPEG")
            urls.append("data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode())
        out.append(urls)
    return out


def sse_data(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The ``data`` of each complete server-sent event in ``buffer`` (events end at a blank line,
    with LF or CRLF line ends; comments and other fields are left out), and what is left of it."""
    buffer = buffer.replace(b"\r\n", b"\n")
    events = []
    while b"\n\n" in buffer:
        event, buffer = buffer.split(b"\n\n", 1)
        data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            events.append(b"\n".join(data))
    return events, buffer


async def one_request(session: Any, url: str, body: dict[str, Any], chat: bool) -> RequestResult:
    """One streamed request: its timings, and its token counts from the server's usage (without
    usage, a chunk of text counts as a token). A stream that ends with no text, or that carries an
    error, failed."""
    result = RequestResult()
    start = time.perf_counter()
    last = start
    chunks = 0
    usage_seen = False

    def take(data: bytes) -> None:
        nonlocal last, chunks, usage_seen
        if data.strip() == b"[DONE]":
            return
        message = json.loads(data)
        now = time.perf_counter()
        if message.get("error"):
            error = message["error"]
            result.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return
        if message.get("usage"):
            usage_seen = True
            result.prompt_tokens = message["usage"].get("prompt_tokens") or 0
            result.output_tokens = message["usage"].get("completion_tokens") or 0
        choices = message.get("choices") or []
        if not choices:
            return
        if chat:  # (a reasoning model's thinking is generated text too)
            delta = choices[0].get("delta") or {}
            text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
        else:
            text = choices[0].get("text")
        if text:
            chunks += 1
            if result.ttft == 0.0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now

    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            buffer = b""
            async for chunk in response.content.iter_any():
                events, buffer = sse_data(buffer + chunk)
                for data in events:
                    take(data)
            events, _ = sse_data(buffer + b"\n\n")  # (a last event without its blank line)
            for data in events:
                take(data)
            result.latency = time.perf_counter() - start
            if not usage_seen:
                result.output_tokens = chunks
            result.success = not result.error and (result.ttft > 0.0 or (usage_seen and result.output_tokens == 0))
            if not result.success and not result.error:
                result.error = "the stream ended with no generated text"
    except Exception as e:  # (a refused connection, a reset, a malformed event: failed, the run goes on)
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        model = args.model or await _server_model(session, base)
        prompts = await make_prompts(session, base, model, args)
        chat = args.endpoint == "/v1/chat/completions"
        url = f"{base}{args.endpoint}"
        rng = random.Random(args.seed + 1)
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def send(prompt: list[int] | str | list[dict[str, Any]], output_len: int) -> RequestResult:
            body: dict[str, Any] = {"model": model, "max_tokens": output_len, "temperature": args.temperature,
                                    "stream": True, "stream_options": {"include_usage": True}}
            if args.ignore_eos:
                body["ignore_eos"] = True
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            if limit is None:
                return await one_request(session, url, body, chat)
            async with limit:
                return await one_request(session, url, body, chat)

        tasks = []
        started = time.perf_counter()
        for prompt, _, output_len in prompts:
            tasks.append(asyncio.create_task(send(prompt, output_len)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                # (Gamma gaps with mean 1 / rate: shape 1 is a Poisson process, lower is burstier.)
                await asyncio.sleep(rng.gammavariate(args.burstiness, 1.0 / (args.request_rate * args.burstiness)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    return summarise(args, model, results, duration)


def _percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    at = (len(ordered) - 1) * p / 100
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``--goodput ttft:500 tpot:50``: each objective's bound in milliseconds (ValueError if malformed)."""
    objectives: dict[str, float] = {}
    for item in items or ():
        name, sep, bound = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        try:
            objectives[name] = float(bound)
        except ValueError:
            objectives[name] = math.nan
        if not (math.isfinite(objectives[name]) and objectives[name] >= 0):
            raise ValueError(f"--goodput {item!r}: {bound!r} is not a number of milliseconds")
    return objectives


def _meets(result: RequestResult, objectives: dict[str, float]) -> bool:
    values = {"ttft": result.ttft * 1000, "e2el": result.latency * 1000,
              "tpot": (result.latency - result.ttft) / (result.output_tokens - 1) * 1000
              if result.output_tokens > 1 else 0.0}
    return all(values[name] <= bound for name, bound in objectives.items())


def summarise(args: argparse.Namespace, model: str, results: list[RequestResult], duration: float
              ) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    ms = 1000.0
    metrics = {"ttft": [r.ttft * ms for r in ok],
               "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) * ms for r in ok if r.output_tokens > 1],
               "itl": [t * ms for r in ok for t in r.itl],
               "e2el": [r.latency * ms for r in ok]}
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "model": model, "endpoint": args.endpoint, "num_prompts": len(results), "completed": len(ok),
        "failed": len(results) - len(ok), "duration": duration, "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens, "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "request_goodput": (sum(_meets(r, objectives) for r in ok) / duration
                            if (objectives := parse_goodput(getattr(args, "goodput", None))) else None),
        "errors": [r.error for r in results if not r.success][:10]}
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    for name in [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]:
        values = metrics[name]
        out[f"mean_{name}_ms"] = statistics.fmean(values) if values else 0.0
        out[f"median_{name}_ms"] = statistics.median(values) if values else 0.0
        out[f"std_{name}_ms"] = statistics.pstdev(values) if values else 0.0
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = _percentile(values, p)
    out["_percentile_metrics"] = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    out["_percentiles"] = percentiles
    return out


_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def report(out: dict[str, Any]) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
             f"{'Successful requests:':<40}{out['completed']:<10}",
             f"{'Failed requests:':<40}{out['failed']:<10}"]
    if out["max_concurrency"]:
        lines.append(f"{'Maximum request concurrency:':<40}{out['max_concurrency']:<10}")
    lines += [f"{'Benchmark duration (s):':<40}{out['duration']:<10.2f}",
              f"{'Total input tokens:':<40}{out['total_input_tokens']:<10}",
              f"{'Total generated tokens:':<40}{out['total_output_tokens']:<10}",
              f"{'Request throughput (req/s):':<40}{out['request_throughput']:<10.2f}",
              *([f"{'Request goodput (req/s):':<40}{out['request_goodput']:<10.2f}"]
                if out["request_goodput"] is not None else []),
              f"{'Output token throughput (tok/s):':<40}{out['output_throughput']:<10.2f}",
              f"{'Total token throughput (tok/s):':<40}{out['total_token_throughput']:<10.2f}"]
    for name in out["_percentile_metrics"]:
        lines.append("{s:{c}^50}".format(s=f" {_TITLES[name]} ", c="-"))
        short = name.upper()
        lines.append(f"{f'Mean {short} (ms):':<40}{out[f'mean_{name}_ms']:<10.2f}")
        lines.append(f"{f'Median {short} (ms):':<40}{out[f'median_{name}_ms']:<10.2f}")
        for p in out["_percentiles"]:
            lines.append(f"{f'P{p:g} {short} (ms):':<40}{out[f'p{p:g}_{name}_ms']:<10.2f}")
    lines.append("=" * 50)
    if out["errors"]:
        lines.append("first errors: " + "; ".join(out["errors"][:3]))
    return "\n".join(lines)


def bench_serve_command(args: argparse.Namespace) -> int:
    if args.endpoint is None:
        args.endpoint = "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        print("llm-cluster bench serve: --num-prompts and the random lengths must be at least 1")
        return 2
    try:
        parse_goodput(args.goodput)
    except ValueError as e:
        print(f"llm-cluster bench serve: {e}")
        return 2
    problems = [what for what, bad in (
        ("--request-rate must be above 0 (inf: all at once)", not args.request_rate > 0),
        ("--burstiness must be above 0", not args.burstiness > 0),
        ("--sharegpt-output-len must be at least 1",
         args.sharegpt_output_len is not None and args.sharegpt_output_len < 1),
        ("--custom-output-len must be at least 1", args.custom_output_len < 1),
        ("--max-concurrency must be at least 1", args.max_concurrency is not None and args.max_concurrency < 1)) if bad]
    if problems:
        print(f"llm-cluster bench serve: {problems[0]}")
        return 2
    if args.dataset_name == "random-mm":
        problem = random_mm_problem(args)
        if problem:
            print(f"llm-cluster bench serve: {problem}")
            return 2
    if args.dataset_name not in ("random", "random-mm") and not (args.dataset_path
                                                                  and os.path.isfile(args.dataset_path)):
        print(f"llm-cluster bench serve: --dataset-name {args.dataset_name} needs --dataset-path FILE (nothing is "
              "downloaded)")
        return 2
    try:
        out = asyncio.run(run(args))
    except (RuntimeError, OSError, ValueError) as e:  # (ValueError: a dataset file that is not JSON)
        print(f"llm-cluster bench serve: {e}")
        return 1
    print(report(out), flush=True)
    if args.save_result:
        name = args.result_filename or f"bench-{out['model'].replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path = os.path.join(args.result_dir, name)
        with open(path, "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in out.items() if not k.startswith("_")}, f, indent=2)
        print(f"results written to {path}")
    return 0 if out["completed"] else 1
