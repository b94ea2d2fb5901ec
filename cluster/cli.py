"""``llm-cluster serve``: start engines and the OpenAI router on Ray; Ctrl-C stops everything."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from cluster.config import API_KEY_ENV, default_api_keys, env_switch
from engine_core.config import KV_CACHE_DTYPE_NAMES, LOGPROBS_MODES, MAMBA_CACHE_DTYPE_NAMES, MAMBA_CACHE_MODE_NAMES
from router.content_format import CONTENT_FORMATS
from router.multimodal import DEFAULT_LIMIT_PER_PROMPT, DEFAULT_PROCESSOR_CACHE_GB
from router.reasoning_parsers import REASONING_PARSERS
from router.tool_parsers import TOOL_CALL_PARSERS

# Ray Serve's HAProxy ingress forwards HTTP straight to a server inside the router replica instead
# of through the Python proxy actor (about 2 ms added instead of about 9 ms here). The setting must
# be in the environment before ray is imported, so every Ray process started from here inherits it.
SERVE_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    # Our handlers never block (every actor call is awaited), so they run on the replica's own event
    # loop: no cross-thread hop per streamed chunk (measured: -2 ms TTFT, -6 ms per 16-token stream).
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
}

def human_readable_int(text: str) -> int:
    """vLLM's sizes: 4096, 32k (32,000), 32K (32,768), 1.5m, 8G (8 GiB); decimals only with the
    decimal suffixes (k, m, g, t)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number (or one like 32k, 32K, 8G): {text!r}") from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"no decimals with the binary suffix {suffix} ({text!r}); did you mean "
                                         f"{number}{suffix.lower()}?")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


DEFAULT_MODEL = "SmolLM2-135M-Instruct"


SCHEDULER_ARGS = [
    ("--max-num-seqs", int, "Admission cap on running requests."),
    ("--max-num-batched-tokens", human_readable_int, "Token budget per pass."),
    ("--max-num-scheduled-tokens", human_readable_int, "Per-pass budget that outranks --max-num-batched-tokens."),
    ("--max-model-len", human_readable_int, "Context length (prompt + output; 32k, 32K also); default: the "
                                            "model's own."),
    ("--long-prefill-token-threshold", int, "Clamp on one request's tokens per pass (0: off)."),
    ("--max-num-partial-prefills", int, "Requests that may be mid-prefill in one pass (1: no cap)."),
    ("--max-long-partial-prefills", int, "Of those, how many may be long."),
    ("--block-size", int, "KV cache block size in tokens."),
    ("--num-gpu-blocks", int, "KV pool size in blocks (default: from memory)."),
    ("--kv-cache-memory-bytes", human_readable_int, "KV pool budget in bytes (8G also), instead of "
                                                    "--gpu-memory-utilization's share on a GPU."),
    ("--gpu-memory-utilization", float, "Share of GPU memory for weights + activations + KV (CUDA)."),
    ("--num-cpus-per-worker", float, "CPUs per worker (torch threads)."),
    ("--engine-niceness", int, "Niceness added to engine compute threads, so the router runs first "
                               "(default: 4 on CPU engines, 0 on GPU engines)."),
]


# On/off flags take vLLM's --no- form too (--no-enable-prefix-caching, --no-enable-log-requests).
SWITCH = argparse.BooleanOptionalAction

# vLLM's own spellings of our flags, accepted too.
FLAG_ALIASES = {"--num-gpu-blocks": ("--num-gpu-blocks-override",)}

# Flags of `vllm serve` with nothing to do here: (takes a value, why). Accepted with a warning, so
# vLLM's command lines start as they are.
VLLM_FLAGS_WITHOUT_EFFECT: dict[str, tuple[bool, str]] = {
    "--enforce-eager": (False, "the engines capture no CUDA graphs: they always run eagerly"),
    "--disable-log-requests": (False, "requests are logged only with --enable-log-requests"),
    "--swap-space": (True, "preempted requests are recomputed, as vLLM v1 does: there is no swap space"),
    "--trust-remote-code": (False, "only the built-in architectures run: a checkpoint's own code never does"),
    "--disable-custom-all-reduce": (False, "tensor parallelism reduces through torch.distributed"),
    "--disable-frontend-multiprocessing": (False, "the router replicas are Ray Serve's processes"),
    "--uvicorn-log-level": (True, "the HTTP servers are Ray Serve's; their logs follow Ray's settings"),
    "--max-seq-len-to-capture": (True, "the engines capture no CUDA graphs"),
    "--cuda-graph-sizes": (True, "the engines capture no CUDA graphs"),
    "--compilation-config": (True, "the models are not compiled (no torch.compile, no CUDA graphs)"),
    "-O": (True, "the models are not compiled (no torch.compile, no CUDA graphs)"),
    "--async-scheduling": (False, "each pass is scheduled once the one before it ends (no overlap with the "
                                  "model's run); the answers are the same"),
    "--hf-token": (True, "nothing is downloaded"),
    "--disable-cascade-attn": (False, "there is no cascade attention to turn off"),
    "--max-parallel-loading-workers": (True, "each worker loads its own weights"),
    "--distributed-executor-backend": (True, "an engine's workers (TP x PP ranks) are Ray actors (at size 1, the "
                                             "engine's own process)"),
    "--prefix-caching-hash-algo": (True, "prefix-cache blocks are keyed by the engine's own hash (BLAKE2b of the "
                                         "parent block's hash and the tokens)"),
    "--root-path": (True, "the API is served at the Serve application's route prefix; a proxy in front of it "
                          "handles its own path"),
}

# Flags of those that take several values (`--cuda-graph-sizes 1 2 4`).
VLLM_FLAGS_WITH_SEVERAL_VALUES = frozenset({"--cuda-graph-sizes"})

# Flags of `vllm serve` that are another flag here (same meaning, our name).
VLLM_FLAGS_RENAMED: dict[str, str] = {
    "--api-server-count": "--num-router-replicas",  # (vLLM's API server processes: our router replicas)
}

# Flags of `vllm serve` for what is not built here: refused with why (and what to do instead). A
# value in ``harmless`` (the default) is accepted silently.
VLLM_FLAGS_NOT_BUILT: dict[str, tuple[str, tuple[str, ...]]] = {
    "--revision": ("models are local directories, GGUF files or the default model; nothing is downloaded: "
                   "pass the directory of the revision you want", ()),
    "--tokenizer-revision": ("nothing is downloaded: pass the tokenizer's directory with --tokenizer", ()),
    "--download-dir": ("nothing is downloaded: models are local directories or GGUF files", ()),
    "--quantization": ("a checkpoint's own quantization (FP8, compressed-tensors, GPTQ, AWQ, GGUF) is read from "
                       "its files: drop the flag; quantizing a model as it loads is not built", ()),
    "-q": ("a checkpoint's own quantization (FP8, compressed-tensors, GPTQ, AWQ, GGUF) is read from its files: drop "
           "the flag; quantizing a model as it loads is not built", ()),
    "--tokenizer-mode": ("the tokenizer is the checkpoint's Hugging Face (fast) tokenizer", ("auto",)),
    "--load-format": ("weights load from safetensors, PyTorch or GGUF files as the checkpoint has them",
                      ("auto",)),
    "--cpu-offload-gb": ("weights are not offloaded to host memory (KV blocks are: --kv-offloading-size)",
                         ("0",)),
    "--ssl-keyfile": ("TLS ends in front of Ray Serve's proxy (a load balancer or an ingress)", ()),
    "--ssl-certfile": ("TLS ends in front of Ray Serve's proxy (a load balancer or an ingress)", ()),
    "--config": ("flags come from the command line; per-engine flags from --engine-config FILE", ()),
    "--model-impl": ("the built-in model implementations run (not transformers' modeling code)", ("auto", "vllm")),
    "--guided-decoding-backend": ("structured output is built with xgrammar", ("auto", "xgrammar")),
}


def vllm_command_line(argv: list[str]) -> tuple[list[str], list[str]]:
    """``vllm serve``'s spellings made ours: --max_model_len as --max-model-len (vLLM's parser takes
    both), and its flags with nothing to do here taken out, each with a warning. ValueError names a
    flag for what is not built here. Returns (argv, warnings)."""
    out: list[str] = []
    warnings: list[str] = []
    # vLLM's dotted form of its JSON flags (--kv-transfer-config.kv_role kv_producer): the keys of
    # each, gathered into one JSON value at the end.
    dotted: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("-") or arg == "--" or _is_number(arg):
            out.append(arg)
            continue
        flag, sep, value = arg.partition("=")
        base, dot, path = flag.partition(".")
        if base.startswith("--"):
            base = "--" + base[2:].replace("_", "-")
        if dot and base in VLLM_DOTTED_JSON_FLAGS | set(VLLM_FLAGS_WITHOUT_EFFECT):  # (-O.level 3 too)
            if not sep and i < len(argv):
                value = argv[i]
                i += 1
            if base in VLLM_FLAGS_WITHOUT_EFFECT:
                warnings.append(f"{flag} has no effect here: {VLLM_FLAGS_WITHOUT_EFFECT[base][1]}")
                continue
            _set_dotted(dotted.setdefault(base, {}), path.split("."), _json_or_text(value))
            continue
        if flag.startswith("--"):
            flag = "--" + flag[2:].replace("_", "-")
        elif flag.startswith("-O") and len(flag) > 2:  # (-O3: the level attached)
            flag, sep, value = "-O", "=", flag[2:]
        if flag.startswith("--no-") and VLLM_FLAGS_WITHOUT_EFFECT.get("--" + flag[5:], (True,))[0] is False:
            flag = "--" + flag[5:]  # (--no-enforce-eager: as much without effect)
        if flag in VLLM_FLAGS_WITHOUT_EFFECT:
            takes_value, why = VLLM_FLAGS_WITHOUT_EFFECT[flag]
            # (A flag whose value is optional, --hf-token's, may come bare: the next flag is no value;
            # --cuda-graph-sizes takes several.)
            several = flag in VLLM_FLAGS_WITH_SEVERAL_VALUES
            while takes_value and not sep and i < len(argv) and (
                    _is_number(argv[i]) if several else not argv[i].startswith("-") or _is_number(argv[i])):
                i += 1  # (several values are numbers: a model named after them is not one)
                if not several:
                    break
            warnings.append(f"{flag} has no effect here: {why}")
            continue
        if flag in VLLM_FLAGS_RENAMED:
            out.append(VLLM_FLAGS_RENAMED[flag] + sep + value)
            continue
        if flag in VLLM_FLAGS_NOT_BUILT:
            why, harmless = VLLM_FLAGS_NOT_BUILT[flag]
            if not sep and i < len(argv):
                value = argv[i]
                i += 1
            if _normalised_json(value) not in {_normalised_json(h) for h in harmless}:
                raise ValueError(f"{flag}: {why}")
            continue
        out.append(flag + sep + value)
    for base, keys in dotted.items():
        _merge_dotted(out, base, keys)
    return out, warnings


# vLLM's JSON flags that also take the dotted form (--structured-outputs-config.backend xgrammar).
VLLM_DOTTED_JSON_FLAGS = frozenset({"--structured-outputs-config", "--kv-transfer-config", "--speculative-config",
                                    "--pooler-config", "--hf-overrides", "--override-generation-config",
                                    "--default-chat-template-kwargs", "--limit-mm-per-prompt",
                                    "--mm-processor-kwargs"})


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _set_dotted(target: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(target.get(key), dict):
            target[key] = {}  # (a later nested key wins over an earlier value there, as in vLLM)
        target = target[key]
    target[path[-1]] = value


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = (_deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict)
                       else value)
    return merged


def _merge_dotted(out: list[str], flag: str, keys: dict[str, Any]) -> None:
    """Put a flag's dotted keys into ``out``: over its JSON value where the flag is given too (the
    last time), else as the flag with those keys."""
    for j in range(len(out) - 1, -1, -1):
        if (out[j] == flag and j + 1 < len(out)) or out[j].startswith(flag + "="):
            inline = out[j].startswith(flag + "=")
            given = _json_or_text(out[j][len(flag) + 1:] if inline else out[j + 1])
            if not isinstance(given, dict):
                return  # (not a JSON object: the flag's own check says so)
            merged = json.dumps(_deep_merge(given, keys))
            if inline:
                out[j] = f"{flag}={merged}"
            else:
                out[j + 1] = merged
            return
    out += [flag, json.dumps(keys)]


def _normalised_json(text: str) -> str:
    """A flag's value with its JSON spacing and key order left out (a value that is not JSON as given;
    a number as a float: 0 and 0.0 are one value)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(float(value))
    return json.dumps(value, sort_keys=True)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None


def _json_object(text: str) -> dict:
    value = _json(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _local_dir_path(value: str | None) -> str | None:
    """A directory that exists here goes to the engines by its full path (they need not share this
    process's working directory); anything else as given."""
    return os.path.abspath(value) if value and os.path.isdir(value) else value


def _local_lora_module(text: str) -> str:
    """A --lora-modules entry whose path is a directory here goes to the engines by its full path
    (as --tokenizer's: they need not share this process's working directory)."""
    from engine_core.lora import parse_lora_module

    module = parse_lora_module(text)
    path = _local_dir_path(module.path)
    if path == module.path:
        return text
    entry = {"name": module.name, "path": path}
    return json.dumps(entry if module.base_model_name is None else {**entry, "base_model_name": module.base_model_name})


# vLLM's --structured-outputs-config keys, and the values of those only other backends use that are
# their defaults here (anything else is refused with why).
_STRUCTURED_OUTPUTS_KEYS = ("backend", "disable_any_whitespace", "reasoning_parser", "disable_fallback",
                            "disable_additional_properties", "enable_in_reasoning")


def _structured_outputs_config(text: str) -> dict[str, Any]:
    """vLLM's --structured-outputs-config, checked: xgrammar is the backend; what only other
    backends or modes do is refused unless at its default."""
    # (null, and vLLM's "" for an unset reasoning_parser, mean unset: a dumped vLLM config is taken)
    value = {k: v for k, v in _json_object(text).items() if v is not None and v != ""}
    unknown = sorted(set(value) - set(_STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown key(s) {', '.join(unknown)} (vLLM's are "
                                         f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)})")
    if value.get("backend", "auto") not in ("auto", "xgrammar"):
        raise argparse.ArgumentTypeError(f"backend {value['backend']!r}: structured output is built with xgrammar")
    for key, what in (("disable_additional_properties", "a guidance backend option"),
                      ("enable_in_reasoning", "grammars start after the reasoning here")):
        if value.get(key):
            raise argparse.ArgumentTypeError(f"{key}: not built ({what})")
    for key in ("disable_any_whitespace", "disable_fallback"):
        if not isinstance(value.get(key, False), bool):
            raise argparse.ArgumentTypeError(f"{key} must be true or false")
    parser = value.get("reasoning_parser")
    if parser is not None and parser not in REASONING_PARSERS:
        raise argparse.ArgumentTypeError(f"reasoning_parser {parser!r}: one of {', '.join(REASONING_PARSERS)}")
    return value


def _json_string_list(text: str) -> list[str]:
    value = _json(text)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError('expected a JSON list of strings, e.g. \'["https://app.example.com"]\'')
    return value


def _add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The engines', the models' and the router's flags (``serve``, and ``run-batch``)."""
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help=f"Model: the default {DEFAULT_MODEL}, a Hugging Face directory or a .gguf file (as "
                            "vllm serve MODEL; --model says the same).")
    serve.add_argument("--model", default=None, help="The model, as MODEL above.")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="The name clients use for the model, or several (aliases: a request may name any; "
                            "responses and metrics carry the first). Default: the model's own.")
    serve.add_argument("--num-engines", "--data-parallel-size", "-dp", type=int, default=None,
                       help="Engines to start (default 1; with --engine-autoscaling, its min_engines). vLLM's data "
                            "parallel size is this: engines with a replica of the model each.")
    serve.add_argument("--engine-autoscaling", type=_json_object, default=None,
                       help='Scale the engines with the load (JSON), e.g. \'{"min_engines": 1, "max_engines": 4, '
                            '"target_ongoing_requests": 8, "upscale_delay_s": 5, "downscale_delay_s": 60}\': as '
                            "many engines as keep each at about target_ongoing_requests running and waiting "
                            "requests; an engine scaled away is drained first. (A model of --extra-models "
                            "autoscales with an engine_autoscaling entry of its own.)")
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    serve.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None,
                       help="Pipeline stages per engine (default 1), as vLLM's flag: the model's layers split into "
                            "stages run one after the other, each stage a --tensor-parallel-size group, so an engine "
                            "starts TP x PP workers (possibly on several nodes).")
    for flag, kind, help_text in SCHEDULER_ARGS:
        serve.add_argument(flag, *FLAG_ALIASES.get(flag, ()), type=kind, default=None, help=help_text)
    serve.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=None)
    serve.add_argument("--enable-prefix-caching", action=SWITCH, default=None)
    serve.add_argument("--enable-chunked-prefill", action=SWITCH, default=None)
    serve.add_argument("--disable-chunked-mm-input", action=SWITCH, default=None,
                       help="A prefill chunk never ends inside an image's placeholders: it stops before the image.")
    serve.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    serve.add_argument("--dtype", default=None)
    serve.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPE_NAMES), default=None,
                       help="KV cache storage: auto (the model's dtype), bfloat16 (two bytes per element), or "
                            "fp8 (= fp8_e4m3), fp8_e5m2 (one byte per element: 2x (bf16) or 4x (fp32) the KV "
                            "blocks in the same memory).")
    serve.add_argument("--mamba-cache-dtype", choices=list(MAMBA_CACHE_DTYPE_NAMES), default=None,
                       help="Models with recurrent layers (Mamba, Mamba-2, Gated DeltaNet, Kimi Delta Attention, "
                            "lightning attention, short convolutions): the storage dtype of each request's conv "
                            "and recurrent states. auto: the conv state in the model's dtype, the recurrent state "
                            "in float32.")
    serve.add_argument("--mamba-ssm-cache-dtype", choices=list(MAMBA_CACHE_DTYPE_NAMES), default=None,
                       help="The recurrent (SSM) state's storage dtype alone; auto: as --mamba-cache-dtype says. "
                            "bfloat16 halves the states' memory (the scans still compute in float32).")
    serve.add_argument("--mamba-cache-mode", choices=list(MAMBA_CACHE_MODE_NAMES), default=None,
                       help="What the prefix cache keeps of a model's recurrent layers. none (default): nothing, so "
                            "prefix caching is off for such models. align: their states at the block boundaries "
                            "worth keeping that prefill chunks and decodes pass (the last each pass reaches, the "
                            "last before a prompt's last token, the end of a prefix shared with earlier prompts), "
                            "copied out inside the pass (chunks are not cut for it), so a prompt seen again, one "
                            "sharing a system prompt, or a conversation's next turn starts from the last state "
                            "kept.")
    serve.add_argument("--mamba-prefix-cache-slots", type=int, default=None,
                       help="Under --mamba-cache-mode align: how many recurrent states the prefix cache keeps "
                            "(least recently used reused first), each the size of one request's states, taken "
                            "from the KV cache's memory. Default: --max-num-seqs.")
    serve.add_argument("--enable-expert-parallel", "-ep", action=SWITCH, default=None,
                       help="Mixture-of-experts models: each of the --tensor-parallel-size ranks holds "
                            "num_experts / tp whole experts, instead of a slice of every expert.")
    serve.add_argument("--runner", choices=["auto", "generate", "pooling"], default=None,
                       help="pooling: serve the model for embeddings only (no LM head; generation refused). "
                            "auto (default): pooling for a bare-decoder checkpoint (e5-mistral's MistralModel), "
                            "generate otherwise (which embeds too).")
    serve.add_argument("--pooler-config", type=_json_object, default=None,
                       help='How embeddings pool (JSON), over the checkpoint\'s sentence-transformers files: '
                            '\'{"pooling_type": "MEAN", "normalize": true}\' (LAST, MEAN, CLS; ALL: every token\'s '
                            'row; STEP: the rows of step_tag_id\'s positions, cut to returned_token_ids).')
    serve.add_argument("--hf-overrides", type=_json_object, default=None,
                       help='Keys set over the model\'s config.json (JSON), e.g. to serve Qwen3-Reranker as a '
                            'cross-encoder: \'{"architectures": ["Qwen3ForSequenceClassification"], '
                            '"classifier_from_token": ["no", "yes"]}\'.')
    serve.add_argument("--mm-processor-kwargs", type=_json_object, default=None,
                       help='Settings over the model\'s image processor config (JSON): Qwen2-VL\'s '
                            '\'{"min_pixels": 3136, "max_pixels": 1003520}\', the range each image is resized into '
                            '(its tokens are its pixels / 784).')
    serve.add_argument("--generation-config", default=None,
                       help="The sampling parameters a request gets for those it leaves unset (temperature, top_p, "
                            "top_k, min_p, repetition_penalty; max_new_tokens caps max_tokens): auto (default, as "
                            "vLLM) takes them from the model's generation_config.json; vllm uses neutral defaults; "
                            "or a folder holding a generation_config.json.")
    serve.add_argument("--override-generation-config", type=_json_object, default=None,
                       help='Default sampling parameters set over the generation config\'s (JSON), e.g. '
                            '\'{"temperature": 0.5, "max_new_tokens": 512}\'.')
    serve.add_argument("--tokenizer", default=None,
                       help="A Hugging Face tokenizer directory to use instead of the model's own, e.g. a GGUF "
                            "model's original tokenizer (and its chat template). Hub names are not downloaded.")
    serve.add_argument("--disable-log-stats", action=SWITCH, default=None,
                       help="No engine metrics (vllm:* on /metrics) and no periodic stats line in the engines' log "
                            "(every VLLM_LOG_STATS_INTERVAL seconds, 10 by default), as vLLM's flag.")
    serve.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                       help="KV offloading, as vLLM's flag: GiB of host memory (all TP ranks together) that keep "
                            "prefix-cache blocks evicted from the KV cache; a prompt that needs them again has "
                            "them copied back instead of recomputed. Needs the prefix cache.")
    serve.add_argument("--kv-offloading-backend", choices=["native"], default=None,
                       help="Where offloaded blocks go: native (host memory, the only backend built; vLLM also "
                            "has lmcache).")
    serve.add_argument("--enable-prompt-embeds", action=SWITCH, default=None,
                       help="Let completions give their prompts as embeddings (prompt_embeds: base64 of a "
                            "torch.save-d [tokens, hidden_size] tensor), as vLLM's flag. Only for clients you trust "
                            "with the model's inputs.")
    serve.add_argument("--logits-processors", nargs="+", default=None, metavar="CLASS",
                       help="Custom logits processors, as vLLM's: qualified names of LogitsProcessor subclasses "
                            "(package.module:Class), importable wherever the engines run; requests pass them "
                            "arguments in vllm_xargs.")
    serve.add_argument("--max-logprobs", type=int, default=None,
                       help="The most logprobs (and prompt logprobs) a request may ask for per token (default 20, "
                            "as vLLM; -1: the whole vocabulary). A request may ask for all with -1 when this allows.")
    serve.add_argument("--logprobs-mode", choices=list(LOGPROBS_MODES), default=None,
                       help="What the sampled tokens' logprobs are, as vLLM's flag: raw_logprobs (default: the "
                            "model's own distribution), raw_logits (its logits, not normalised), processed_logprobs "
                            "or processed_logits (the distribution the token is drawn from: after penalties, "
                            "logit_bias, allowed/bad words, temperature, min_p, top_k and top_p; tokens these drop "
                            "at -inf, shown as -9999.0). Prompt logprobs are always raw.")
    serve.add_argument("--max-waiting-requests", type=int, default=None, help="Queue limit per engine (429 beyond).")
    serve.add_argument("--kv-transfer-config", type=_json_object, default=None,
                       help='Prefill/decode disaggregation (JSON, vLLM\'s): {"kv_connector": "RayKVConnector", '
                            '"kv_role": "kv_producer" | "kv_consumer" | "kv_both"}, for every engine (per engine: '
                            'kv_transfer_config in --engine-config, or --num-prefill-engines). The router computes '
                            'each prompt on a producer and decodes it on a consumer, which reads its KV blocks.')
    serve.add_argument("--num-prefill-engines", type=int, default=None, metavar="N",
                       help="Prefill/decode disaggregation: the first N engines compute prompts (kv_producer), the "
                            "others decode them (kv_consumer), with --kv-transfer-config's other settings.")
    serve.add_argument("--speculative-config", type=_json_object, default=None,
                       help='Speculative decoding (JSON), e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                            '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'; methods ngram, draft_model (with '
                            '"model") and mtp (DeepSeek-V3 / R1 and GLM-4.5 checkpoints\' own MTP layer).')
    serve.add_argument("--enable-sleep-mode", action=SWITCH, default=False,
                       help="Let the engines sleep (POST /sleep?level=1|2: release the KV cache, and move the "
                            "weights to host memory or discard them) and wake up (POST /wake_up); the endpoints "
                            "need --server-dev-mode.")
    serve.add_argument("--disable-hybrid-kv-cache-manager", action=SWITCH, default=False,
                       help="A model mixing full-attention and windowed layers (Gemma 2/3, GPT-OSS, Llama 4) keeps "
                            "every block of a request in its windowed layers too (by default those behind the "
                            "window go back to the pool).")
    serve.add_argument("--kv-cache-metrics", action=SWITCH, default=False,
                       help="Follow a sample of KV blocks from allocation to eviction from the prefix cache: "
                            "the vllm:kv_block_lifetime_seconds, _idle_before_evict_seconds and _reuse_gap_seconds "
                            "histograms.")
    serve.add_argument("--kv-cache-metrics-sample", type=float, default=None,
                       help="The share of blocks --kv-cache-metrics follows (default 0.01).")
    serve.add_argument("--enable-lora", action=SWITCH, default=False,
                       help="Serve LoRA adapters: clients name one as the request's model.")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help='Adapters (PEFT checkpoint directories) to load at start: name=path, or JSON '
                            '\'{"name": "...", "path": "..."}\'.')
    serve.add_argument("--max-loras", type=int, default=1, help="Most different adapters in one batch.")
    serve.add_argument("--max-lora-rank", type=int, default=16, help="Largest adapter rank served.")
    serve.add_argument("--max-cpu-loras", type=int, default=None,
                       help="Adapters kept in the workers' memory (>= --max-loras); the least recently used "
                            "beyond it are read from their checkpoints again when next needed (default: "
                            "--max-loras, as vLLM).")
    serve.add_argument("--server-dev-mode", action=SWITCH, default=env_switch("VLLM_SERVER_DEV_MODE"),
                       help="Enable POST /pause (?mode=abort|wait|keep&clear_cache=), /resume, "
                            "/reset_prefix_cache, /sleep, /wake_up and GET /is_paused, /is_sleeping on every "
                            "engine (default: $VLLM_SERVER_DEV_MODE).")
    serve.add_argument("--allow-runtime-lora-updating", action=SWITCH, default=None,
                       help="Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (default: "
                            "$VLLM_ALLOW_RUNTIME_LORA_UPDATING, where --enable-lora is given).")
    serve.add_argument("--enable-server-load-tracking", action=SWITCH, default=False,
                       help="GET /load answers {\"server_load\": N}, the requests the answering router replica "
                            "is serving (generation and pooling paths; else N is 0).")
    serve.add_argument("--enable-tokenizer-info-endpoint", action=SWITCH, default=False,
                       help="Enable GET /tokenizer_info (?model=): the tokenizer's class, configuration and "
                            "chat template. It may expose a chat template you keep private.")
    serve.add_argument("--default-chat-template-kwargs", type=_json_object, default=None,
                       help='Keyword arguments every chat template render gets unless the request sets them (JSON), '
                            'e.g. \'{"enable_thinking": false}\' to serve Qwen3 without thinking by default.')
    serve.add_argument("--enable-log-requests", action=SWITCH, default=False,
                       help="Log each request's prompt, token ids and sampling parameters as it goes to an engine.")
    serve.add_argument("--seed", type=int, default=0,
                       help="Seeds the engines' random state (vLLM's): unseeded sampling repeats across restarts for "
                            "the same requests in the same order; a request's own seed still rules its sampling.")
    serve.add_argument("--max-log-len", type=int, default=None,
                       help="Characters of a logged prompt or output (and token ids) kept.")
    serve.add_argument("--enable-log-outputs", action=SWITCH, default=False,
                       help="Log each finished answer's text, token ids and finish reason (one line per choice).")
    serve.add_argument("--enable-force-include-usage", action=SWITCH, default=False,
                       help="Every streamed answer ends with a usage chunk, whether or not the request asked for "
                            "it (stream_options.include_usage), for platforms that bill by token.")
    serve.add_argument("--return-tokens-as-token-ids", action=SWITCH, default=False,
                       help="Logprobs name tokens token_id:N for every request (tokens whose text is not valid "
                            "UTF-8 alone stay exact).")
    serve.add_argument("--exclude-tools-when-tool-choice-none", action=SWITCH, default=False,
                       help='With tool_choice "none", the chat template is not shown the tools.')
    serve.add_argument("--disable-fastapi-docs", action=SWITCH, default=False,
                       help="No /docs, /redoc or /openapi.json.")
    serve.add_argument("--response-role", default="assistant",
                       help="The role of chat answers to a prompt that opens the assistant's turn.")
    serve.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                       help="Message content for the chat template: its text, or OpenAI's list of parts (auto: "
                            "the parts when the template loops over a message's content).")
    serve.add_argument("--limit-mm-per-prompt", type=_json_object, default=None,
                       help='A vision-language model\'s most images in one prompt (JSON by modality), e.g. '
                            f'\'{{"image": 2}}\'; more is a 400 (default: {DEFAULT_LIMIT_PER_PROMPT} each, as vLLM).')
    serve.add_argument("--media-io-kwargs", type=_json_object, default=None,
                       help='How videos\' frames are sampled: \'{"video": {"num_frames": 32}}\' (evenly spaced) or '
                            '\'{"video": {"fps": 1}}\' (default: 2 a second, at least 4, at most 768).')
    serve.add_argument("--allowed-local-media-path", default="",
                       help="Images given as file:// URLs are read from under this directory (of the router "
                            "replicas' machines) and no other; without it, file:// URLs are refused.")
    serve.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="DOMAIN",
                       help="The only hosts http(s) image URLs may name (exact names, e.g. upload.wikimedia.org); "
                            "with them, redirects are not followed. Default: any host the router replicas reach.")
    serve.add_argument("--mm-processor-cache-gb", type=float, default=DEFAULT_PROCESSOR_CACHE_GB,
                       help="GiB of processed images each router replica keeps, so an image sent again (each turn of "
                            "a conversation resends its images) is not decoded and resized again; 0: none "
                            f"(default {DEFAULT_PROCESSOR_CACHE_GB:g}, as vLLM).")
    serve.add_argument("--allowed-origins", type=_json_string_list, default=["*"],
                       help='Origins browsers may call the API from (JSON list, as vLLM; default ["*"]).')
    serve.add_argument("--allowed-methods", type=_json_string_list, default=["*"],
                       help='HTTP methods allowed across origins (JSON list; default ["*"]).')
    serve.add_argument("--allowed-headers", type=_json_string_list, default=["*"],
                       help='Request headers allowed across origins (JSON list; default ["*"]).')
    serve.add_argument("--allow-credentials", action=SWITCH, default=False, help="Allow credentials across origins.")
    serve.add_argument("--enable-request-id-headers", action=SWITCH, default=False,
                       help="Accepted for vLLM's command lines: Ray Serve answers every request with X-Request-ID "
                            "(the one it came with, or a new one) whatever this says, and completions and chat "
                            "answers take it as their id (cmpl-<X-Request-Id>).")
    serve.add_argument("--trust-request-chat-template", action=SWITCH, default=False,
                       help="Run a request's own chat_template (chat, the pooling endpoints' messages, "
                            "/tokenize); without it such a request is a 400.")
    serve.add_argument("--enable-prompt-tokens-details", action=SWITCH, default=False,
                       help="Report usage.prompt_tokens_details.cached_tokens: the prompt tokens the engines "
                            "found in their prefix caches.")
    serve.add_argument("--stream-interval", type=int, default=1,
                       help="Streamed answers send their first tokens at once, then a chunk per this many new "
                            "tokens (and the last): fewer chunks, less CPU per request (default 1: every "
                            "engine step's tokens).")
    serve.add_argument("--enable-responses-store", action=SWITCH,
                       default=env_switch("VLLM_ENABLE_RESPONSES_API_STORE"),
                       help="Keep Responses API responses for GET/DELETE /v1/responses/{id} and "
                            "previous_response_id (default: $VLLM_ENABLE_RESPONSES_API_STORE).")
    serve.add_argument("--responses-store-max-entries", type=int, default=10_000,
                       help="Most responses kept (the least recently used are forgotten first).")
    serve.add_argument("--engine-config", default=None, help="YAML list of per-engine flag overrides.")
    serve.add_argument("--extra-models", default=None, metavar="FILE",
                       help="YAML list of further models served through the same endpoint, each on engines of its "
                            "own (model, served_model_name (a name or a list), num_engines, defaults, engines, "
                            "chat_template, default_chat_template_kwargs, tokenizer, tool_call_parser, "
                            "reasoning_parser, enable_auto_tool_choice, limit_mm_per_prompt, and its LoRA "
                            "adapters: enable_lora, "
                            "lora_modules, max_loras, max_lora_rank, max_cpu_loras; engine_autoscaling). A model "
                            "inherits the cluster's "
                            "engine flags, but not the first model's generation config folder or override.")
    serve.add_argument("--routing-policy", default="least_loaded",
                       choices=["round_robin", "least_loaded", "prefix_aware", "session"])
    serve.add_argument("--prefix-load-margin", type=int, default=8)
    serve.add_argument("--pd-prefill-threshold", type=int, default=0, metavar="TOKENS",
                       help="Prefill/decode disaggregation: only prompts with more than TOKENS tokens (and more than "
                            "a block) outside their decode engine's prefix cache go to a prefill engine; the others "
                            "are computed where they are decoded (default 0: every prompt worth a block).")
    serve.add_argument("--num-router-replicas", type=int, default=None,
                       help="Router replicas (default 1; with --router-autoscaling, how many start: default its "
                            "min_replicas).")
    serve.add_argument("--router-autoscaling", type=_json_object, default=None,
                       help='Let Ray Serve scale the router replicas (JSON), e.g. \'{"min_replicas": 1, '
                            '"max_replicas": 4, "target_ongoing_requests": 128}\': as many as keep each at about '
                            "target_ongoing_requests open requests (also upscale_delay_s, downscale_delay_s, "
                            "graceful_shutdown_timeout_s).")
    serve.add_argument("--request-timeout", type=float, default=None, help="Seconds before a request is aborted.")
    serve.add_argument("--chat-template", default=None,
                       help="Jinja chat template (a file, or the template itself) replacing the model's own.")
    serve.add_argument("--enable-auto-tool-choice", action=SWITCH, default=False,
                       help='Allow tool_choice "auto": the model decides, read with --tool-call-parser.')
    serve.add_argument("--tool-call-parser", choices=list(TOOL_CALL_PARSERS), default=None,
                       help="The model's tool-call format (hermes: <tool_call>{...}</tool_call>; mistral: "
                            "[TOOL_CALLS][...]; llama3_json: Llama 3.x's JSON objects; pythonic: [f(a=1), ...]; "
                            "qwen3_coder: <tool_call><function=f><parameter=a>1</parameter>...; glm45 (or glm47): "
                            "<tool_call>f <arg_key>a</arg_key><arg_value>1</arg_value>...; "
                            "openai: gpt-oss's harmony messages; "
                            "deepseek_v3, deepseek_v31, kimi_k2: DeepSeek's and Kimi K2's tool-call sections; "
                            "minimax_m2: <minimax:tool_call><invoke name=\"f\"><parameter name=\"a\">1"
                            "</parameter>...).")
    serve.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                       help="Return chat answers' <think>...</think> as reasoning (and reasoning_content).")
    serve.add_argument("--structured-outputs-config", type=_structured_outputs_config, default=None,
                       help='vLLM\'s (JSON): {"backend": "auto" or "xgrammar", "disable_any_whitespace": true (JSON '
                            'constraints leave out optional whitespace, in every request), '
                            '"reasoning_parser": ... (as --reasoning-parser), "disable_fallback": ...}.')
    serve.add_argument("--api-key", nargs="+", action="extend", default=None,
                       help="Require this Bearer key on /v1 requests (several keys: several values, or the flag "
                            "again; default: "
                            f"${API_KEY_ENV}, else vLLM's $VLLM_API_KEY, else no authentication).")
    serve.add_argument("--disable-access-log", "--disable-uvicorn-access-log", action=SWITCH, default=False,
                       help="No per-request access log lines from the router replicas.")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--address", default=None, help="Existing Ray cluster (ray://... or host:port).")
    serve.add_argument("--num-cpus", type=int, default=None, help="CPUs for a local Ray (default: all).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="Start engines and the OpenAI-compatible router.")
    _add_serve_arguments(serve)
    batch = sub.add_parser(
        "run-batch", help="Run a file of OpenAI batch requests (JSONL) through engines started for it, as vLLM's "
                          "run-batch; every serve flag applies.")
    batch.add_argument("-i", "--input-file", required=True,
                       help="The batch file: a local path, or an http(s) URL read with GET. One request per line: "
                            '{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {...}}.')
    batch.add_argument("-o", "--output-file", required=True,
                       help="Where the results go, one line per request in the input's order: a local path, or an "
                            "http(s) URL written with PUT.")
    batch.add_argument("--output-tmp-dir", default=None,
                       help="With an output URL: write the results to a file in this directory before the upload "
                            "(default: the system's temporary directory).")
    batch.add_argument("--enable-metrics", action="store_true",
                       help="Serve the router's and the engines' Prometheus metrics at http://URL:PORT/metrics while "
                            "the batch runs (vLLM's run-batch flag; --url, and --port, default 8000).")
    batch.add_argument("--url", default="0.0.0.0", help="With --enable-metrics: the address the metrics server "
                                                        "listens on (vLLM's run-batch flag).")
    _add_serve_arguments(batch)
    sub.add_parser("collect-env", help="Print the versions and hardware a bug report needs (vLLM's "
                                       "`vllm collect-env`).")
    from cluster.chat_cli import add_client_arguments

    add_client_arguments(sub.add_parser("chat", help="Chat with a running server from the terminal (vLLM's "
                                                     "`vllm chat`)."), chat=True)
    add_client_arguments(sub.add_parser("complete", help="Complete prompts with a running server from the terminal "
                                                         "(vLLM's `vllm complete`)."), chat=False)
    bench = sub.add_parser("bench", help="Benchmarks against a running server (vLLM's `vllm bench`).")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from cluster.bench_serve import add_bench_serve_arguments

    add_bench_serve_arguments(bench_sub.add_parser(
        "serve", help="Load an OpenAI-compatible server with random prompts and report TTFT, TPOT, ITL, end-to-end "
                      "latency and throughput, as `vllm bench serve` does."))
    stop = sub.add_parser("stop", help="Delete a Serve-deployed application and stop its detached engines.")
    stop.add_argument("--address", default="auto", help="The Ray cluster (default: the one running here).")
    stop.add_argument("--namespace", default="llm-cluster", help="The namespace of the application's actors.")
    stop.add_argument("--app-name", default="llm-cluster", help="The Serve application's name.")
    return parser


def served_models_line(config, engine_names: dict[int, str]) -> str:
    """Each served model's name as its first running engine serves it, and its aliases.
    ``engine_names``: the running engines' served names by engine index (an autoscaled model's
    further slots are empty)."""
    out = []
    for (_, indexes), names in zip(config.model_engines(), config.names_per_model(), strict=True):
        served = next(engine_names[i] for i in indexes if i in engine_names)
        out.append(served + (f" (also {', '.join(names[1:])})" if names[1:] else ""))
    return ", ".join(out)


def _reasoning_parser(args: argparse.Namespace) -> str | None:
    """--reasoning-parser, or --structured-outputs-config's reasoning_parser (vLLM's newer place)."""
    from_config = (args.structured_outputs_config or {}).get("reasoning_parser")
    if args.reasoning_parser and from_config and args.reasoning_parser != from_config:
        raise ValueError(f"--reasoning-parser {args.reasoning_parser} and --structured-outputs-config's "
                         f"reasoning_parser {from_config} differ")
    return args.reasoning_parser or from_config


def cluster_config_from_args(args: argparse.Namespace):
    from cluster.config import ClusterConfig, EngineSpec, load_engine_overrides, prefill_decode_overrides

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"two models: {args.model_tag!r} and --model {args.model!r}")
    if args.model_tag is None and args.model is None and any(
            "/" in key or os.path.exists(key) for key in args.api_key or ()):
        # (`serve --api-key KEY /models/x`: the flag takes several keys, so the model became a key.)
        raise ValueError("an --api-key value looks like a model path: give the model first "
                         "(llm-cluster serve MODEL --api-key KEY), or with --model")
    model = args.model_tag or args.model or DEFAULT_MODEL

    defaults = {"tensor_parallel_size": args.tensor_parallel_size,
                "pipeline_parallel_size": args.pipeline_parallel_size, "scheduling_policy": args.scheduling_policy,
                "enable_prefix_caching": args.enable_prefix_caching,
                "enable_chunked_prefill": args.enable_chunked_prefill,
                "disable_chunked_mm_input": args.disable_chunked_mm_input, "device": args.device, "dtype": args.dtype,
                "kv_cache_dtype": args.kv_cache_dtype, "enable_expert_parallel": args.enable_expert_parallel,
                "mamba_cache_dtype": args.mamba_cache_dtype, "mamba_ssm_cache_dtype": args.mamba_ssm_cache_dtype,
                "mamba_cache_mode": args.mamba_cache_mode, "mamba_prefix_cache_slots": args.mamba_prefix_cache_slots,
                "runner": args.runner, "pooler_config": args.pooler_config, "hf_overrides": args.hf_overrides,
                "mm_processor_kwargs": args.mm_processor_kwargs,
                "generation_config": _local_dir_path(args.generation_config),
                "override_generation_config": args.override_generation_config, "max_logprobs": args.max_logprobs,
                "logprobs_mode": args.logprobs_mode,
                "logits_processors": args.logits_processors, "disable_log_stats": args.disable_log_stats,
                "kv_offloading_size": args.kv_offloading_size, "kv_offloading_backend": args.kv_offloading_backend,
                "max_waiting_requests": args.max_waiting_requests, "speculative_config": args.speculative_config,
                "kv_transfer_config": args.kv_transfer_config,
                "kv_cache_metrics": args.kv_cache_metrics or None,
                "disable_hybrid_kv_cache_manager": args.disable_hybrid_kv_cache_manager or None,
                "enable_sleep_mode": args.enable_sleep_mode or None,
                "enable_prompt_embeds": args.enable_prompt_embeds,
                "kv_cache_metrics_sample": args.kv_cache_metrics_sample}
    for flag, _, _ in SCHEDULER_ARGS:
        name = flag.lstrip("-").replace("-", "_")
        defaults[name] = getattr(args, name)
    overrides = load_engine_overrides(args.engine_config) if args.engine_config else []
    if args.num_prefill_engines is not None:
        overrides = prefill_decode_overrides(args.num_prefill_engines, args.num_engines, args.kv_transfer_config,
                                             overrides)
    return ClusterConfig(
        model=model, served_model_name=args.served_model_name,
        # (Left out with autoscaling and no --num-engines: it starts min_engines; else the count is 1,
        # or the --engine-config list's length.)
        **({} if args.num_engines is None else {"num_engines": args.num_engines}),
        engine_autoscaling=args.engine_autoscaling,
        tokenizer=_local_dir_path(args.tokenizer),
        defaults=EngineSpec(**{k: v for k, v in defaults.items() if v is not None}), engines=overrides,
        routing_policy=args.routing_policy, prefix_load_margin=args.prefix_load_margin,
        pd_prefill_threshold=args.pd_prefill_threshold,
        **({} if args.num_router_replicas is None else {"num_router_replicas": args.num_router_replicas}),
        router_autoscaling=args.router_autoscaling, request_timeout_s=args.request_timeout, seed=args.seed,
        chat_template=read_chat_template(args.chat_template), enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser, reasoning_parser=_reasoning_parser(args),
        api_keys=args.api_key or default_api_keys(),
        enable_access_log=not args.disable_access_log, host=args.host, port=args.port, address=args.address,
        enable_lora=args.enable_lora, lora_modules=[_local_lora_module(m) for m in args.lora_modules or []],
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating, server_dev_mode=args.server_dev_mode,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_responses_store=args.enable_responses_store,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details, stream_interval=args.stream_interval,
        responses_store_max_entries=args.responses_store_max_entries,
        enable_server_load_tracking=args.enable_server_load_tracking,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
        enable_log_outputs=args.enable_log_outputs,
        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
        enable_force_include_usage=args.enable_force_include_usage,
        structured_outputs_disable_any_whitespace=bool(
            (args.structured_outputs_config or {}).get("disable_any_whitespace", False)),
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        response_role=args.response_role, chat_template_content_format=args.chat_template_content_format,
        disable_fastapi_docs=args.disable_fastapi_docs, limit_mm_per_prompt=args.limit_mm_per_prompt or {},
        allowed_local_media_path=_local_dir_path(args.allowed_local_media_path) or "",
        mm_processor_cache_gb=args.mm_processor_cache_gb, allowed_media_domains=args.allowed_media_domains,
        media_io_kwargs=args.media_io_kwargs or {},
        models=_extra_models(args.extra_models) if args.extra_models else [])


def _extra_models(path: str) -> list:
    """``--extra-models FILE``, each chat template read as ``--chat-template`` reads it (a path
    relative to the file's folder, or the template itself), and each adapter's, tokenizer's and
    generation config folder's relative path taken from the file's folder too, where it exists there."""
    from cluster.config import load_extra_models

    folder = os.path.dirname(os.path.abspath(path))

    def beside_file(relative: str, exists=os.path.exists) -> str:
        return os.path.join(folder, relative) if not os.path.isabs(relative) and exists(
            os.path.join(folder, relative)) else relative

    models = []
    for m in load_extra_models(path):
        template = None if m.chat_template is None else beside_file(m.chat_template, os.path.isfile)
        adapters = []
        for module in m.lora_module_list():
            entry = {"name": module.name, "path": beside_file(module.path)}
            adapters.append(entry if module.base_model_name is None else {**entry,
                                                                          "base_model_name": module.base_model_name})
        tokenizer = None if m.tokenizer is None else beside_file(m.tokenizer, os.path.isdir)
        source = m.defaults.generation_config  # (a folder of its own, beside the file as its tokenizer)
        defaults = m.defaults if source in (None, "auto", "vllm") else m.defaults.model_copy(
            update={"generation_config": beside_file(source, os.path.isdir)})
        models.append(m.model_copy(update={"chat_template": read_chat_template(template), "lora_modules": adapters,
                                           "tokenizer": tokenizer, "defaults": defaults}))
    return models


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template itself when it is not a file (as vLLM)."""
    from cluster.config import chat_template_text

    return None if value is None else chat_template_text(value, "--chat-template")


def _config_error(error: Exception) -> str:
    """One line per problem, naming the flag (pydantic's own text spans several lines)."""
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        return str(error)
    flags = {"request_timeout_s": "request-timeout"}
    lines = []
    for e in error.errors():
        field = ".".join(str(x) for x in e["loc"])
        message = e["msg"].removeprefix("Value error, ")
        lines.append(f"--{flags.get(field, field.replace('_', '-'))}: {message}" if field else message)
    return "; ".join(lines)


def _checked_config(args: argparse.Namespace):
    """The ClusterConfig the flags describe, checked as far as can be before anything starts (None:
    refused, with the reason printed)."""
    try:
        config = cluster_config_from_args(args)
        config.engine_configs()
        if config.address is None:  # a local model must exist here (on a cluster, on the engines' nodes)
            from gpu_worker.model_resolver import check_model_reference

            for owner in (config, *config.models):
                check_model_reference(owner.model, owner.tokenizer)
            from engine_core.generation_defaults import check_generation_flags

            for engine in config.engine_slot_configs():  # (a typo in a folder or a bad override: one line now)
                check_generation_flags(engine.generation_config, json.loads(engine.override_generation_config or "{}"))
            from gpu_worker.lora.peft_adapter import read_adapter_config

            for owner in (config, *config.models):  # an unreadable adapter fails now, not in every engine
                for module in owner.lora_module_list():
                    read_adapter_config(module.path, owner.max_lora_rank)
    except (ValueError, TypeError, OSError) as e:  # (pydantic's ValidationError is a ValueError)
        print(f"llm-cluster: {_config_error(e)}", file=sys.stderr)
        return None
    return config


def serve_command(args: argparse.Namespace) -> int:
    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)
    config = _checked_config(args)
    if config is None:
        return 2

    import ray

    from cluster.app import APP_NAME, run_router, start_cluster, stop_cluster, stop_router_helpers
    from cluster.launcher import InsufficientResourcesError, check_local_capacity, ensure_ray

    global _own_node_id
    try:
        started_local = ensure_ray(config.address, namespace=config.namespace, num_cpus=args.num_cpus)
        if started_local:  # our own one-node Ray: nothing will ever add resources to it
            _own_node_id = ray.get_runtime_context().get_node_id()
            check_local_capacity(config.engine_slot_configs())  # (autoscaled: all max_engines)
    except InsufficientResourcesError as e:
        print(f"llm-cluster: {e}", file=sys.stderr)
        ray.shutdown()
        return 2
    except KeyboardInterrupt:  # Ctrl-C while Ray starts
        signal.signal(signal.SIGINT, _exit_now)
        print("llm-cluster: interrupted while starting; shutting down", flush=True)
        ray.shutdown()
        return 130
    stop = threading.Event()
    engines = []
    interrupted = router_started = False
    try:
        engines = start_cluster(config)
        router_started = True
        run_router(config)
        # Installed after Ray and Serve started, so theirs do not replace ours.
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        served = served_models_line(config, {e.index: e.description.model_info.served_model_name for e in engines})
        scaled = config.scaled_models()
        count = f"{len(engines)} engine(s)" + "".join(
            f", {m.name}'s autoscaled between {m.policy.min_engines} and {m.policy.max_engines}" for m in scaled)
        print(f"llm-cluster: serving {served} with {count} on "
              f"http://{config.host}:{config.port}/v1  (Ctrl-C to stop)", flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:  # Ctrl-C while starting: what started is stopped below, without a traceback
        interrupted = True
    finally:
        # Ctrl-C again while stopping: leave at once (this process's engines and local Ray die with it).
        signal.signal(signal.SIGINT, _exit_now)
        print("llm-cluster: interrupted while starting; shutting down" if interrupted
              else "llm-cluster: shutting down", flush=True)
        steps: list[tuple[str, Callable[[], object]]] = []
        if router_started:
            # Only our application: on a shared cluster (--address) other Serve apps keep running,
            # and so do the helper actors of another application of the namespace if ours never began.
            steps.append(("the router", lambda: _delete_serve_app(APP_NAME)))
        steps.append(("the engines", lambda: stop_cluster(config, engines)))
        if router_started:
            steps.append(("the router's shared actors", lambda: stop_router_helpers(config.namespace)))
        steps.append(("Ray", ray.shutdown))
        if _own_node_id is not None:  # (and the HAProxy of our own Ray, should any outlive it)
            steps.append(("Serve's HAProxy", lambda: _kill_serve_haproxy(_own_node_id)))
        for what, step in steps:  # (each whatever the one before did)
            try:
                step()
            except Exception as e:
                print(f"llm-cluster: stopping {what} failed: {e}", file=sys.stderr, flush=True)
    return 130 if interrupted else 0  # (the shell's status for a command stopped by Ctrl-C)


def run_batch_command(args: argparse.Namespace) -> int:
    """``llm-cluster run-batch``: engines started for the batch (on a local Ray, or --address's
    cluster), the batch run through the router's app in this process, then everything stopped."""
    from cluster.run_batch import is_url

    if not is_url(args.input_file) and not os.path.isfile(args.input_file):
        print(f"llm-cluster: {args.input_file}: no such file", file=sys.stderr)
        return 2
    config = _checked_config(args)
    if config is None:
        return 2
    from cluster.run_batch import check_output

    try:
        check_output(args.output_file, args.output_tmp_dir)
    except OSError as e:
        print(f"llm-cluster: run-batch: {e}", file=sys.stderr)
        return 2
    if config.engine_autoscaling is not None or any(m.engine_autoscaling for m in config.models):
        print("llm-cluster: run-batch starts its engines for the batch: give --num-engines, not "
              "--engine-autoscaling", file=sys.stderr)
        return 2

    import asyncio

    import ray

    from cluster.app import start_cluster, stop_cluster
    from cluster.launcher import InsufficientResourcesError, check_local_capacity, ensure_ray
    from cluster.run_batch import run_batch_on_engines

    started_local = False
    try:
        started_local = ensure_ray(config.address, namespace=config.namespace, num_cpus=args.num_cpus)
        if started_local:
            check_local_capacity(config.engine_slot_configs())
    except InsufficientResourcesError as e:
        print(f"llm-cluster: {e}", file=sys.stderr)
        ray.shutdown()
        return 2
    except KeyboardInterrupt:  # Ctrl-C while Ray starts
        ray.shutdown()
        return 130
    engines = []
    started = time.monotonic()
    last_report = [started]

    def progress(summary) -> None:
        if time.monotonic() - last_report[0] >= 10:
            last_report[0] = time.monotonic()
            print(f"llm-cluster: run-batch: {summary.succeeded + summary.failed} answered "
                  f"({summary.failed} failed)", flush=True)

    try:
        engines = start_cluster(config)
        print(f"llm-cluster: run-batch: {len(engines)} engine(s) ready; reading {args.input_file}", flush=True)
        metrics_at = (args.url, args.port) if args.enable_metrics else None
        if metrics_at is not None:
            print(f"llm-cluster: run-batch: metrics at http://{args.url}:{args.port}/metrics", flush=True)
        summary = asyncio.run(run_batch_on_engines(config, args.input_file, args.output_file, args.output_tmp_dir,
                                                   progress, metrics_at))
    except KeyboardInterrupt:
        print("llm-cluster: run-batch interrupted; shutting down", file=sys.stderr, flush=True)
        return 130
    except OSError as e:
        print(f"llm-cluster: run-batch: {e}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(Exception):
            stop_cluster(config, engines)
        if started_local:
            ray.shutdown()
    print(f"llm-cluster: run-batch: {summary.requests} requests, {summary.succeeded} answered, {summary.failed} "
          f"failed, in {time.monotonic() - started:.1f} s; results in {args.output_file}", flush=True)
    return 0


# The node of the local Ray this command started (None: it joined a cluster, or has not started one).
_own_node_id: str | None = None


def _delete_serve_app(name: str) -> None:
    """Delete our Serve application, if Serve came up at all (Ctrl-C may come before it did)."""
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    from engine_core.engine_actor import named_actor

    if named_actor(SERVE_CONTROLLER_NAME, SERVE_NAMESPACE) is not None:
        serve.delete(name)


def _exit_now(*_: object) -> None:
    print("llm-cluster: interrupted again: exiting without finishing the shutdown", file=sys.stderr, flush=True)
    if _own_node_id is not None:
        _kill_serve_haproxy(_own_node_id)
    os._exit(130)


def _kill_serve_haproxy(node_id: str) -> None:
    """Ray's processes die with this one, but Ray Serve's HAProxy ingress, a child of one of its
    workers, would go on holding the port: kill those of our own local Ray's node (their files lie
    under a directory named by the node). Linux (/proc); elsewhere nothing is done."""
    marker = f"haproxy-serve/{node_id}/".encode()
    with contextlib.suppress(OSError):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read()
                if b"haproxy" in command.split(b"\0", 1)[0] and marker in command:
                    os.kill(int(pid), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["serve"], ["run-batch"]):
        try:
            argv, warnings = vllm_command_line(argv)
        except ValueError as e:
            print(f"llm-cluster: {e}", file=sys.stderr)
            return 2
        for warning in warnings:
            print(f"llm-cluster: warning: {warning}", file=sys.stderr)
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve_command(args)
    if args.command == "stop":
        return stop_command(args)
    if args.command == "run-batch":
        return run_batch_command(args)
    if args.command == "collect-env":
        from cluster.collect_env import environment_report

        print(environment_report())
        return 0
    if args.command in ("chat", "complete"):
        from cluster.chat_cli import chat_command, complete_command

        return chat_command(args) if args.command == "chat" else complete_command(args)
    if args.command == "bench":
        from cluster.bench_serve import bench_serve_command

        return bench_serve_command(args)
    return 1


def stop_command(args: argparse.Namespace) -> int:
    import ray

    from cluster.app import stop_app

    ray.init(address=args.address, namespace=args.namespace, log_to_driver=False)
    try:
        stopped = stop_app(args.namespace, args.app_name)
    finally:
        ray.shutdown()
    print(f"llm-cluster: deleted application {args.app_name!r}; stopped {', '.join(stopped) or 'no engines'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
