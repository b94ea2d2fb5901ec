"""A real Prometheus (Debian's package) on a loopback port, scraping the cluster, for tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

import httpx

from tests.ports import free_port


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


@contextlib.contextmanager
def run_prometheus(target: str, scrape_interval: str = "1s") -> Iterator[str]:
    """Start Prometheus scraping ``target`` (host:port); yields its base URL."""
    binary = prometheus_binary()
    if binary is None:
        raise RuntimeError("prometheus is not installed (apt-get install -y prometheus)")
    workdir = tempfile.mkdtemp(prefix="prom-")
    config = os.path.join(workdir, "prometheus.yml")
    with open(config, "w") as f:
        f.write(f"global:\n  scrape_interval: {scrape_interval}\n  evaluation_interval: {scrape_interval}\n"
                f"scrape_configs:\n  - job_name: llm-cluster\n    static_configs:\n"
                f"      - targets: ['{target}']\n")
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={workdir}/data",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/-/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.3)
        else:
            raise TimeoutError("prometheus did not become ready")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def query(base: str, expr: str) -> list[dict]:
    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def query_with_data(base: str, expr: str, timeout_s: float = 12.0) -> list[dict]:
    """``query``, asked again for a few scrape intervals while it has no data: on a loaded machine one
    scrape can time out, and Prometheus then marks every series stale until the next one succeeds
    (a dashboard shows the gap and fills in at its next refresh)."""
    deadline = time.monotonic() + timeout_s
    while not (result := query(base, expr)) and time.monotonic() < deadline:
        time.sleep(1.0)
    return result


def target_health(base: str) -> list[tuple[str, str]]:
    """(health, last scrape error) of each target."""
    targets = httpx.get(f"{base}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    return [(t["health"], t["lastError"]) for t in targets]


def require_prometheus() -> None:
    """Skip a test where Prometheus is not installed; in CI it must be (make test installs it)."""
    import pytest

    if prometheus_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus must be installed in CI (make test installs it)")
        pytest.skip("prometheus not installed")


@contextlib.contextmanager
def scraping(served_base: str) -> Iterator[str]:
    """Prometheus scraping the cluster at ``served_base`` (http://host:port) every 2 s, yielded once its
    target is up (waited for up to a minute)."""
    with run_prometheus(served_base.removeprefix("http://"), scrape_interval="2s") as prom:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and target_health(prom) != [("up", "")]:
            time.sleep(0.5)
        yield prom


def assert_query_has_data(prom: str, expr: str) -> None:
    """A dashboard query answers with data, not only NaN (query_with_data's retries)."""
    import math

    result = query_with_data(prom, expr)
    assert result, f"no data for {expr}"
    assert any(not math.isnan(float(r["value"][1])) for r in result), f"only NaN for {expr}"
