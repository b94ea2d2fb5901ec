"""Two Ray nodes on this machine (loopback): engine 0 pinned to node_a, engine 1 to node_b; then one
engine whose two pipeline stages sit one on each node."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.ports import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def _ray_start(*args: str, temp_dir: str) -> None:
    proc = subprocess.run([RAY, "start", *args, "--node-ip-address=127.0.0.1", "--num-cpus=2",
                           "--disable-usage-stats"], capture_output=True, text=True, timeout=120, env=_env(temp_dir))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _env(temp_dir: str) -> dict[str, str]:
    # Loopback-only test cluster: no token auth (a real cluster shares a token, see the README).
    return os.environ | {"RAY_TMPDIR": temp_dir, "RAY_AUTH_MODE": "disabled"}


def test_engines_pinned_to_two_nodes_both_answer(tiny_model_dir):
    # A short temp dir of its own: every process of this cluster carries it in its command line,
    # so the test can stop exactly these two nodes and leave any other Ray on the machine alone.
    temp_dir = tempfile.mkdtemp(prefix="r2n", dir="/tmp")
    port = free_port()
    try:
        _ray_start("--head", f"--port={port}", '--resources={"node_a": 1}', f"--temp-dir={temp_dir}",
                   "--include-dashboard=false", temp_dir=temp_dir)
        _ray_start(f"--address=127.0.0.1:{port}", '--resources={"node_b": 1}', temp_dir=temp_dir)
        proc = subprocess.run([sys.executable, "-m", "tests.e2e.two_node_driver", f"127.0.0.1:{port}",
                               str(tiny_model_dir)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env=_env(temp_dir))
        assert proc.returncode == 0, proc.stderr[-4000:]
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["pkill", "-9", "-f", temp_dir], check=False)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert report["num_nodes"] == 2
    assert report["engine_node_resources"] == [["node_a"], ["node_b"]]
    assert report["engine_nodes"][0] != report["engine_nodes"][1]
    assert all(n >= 1 for n in report["finished"]) and sum(report["finished"]) == 6
    # Prefill/decode disaggregation across the nodes: engine 0's blocks read by engine 1, the answer
    # the same as the prompt's whole.
    (sent_0, received_0), (sent_1, received_1) = report["kv_blocks"]
    assert sent_0 == received_1 > 0 and received_0 == sent_1 == 0
    decoded, whole = report["disaggregated"]
    assert decoded == whole
    # Pipeline stages on the two nodes: the same answer as one engine's.
    first, second = report["pipeline_worker_nodes"]
    assert first != second and {first, second} == set(report["engine_nodes"])
    assert report["pipeline_text"] == whole
