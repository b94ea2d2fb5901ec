"""CORS (vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials; open by
default) and --enable-request-id-headers, through the real app on a scripted engine."""

from __future__ import annotations

from router.serving import CORSSettings

from .test_request_fields import _app

PREFLIGHT = {"Origin": "https://ui.example.com", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 3}


def test_browsers_on_any_origin_may_call_by_default_even_with_an_api_key():
    http, engine = _app(settings={"api_keys": ("k",)})
    preflight = http.options("/v1/completions", headers=PREFLIGHT)  # (no key: a preflight carries none)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    answer = http.post("/v1/completions", json=COMPLETION,
                       headers={"Origin": "https://ui.example.com", "Authorization": "Bearer k"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
    # A refusal carries the CORS headers too, so the page can read why.
    refused = http.post("/v1/completions", json=COMPLETION, headers={"Origin": "https://ui.example.com"})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    assert len(engine.requests) == 1
    # Without an Origin (no browser) nothing changes.
    assert "access-control-allow-origin" not in http.get("/health").headers


def test_the_allowed_origins_methods_and_credentials_are_the_flags():
    cors = CORSSettings(allow_origins=("https://ui.example.com",), allow_methods=("GET", "POST"),
                        allow_headers=("content-type",), allow_credentials=True)
    http, _ = _app(settings={"cors": cors})
    ok = http.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Headers": "content-type"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ui.example.com"
    assert ok.headers["access-control-allow-credentials"] == "true"
    assert http.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example.com"}
                        ).status_code == 400
    assert http.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "DELETE"}
                        ).status_code == 400
    answer = http.post("/v1/completions", json=COMPLETION, headers={"Origin": "https://evil.example.com"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_request_id_headers_echo_the_requests_or_name_a_new_one():
    http, _ = _app(settings={"enable_request_id_headers": True})
    given = http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "trace-42"})
    assert given.status_code == 200 and given.headers["x-request-id"] == "trace-42"
    with http.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True},
                     headers={"X-Request-Id": "trace-43"}) as streamed:
        assert streamed.headers["x-request-id"] == "trace-43"
        assert "".join(streamed.iter_text()).endswith("data: [DONE]\n\n")
    fresh = [http.get("/health").headers["x-request-id"] for _ in range(2)]
    assert len(set(fresh)) == 2 and all(len(value) == 32 for value in fresh)
    assert http.post("/v1/completions", json={"model": "nope", "prompt": "hi"},
                     headers={"X-Request-Id": "trace-44"}).headers["x-request-id"] == "trace-44"
    # Off by default, as in vLLM.
    plain, _ = _app()
    assert "x-request-id" not in plain.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "t"}).headers
