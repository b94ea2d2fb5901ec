"""``llm-cluster run-batch``: an OpenAI batch file through engines started for it, answered as the
HTTP server answers, results in the input's order; local files and http(s) URLs. Real local Ray,
tiny model."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from cluster.cli import main

pytestmark = pytest.mark.slow


def _line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _batch(model: str) -> list[str]:
    greedy = {"model": model, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    return [
        _line("chat-1", "/v1/chat/completions", {**greedy, "messages": [{"role": "user", "content": "Hello"}]}),
        _line("completion-n2", "/v1/completions", {**greedy, "prompt": "Once upon", "n": 2, "temperature": 1.0,
                                                              "seed": 3}),
        "not json at all",
        _line("streamed", "/v1/completions", {**greedy, "prompt": "x", "stream": True}),
        _line("unknown-model", "/v1/completions", {**greedy, "model": "nope", "prompt": "x"}),
        _line("bad-url", "/v1/models", {}),
        _line("get", "/v1/completions", {**greedy, "prompt": "x"}, method="GET"),
        _line("too-long", "/v1/completions", {**greedy, "prompt": "x", "max_tokens": 10_000}),
        _line("chat-1-again", "/v1/chat/completions", {**greedy, "messages": [{"role": "user", "content": "Hello"}]}),
    ]


def _flags(model_dir) -> list[str]:
    return ["--model", str(model_dir), "--served-model-name", "tiny", "--num-engines", "2",
            "--num-gpu-blocks", "64", "--max-model-len", "128"]


def _check(results: list[dict]) -> None:
    assert [r["custom_id"] for r in results] == ["chat-1", "completion-n2", None, "streamed", "unknown-model",
                                                   "bad-url", "get", "too-long", "chat-1-again"]
    status = {r["custom_id"]: r["response"]["status_code"] for r in results}
    assert status == {"chat-1": 200, "completion-n2": 200, None: 400, "streamed": 400, "unknown-model": 404,
                      "bad-url": 400, "get": 400, "too-long": 400, "chat-1-again": 200}
    chat, completion, *_, again = results
    assert chat["error"] is None and chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["usage"]["completion_tokens"] == 6
    # The same greedy request twice: the same answer, whichever engine each went to.
    assert (again["response"]["body"]["choices"][0]["message"]["content"]
            == chat["response"]["body"]["choices"][0]["message"]["content"])
    assert [c["index"] for c in completion["response"]["body"]["choices"]] == [0, 1]
    by_id = {r["custom_id"]: r for r in results}
    # Errors carry the OpenAI error body the HTTP server gives (or why the line could not run).
    unknown = by_id["unknown-model"]
    assert unknown["error"]["error"]["code"] == 404 and unknown["response"]["body"] is None
    assert by_id["too-long"]["error"]["error"]["param"] in ("max_tokens", "prompt")
    assert "stream" in by_id["streamed"]["error"] and "POST" in by_id["get"]["error"]
    assert "/v1/models" in by_id["bad-url"]["error"] and by_id[None]["error"] == "the line is not JSON"
    assert len({r["id"] for r in results}) == len(results)


def test_a_batch_file_is_answered_line_by_line_in_order(ray_cluster, tiny_model_dir, tmp_path, capsys):
    source, results = tmp_path / "batch.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(_batch("tiny")) + "\n\n")  # (blank lines are skipped)
    assert main(["run-batch", "-i", str(source), "-o", str(results), *_flags(tiny_model_dir)]) == 0
    _check([json.loads(line) for line in results.read_text().splitlines()])
    assert "9 requests, 3 answered, 6 failed" in capsys.readouterr().out


class _Store(http.server.BaseHTTPRequestHandler):
    """GET serves the batch; PUT keeps what it is sent (as an object store's presigned URLs)."""

    files: dict[str, bytes] = {}
    puts: list[str] = []

    def do_GET(self) -> None:
        data = self.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self) -> None:
        data = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/expired":  # (a presigned URL past its time: not tried again)
            self.puts.append(self.path)
            self.send_response(403)
        else:
            self.files[self.path] = data
            self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_a_batch_is_read_from_and_written_to_urls(ray_cluster, tiny_model_dir, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Store)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    _Store.files["/in.jsonl"] = "\n".join(_batch("tiny")).encode()
    try:
        assert main(["run-batch", "-i", f"{base}/in.jsonl", "-o", f"{base}/out.jsonl", "--output-tmp-dir",
                     str(tmp_path), *_flags(tiny_model_dir)]) == 0
    finally:
        server.shutdown()
    _check([json.loads(line) for line in _Store.files["/out.jsonl"].decode().splitlines()])
    assert list(tmp_path.iterdir()) == []  # (the temporary output was removed after the upload)


def test_the_results_may_replace_the_input_and_a_refused_upload_keeps_them(ray_cluster, tiny_model_dir, tmp_path,
                                                                            capsys):
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(_batch("tiny")))
    assert main(["run-batch", "-i", str(batch), "-o", str(batch), *_flags(tiny_model_dir)]) == 0
    _check([json.loads(line) for line in batch.read_text().splitlines()])  # (read whole before it was replaced)
    assert [p.name for p in tmp_path.iterdir()] == ["batch.jsonl"]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Store)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kept = tmp_path / "kept"
    kept.mkdir()
    batch.write_text("\n".join(_batch("tiny")))
    try:
        assert main(["run-batch", "-i", str(batch), "-o", f"http://127.0.0.1:{server.server_address[1]}/expired",
                     "--output-tmp-dir", str(kept), *_flags(tiny_model_dir)]) == 1
    finally:
        server.shutdown()
    assert _Store.puts == ["/expired"]  # (a 403 is not tried again)
    [results] = kept.iterdir()
    assert str(results) in capsys.readouterr().err
    _check([json.loads(line) for line in results.read_text().splitlines()])


def test_a_missing_input_file_is_refused_before_anything_starts(tmp_path, capsys):
    assert main(["run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "out.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["run-batch", "-i", str(__file__), "-o", str(tmp_path / "no-such-dir" / "out.jsonl")]) == 2
    assert "not a directory this process can write to" in capsys.readouterr().err


class _SlowBatch(http.server.BaseHTTPRequestHandler):
    """Serves a batch's first line, then the rest once ``release`` is set: the batch runs meanwhile."""

    lines: list[str] = []
    release = threading.Event()

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write((self.lines[0] + "\n").encode())
        self.wfile.flush()
        self.release.wait(120)
        self.wfile.write(("\n".join(self.lines[1:]) + "\n").encode())

    def log_message(self, *args) -> None:
        pass


def test_enable_metrics_serves_the_router_and_engine_series_while_the_batch_runs(ray_cluster, tiny_model_dir,
                                                                                 tmp_path):
    import time

    import httpx

    from tests.ports import free_port

    _SlowBatch.lines = _batch("tiny")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowBatch)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port, results, outcome = free_port(), tmp_path / "results.jsonl", {}
    batch = threading.Thread(target=lambda: outcome.setdefault("rc", main([
        "run-batch", "-i", f"http://127.0.0.1:{server.server_address[1]}/batch.jsonl", "-o", str(results),
        "--enable-metrics", "--url", "127.0.0.1", "--port", str(port), *_flags(tiny_model_dir)])))
    batch.start()
    try:
        deadline, text = time.monotonic() + 120, ""
        while time.monotonic() < deadline and "vllm:num_requests_running" not in text:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.HTTPError:
                time.sleep(0.5)
        # The engines' series (both engines) and the router's, in one exposition; nothing else served.
        assert 'vllm:num_requests_running{engine="0"' in text and 'engine="1"' in text
        assert "llm_cluster:router_requests_routed" in text
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={}, timeout=5).status_code in (404, 405)
    finally:
        _SlowBatch.release.set()
        batch.join(300)
        server.shutdown()
    assert outcome["rc"] == 0
    _check([json.loads(line) for line in results.read_text().splitlines()])
    with pytest.raises(httpx.HTTPError):  # (stopped with the batch)
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
