"""`llm-cluster serve` as a user runs it, in a process of its own with a local Ray of its own:
Ctrl-C while serving shuts everything down cleanly (status 0), and Ctrl-C while it is still
starting stops what started without a traceback (status 130, the shell's for Ctrl-C)."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.ports import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


class _Serving:
    """The CLI process, with its output (stdout and stderr together) read line by line."""

    def __init__(self, proc: subprocess.Popen, temp_dir: str) -> None:
        self.proc, self.temp_dir = proc, temp_dir
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self._new.put(line)
        self._new.put(None)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            line = self._new.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line is not None, f"exited before {text!r}:\n" + "".join(self.lines[-60:])
            self.lines.append(line)

    def stop(self, timeout: float) -> tuple[int, str]:
        """Ctrl-C, then the exit status and the whole output."""
        self.proc.send_signal(signal.SIGINT)
        status = self.proc.wait(timeout=timeout)
        while (line := self._new.get(timeout=10)) is not None:
            self.lines.append(line)
        return status, "".join(self.lines)


@contextmanager
def _cli_serve(model_dir: Path, port: int) -> Iterator[_Serving]:
    # A short temp dir of its own: its Ray's processes all carry it, so exactly they can be cleaned
    # up, and the serve finds no other Ray on the machine to join.
    temp_dir = tempfile.mkdtemp(prefix="rcli", dir="/tmp")
    env = os.environ | {"RAY_TMPDIR": temp_dir, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--model", str(model_dir), "--served-model-name", "tiny",
         "--num-engines", "1", "--num-gpu-blocks", "32", "--max-model-len", "128", "--port", str(port),
         "--num-cpus", "2"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield _Serving(proc, temp_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["pkill", "-9", "-f", temp_dir], check=False)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _nothing_left(serving: _Serving, timeout: float = 30.0) -> bool:
    """Whether every process of the CLI's Ray (which carry its temp dir) has gone, within ``timeout``."""
    deadline = time.monotonic() + timeout
    while subprocess.run(["pgrep", "-f", serving.temp_dir], capture_output=True).returncode == 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def test_ctrl_c_while_serving_stops_everything_cleanly(tiny_model_dir):
    port = free_port()
    with _cli_serve(tiny_model_dir, port) as serving:
        serving.wait_for("llm-cluster: serving", timeout=300)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        status, output = serving.stop(timeout=120)
        assert status == 0, output[-4000:]
        assert "llm-cluster: shutting down" in output and "Traceback" not in output, output[-4000:]
        assert "llm-cluster: stopping" not in output, output[-4000:]  # (no step of the shutdown failed)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
        assert _nothing_left(serving)  # (its Ray, engines and router went with it)


# Points of the start: Ray starting, the engines up and the router starting, the router's replica starting.
@pytest.mark.parametrize("started", ["Started a local Ray instance", "engine 0 ready", "Adding 1 replica"])
def test_ctrl_c_while_starting_stops_without_a_traceback(tiny_model_dir, started):
    with _cli_serve(tiny_model_dir, free_port()) as serving:
        serving.wait_for(started, timeout=300)
        status, output = serving.stop(timeout=120)
        assert "Traceback" not in output and "llm-cluster: stopping" not in output, output[-4000:]
        if "llm-cluster: serving" not in output:  # (a fast machine may have finished starting meanwhile)
            assert status == 130, output[-4000:]
            assert "llm-cluster: interrupted while starting; shutting down" in output, output[-4000:]
        assert _nothing_left(serving)


def test_a_second_ctrl_c_while_stopping_exits_at_once_and_takes_its_ray_along(tiny_model_dir):
    """Ray's processes die with the CLI's; so does Serve's HAProxy, which would otherwise go on
    holding the port (the next `llm-cluster serve` on it would fail)."""
    port = free_port()
    with _cli_serve(tiny_model_dir, port) as serving:
        serving.wait_for("llm-cluster: serving", timeout=300)
        serving.proc.send_signal(signal.SIGINT)
        serving.wait_for("llm-cluster: shutting down", timeout=60)
        status, output = serving.stop(timeout=60)
        assert status == 130 and "interrupted again" in output, output[-4000:]
        assert _nothing_left(serving)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # (free again)
