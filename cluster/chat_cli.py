"""``llm-cluster chat`` and ``llm-cluster complete``: talk to a running OpenAI-compatible server from
the terminal, as vLLM's ``vllm chat`` and ``vllm complete`` do: a conversation (or prompts) read line
by line, each answer streamed as it comes; ``--quick MESSAGE`` sends one and exits."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, TextIO


def add_client_arguments(parser: argparse.ArgumentParser, chat: bool) -> None:
    parser.add_argument("--url", default="http://localhost:8000/v1", help="The server's OpenAI API base.")
    parser.add_argument("--model-name", default=None, help="The model (default: the server's first).")
    parser.add_argument("--api-key", default=None, help="Bearer key (default: $OPENAI_API_KEY).")
    if chat:
        parser.add_argument("--system-prompt", default=None, help="A system message opening the conversation.")
    else:
        parser.add_argument("--max-tokens", type=int, default=None, help="Tokens each completion may have.")
    parser.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                        help="Send this one message (prompt), print the answer, exit.")


class ServerError(RuntimeError):
    pass


class Client:
    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        key = api_key or os.environ.get("OPENAI_API_KEY")
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def _open(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=self.headers,
                                         method="GET" if body is None else "POST")
        try:
            return urllib.request.urlopen(request, timeout=600)
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = str(e)
            raise ServerError(f"{path}: HTTP {e.code}: {message}") from None

    def first_model(self) -> str:
        with self._open("/models") as response:
            models = json.load(response).get("data") or []
        if not models:
            raise ServerError("/models: the server lists no model")
        return models[0]["id"]

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Each streamed chunk (server-sent events' data) of ``body`` posted to ``path``."""
        from cluster.bench_serve import sse_data

        with self._open(path, {**body, "stream": True}) as response:
            buffer = b""
            for raw in response:
                events, buffer = sse_data(buffer + raw)
                for data in events:
                    if data.strip() == b"[DONE]":
                        return
                    chunk = json.loads(data)
                    error = chunk.get("error") if isinstance(chunk, dict) else None
                    if error:
                        raise ServerError(str(error.get("message", error) if isinstance(error, dict) else error))
                    yield chunk


def _print_stream(chunks: Iterator[dict[str, Any]], chat: bool, out: TextIO) -> str:
    text = []
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if piece:
                text.append(piece)
                out.write(piece)
                out.flush()
    out.write("\n")
    return "".join(text)


def _lines(prompt: str) -> Iterator[str]:
    while True:
        try:
            yield input(prompt)
        except EOFError:
            return


def chat_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    return _run(args, chat=True, out=out or sys.stdout)


def complete_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    return _run(args, chat=False, out=out or sys.stdout)


def _run(args: argparse.Namespace, chat: bool, out: TextIO) -> int:
    client = Client(args.url, args.api_key)
    try:
        model = args.model_name or client.first_model()
        print(f"Using model: {model}", file=out)
        conversation: list[dict[str, str]] = []
        if chat and args.system_prompt is not None:
            conversation.append({"role": "system", "content": args.system_prompt})
        messages = [args.quick] if args.quick is not None else None
        if messages is None:
            print("Please enter a message for the chat model:" if chat else "Please enter prompt to complete:",
                  file=out)
        for message in messages or _lines("> "):
            if chat:
                conversation.append({"role": "user", "content": message})
                answer = _print_stream(client.stream("/chat/completions", {"model": model,
                                                                           "messages": conversation}), True, out)
                conversation.append({"role": "assistant", "content": answer})
            else:
                body: dict[str, Any] = {"model": model, "prompt": message}
                if args.max_tokens is not None:
                    body["max_tokens"] = args.max_tokens
                _print_stream(client.stream("/completions", body), False, out)
    except (ServerError, OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # (a server's odd answer)
        print(f"llm-cluster: {type(e).__name__ + ': ' if not isinstance(e, ServerError) else ''}{e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
