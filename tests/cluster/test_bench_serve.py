"""``llm-cluster bench serve`` (vLLM's ``vllm bench serve``) against a real server: the report and
the saved results count what the server answered. Real local Ray, Serve, tiny model."""

from __future__ import annotations

import json
import re

import pytest

from cluster.cli import main
from cluster.config import ClusterConfig, EngineSpec
from tests.serve_cluster import serve_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(ray_cluster, tiny_model_dir):
    config = ClusterConfig(model=str(tiny_model_dir), served_model_name="tiny", num_engines=2,
                           defaults=EngineSpec(num_gpu_blocks=128, max_model_len=128))
    with serve_cluster(config) as cluster:
        yield cluster


def _bench(served, tmp_path, *flags: str) -> dict:
    assert main(["bench", "serve", "--base-url", served.base, "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "result.json", *flags]) == 0
    return json.loads((tmp_path / "result.json").read_text())


def test_completions_at_a_fixed_concurrency(served, tmp_path, capsys):
    result = _bench(served, tmp_path, "--num-prompts", "12", "--random-input-len", "16", "--random-output-len", "8",
                    "--max-concurrency", "4", "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
                    "--metric-percentiles", "50,99")
    # Prompts are token ids of exactly the asked length; with ignore_eos every answer has its length.
    assert (result["model"], result["completed"], result["failed"]) == ("tiny", 12, 0)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (12 * 16, 12 * 8)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"]
    assert result["median_ttft_ms"] < result["median_e2el_ms"]
    report = capsys.readouterr().out
    assert "Serving Benchmark Result" in report and "Successful requests:                    12 " in report


def test_chat_at_a_request_rate_with_a_shared_prefix_and_ranged_lengths(served, tmp_path):
    result = _bench(served, tmp_path, "--backend", "openai-chat", "--num-prompts", "8",
                    "--random-input-len", "12", "--random-output-len", "6", "--random-range-ratio", "0.5",
                    "--random-prefix-len", "8", "--request-rate", "40", "--ignore-eos")
    assert (result["completed"], result["failed"], result["endpoint"]) == (8, 0, "/v1/chat/completions")
    # (Chat prompts are text, rendered in the chat template: more tokens than the ids they came from.)
    assert result["total_input_tokens"] > 8 * (8 + 6) and 8 * 3 <= result["total_output_tokens"] <= 8 * 9
    assert result["request_rate"] == 40


def test_sharegpt_conversations_ask_for_their_replys_length(served, tmp_path):
    replies = ["A short reply of a few words.", "Another reply, a little longer than the first one was."]
    data = [{"conversations": [{"from": "human", "value": f"Question number {i}: tell me about rivers."},
                               {"from": "gpt", "value": replies[i % 2]}]} for i in range(6)]
    data.append({"conversations": [{"from": "human", "value": "no reply"}]})  # (left out)
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    result = _bench(served, tmp_path, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts",
                    "4", "--ignore-eos")
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["total_output_tokens"] >= 4 * 4
    assert main(["bench", "serve", "--base-url", served.base, "--dataset-name", "sharegpt", "--dataset-path",
                 str(path), "--num-prompts", "50"]) == 1  # (only 6 usable conversations)


def test_a_custom_dataset_of_prompts(served, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Tell me about rivers."}\n\n{"prompt": "And about mountains?"}\n')
    result = _bench(served, tmp_path, "--dataset-name", "custom", "--dataset-path", str(path), "--num-prompts", "3",
                    "--custom-output-len", "5", "--ignore-eos", "--endpoint", "/v1/chat/completions")
    assert (result["completed"], result["total_output_tokens"]) == (3, 15)
    path.write_text('{"text": "no prompt field"}\n')
    assert main(["bench", "serve", "--base-url", served.base, "--dataset-name", "custom", "--dataset-path",
                 str(path), "--num-prompts", "1"]) == 1


def test_goodput_counts_the_requests_that_meet_every_objective():
    import argparse

    from cluster.bench_serve import RequestResult, parse_goodput, report, summarise

    args = argparse.Namespace(request_rate=float("inf"), burstiness=1.0, max_concurrency=None,
                              endpoint="/v1/completions", metric_percentiles="50", percentile_metrics="ttft,tpot",
                              goodput=["ttft:100", "tpot:20"])
    results = [RequestResult(success=True, prompt_tokens=4, output_tokens=11, ttft=ttft, latency=latency)
               for ttft, latency in ((0.05, 0.15), (0.05, 0.35), (0.2, 0.3))]  # meets both; tpot 30 ms; ttft 200 ms
    out = summarise(args, "m", [*results, RequestResult(error="HTTP 500")], duration=2.0)
    assert (out["completed"], out["failed"], out["request_goodput"]) == (3, 1, 0.5)
    assert "Request goodput (req/s):                0.50" in report(out)
    with pytest.raises(ValueError, match="ttft:MS"):
        parse_goodput(["latency:5"])


def test_a_server_that_is_not_there_is_an_error(tmp_path, capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 1
    assert "llm-cluster bench serve:" in capsys.readouterr().out


def test_server_sent_events_are_read_as_the_standard_writes_them():
    """CRLF line ends, comments (keep-alive pings), ``data:`` without its space, an event split
    across reads and one whose blank line never came."""
    from cluster.bench_serve import sse_data

    events, rest = sse_data(b': ping\r\n\r\ndata:{"a": 1}\r\n\r\ndata: {"b"')
    assert (events, rest) == ([b'{"a": 1}'], b'data: {"b"')
    events, rest = sse_data(rest + b': 2}\n\ndata: [DONE]')
    assert (events, rest) == ([b'{"b": 2}'], b"data: [DONE]")
    assert sse_data(rest + b"\n\n") == ([b"[DONE]"], b"")


def test_a_stream_with_an_error_or_no_text_failed(tmp_path):
    """A server that streams an error event, or ends without any text, does not count as answered."""
    import asyncio
    import http.server
    import threading

    import aiohttp

    from cluster.bench_serve import one_request

    bodies = {"/error": b'data: {"error": {"message": "engine died"}}\n\ndata: [DONE]\n\n',
              "/empty": b"data: [DONE]\n\n",
              "/ok": b'data: {"choices": [{"text": "hi"}]}\r\n\r\n: ping\r\n\r\n'
                     b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}'}

    class Stream(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(bodies[self.path])

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    async def ask(path: str):
        async with aiohttp.ClientSession() as session:
            return await one_request(session, base + path, {}, chat=False)

    try:
        error, empty, ok = (asyncio.run(ask(path)) for path in ("/error", "/empty", "/ok"))
    finally:
        server.shutdown()
    assert (error.success, error.error) == (False, "engine died")
    assert not empty.success and "no generated text" in empty.error
    assert ok.success and (ok.prompt_tokens, ok.output_tokens) == (3, 1) and ok.ttft > 0


def test_chat_and_complete_from_the_terminal(served, capsys, monkeypatch):
    """``llm-cluster chat`` / ``complete`` (vLLM's): one quick message, then a conversation read line
    by line, the answers streamed; an unknown model is the server's 404, said on stderr."""
    import io

    url = f"{served.base}/v1"
    assert main(["complete", "--url", url, "--max-tokens", "5", "-q", "Once upon a time"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Using model: tiny\n") and len(out.splitlines()) == 2
    # (One turn: the random model's answers run to the context's end, so a second would not fit.)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))
    assert main(["chat", "--url", url, "--system-prompt", "Be brief."]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["Using model: tiny", "Please enter a message for the chat model:"] and len(lines) >= 3
    assert main(["chat", "--url", url, "--model-name", "nope", "-q", "hi"]) == 1
    assert "404" in capsys.readouterr().err


def test_random_mm_bucket_configs_are_read_as_vllm_writes_them():
    from cluster.bench_serve import parse_bucket_config

    assert parse_bucket_config("{(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}") == [
        ((256, 256), 0.5), ((720, 1280), 0.5)]
    for bad, message in (("{(256, 256, 4): 1.0}", "only images"), ("{(256, 256): 1.0}", "not \\(height"),
                         ("[1, 2]", "non-empty dict"), ("{(2, 2, 1): 0}", "probability 0"),
                         ("__import__('os')", "must be a dict")):
        with pytest.raises(ValueError, match=message):
            parse_bucket_config(bad)


@pytest.mark.parametrize(("flags", "message"), [
    ((), "loads /v1/chat/completions"),
    (("--backend", "openai-chat", "--random-mm-num-mm-items-range-ratio", "1.5"), "must be in \\[0, 1\\]"),
    (("--backend", "openai-chat", "--random-mm-base-items-per-request", "-1"), "at least 0"),
    (("--backend", "openai-chat", "--random-mm-limit-mm-per-prompt", '{"video": 1}'), "images' limit"),
    (("--backend", "openai-chat", "--random-mm-limit-mm-per-prompt", "4"), "images' limit"),
    (("--backend", "openai-chat", "--random-mm-base-items-per-request", "6", "--random-mm-limit-mm-per-prompt",
      '{"image": 2}'), "beyond"),
    (("--backend", "openai-chat", "--random-mm-bucket-config", "{(8, 8, 2): 1.0}"), "only images"),
])
def test_random_mm_flags_are_checked_before_anything_is_sent(flags, message, capsys):
    from cluster.cli import main

    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset-name", "random-mm", *flags]) == 2
    assert re.search(message, capsys.readouterr().out)
