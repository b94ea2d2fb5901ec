"""Latency the HTTP front end adds: Serve ingress + router vs calling the engines directly.

Tiny random model, 2 engines, 200 streamed completions (16 output tokens) at concurrency 16, run
as alternating rounds of both paths so machine noise hits both alike. Prints TTFT and end-to-end
p50/p99 per path and the difference.

"direct" is what a router replica does internally: an EngineClient in this process (request
channels to both engines, no HTTP). "http" is a keep-alive HTTP/1.1 client reading the SSE stream
through the ingress (HAProxy by default) and the router replica. The HTTP client is deliberately
lean (a chunked-response parser inside an asyncio Protocol, not httpx), because on a small machine
the load generator shares the cores with the server and its own parsing would otherwise be counted
as added latency.

It also prints the CPU time per request of each role (load generator, engines, router replica,
HAProxy) on each path. When the closed loop saturates the cores, latency follows CPU: with
``concurrency`` requests always in flight, each CPU-millisecond per request that the HTTP path adds
delays every request in flight, so those figures say what the latency gap is made of.
``--request-rate R`` replaces the closed loop by Poisson arrivals at R requests/s (the same arrival
times on both paths), to see what the router adds below saturation.
Usage: python benchmarks/bench_router.py [--requests 200] [--concurrency 16 | --request-rate R]
       [--ingress haproxy|proxy] [--router-replicas N] [--stream-interval N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def configure_ingress(kind: str) -> None:
    # Must happen before ray is imported: every Ray process inherits the environment.
    if kind == "haproxy":
        from cluster.cli import SERVE_ENV

        os.environ.update(SERVE_ENV)


# Where the CPU goes, per path: processes on this node by role (Linux /proc; the cluster is local).
ROLES = {"load generator": None, "engines": "ray::EngineCoreActor", "router replica": "ray::ServeReplica:llm-cluster",
         "HAProxy": "haproxy -db"}


def processes() -> Iterator[tuple[int, str]]:
    """(pid, command line) of every process on this machine that can still be read."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                yield int(pid), f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue


def role_cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far by each role's processes (user + system)."""
    tick = os.sysconf("SC_CLK_TCK")
    totals = dict.fromkeys(ROLES, 0.0)
    for pid, cmdline in processes():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        role = "load generator" if pid == os.getpid() else next(
            (name for name, pattern in ROLES.items() if pattern and pattern in cmdline), None)
        if role is not None:
            totals[role] += (int(fields[11]) + int(fields[12])) / tick
    return totals


def _is_cluster_process(cmdline: str) -> bool:
    """Ray's processes (workers are ``ray::...``; raylet, GCS, agents run from ray's package) and
    HAProxy. Narrow on purpose: a loose match ("ray" anywhere) once pinned the machine's init."""
    return cmdline.startswith(("ray::", "haproxy")) or "/site-packages/ray/" in cmdline


def pin_roles(engine_cpus: set[int]) -> set[int]:
    """Give the engines ``engine_cpus`` and this benchmark's other processes (this load generator,
    the router replica, HAProxy, Ray's own daemons: every process whose command line names ray or
    haproxy) the remaining CPUs, every thread of each. Those processes end with the benchmark; the
    load generator's own affinity is restored by ``main``. Returns the CPUs left to the rest."""
    all_cpus = os.sched_getaffinity(0)
    rest = all_cpus - engine_cpus
    if not engine_cpus or not rest:
        raise SystemExit(f"--engine-cpus must name some but not all of the CPUs {sorted(all_cpus)}")
    for pid, cmdline in processes():
        if pid != os.getpid() and not _is_cluster_process(cmdline):
            continue
        cpus = engine_cpus if ROLES["engines"] in cmdline else rest
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), cpus)
        except OSError:
            continue
    return rest


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class _SSEResponseParser(asyncio.Protocol):
    """Parses one chunked SSE response at a time inside ``data_received`` (no coroutine wake-up per
    chunk): notes when the first ``data: {`` chunk is complete and resolves ``done`` at the end."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._done: asyncio.Future[tuple[float | None, float]] | None = None
        self._t0 = 0.0
        self._first: float | None = None
        self._in_body = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def start(self, request: bytes) -> asyncio.Future[tuple[float | None, float]]:
        assert self.transport is not None and self._done is None
        self._done = asyncio.get_running_loop().create_future()
        self._first, self._in_body = None, False
        self._t0 = time.perf_counter()
        self.transport.write(request)
        return self._done

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while self._done is not None:
            if not self._in_body:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(buffer[:end])
                del buffer[:end + 4]
                if not head.startswith(b"HTTP/1.1 200") or b"chunked" not in head.lower():
                    self._finish(RuntimeError(f"expected a chunked 200 SSE response: {head[:300]!r}"))
                    return
                self._in_body = True
            line_end = buffer.find(b"\r\n")
            if line_end < 0:
                return
            size = int(buffer[:line_end], 16)
            if len(buffer) < line_end + 2 + size + 2:
                return  # the chunk (and its CRLF) is not complete yet
            if size == 0:
                del buffer[:line_end + 4]
                self._finish(None)
                return
            if self._first is None and buffer.find(b"data: {", line_end + 2, line_end + 2 + size) >= 0:
                self._first = time.perf_counter() - self._t0
            del buffer[:line_end + 2 + size + 2]

    def _finish(self, error: Exception | None) -> None:
        done, self._done = self._done, None
        if done is not None and not done.done():
            if error is None:
                done.set_result((self._first, time.perf_counter() - self._t0))
            else:
                done.set_exception(error)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc or ConnectionError("the server closed the connection"))


class SSEConnection:
    """A lean keep-alive HTTP/1.1 client for SSE responses (chunked transfer encoding), so the load
    generator's own CPU, which shares these cores with the server, stays small: it only looks for
    the first ``data: {`` event and for the end of the body, as the direct path only looks at tokens."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._protocol: _SSEResponseParser | None = None

    async def post_stream(self, path: str, body: bytes) -> tuple[float | None, float]:
        """Send one request; return (time to the first data event, time to the end of the body)."""
        reused = self._protocol is not None
        try:
            return await self._post_stream(path, body)
        except ConnectionError:
            if not reused:
                raise
            # A kept-alive connection the server closed meanwhile (e.g. an ingress reload): reopen once.
            self.close()
            return await self._post_stream(path, body)

    async def _post_stream(self, path: str, body: bytes) -> tuple[float | None, float]:
        if self._protocol is None or self._protocol.transport is None or self._protocol.transport.is_closing():
            _, self._protocol = await asyncio.get_running_loop().create_connection(
                _SSEResponseParser, self.host, self.port)
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        return await self._protocol.start(request)

    def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        self._protocol = None


async def drive(one: Callable[[], Awaitable[None]], n: int, concurrency: int, rate: float | None,
                rng: random.Random) -> None:
    """Closed loop: ``concurrency`` requests always in flight (a new one as each ends). Open loop:
    requests arrive at ``rate`` per second (Poisson), however many are in flight."""
    if rate:
        tasks = []
        for _ in range(n):
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        return
    remaining = iter(range(n))

    async def worker() -> None:
        for _ in remaining:
            await one()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def http_round(base: str, n: int, concurrency: int, max_tokens: int, rate: float | None = None,
                     rng: random.Random | None = None) -> tuple[list[float], list[float]]:
    host, port = base.removeprefix("http://").split(":")
    ttft, e2e = [], []
    # logprobs=0 makes every token produce a chunk, so the first chunk is the first token even when
    # the random model's first bytes are not yet valid UTF-8 text (the direct path asks for it too).
    body = json.dumps({"model": "tiny", "prompt": "Hello world", "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "logprobs": 0}).encode()
    idle: list[SSEConnection] = []  # kept-alive connections, reused by the next request

    async def one() -> None:
        conn = idle.pop() if idle else SSEConnection(host, int(port))
        try:
            first, total = await conn.post_stream("/v1/completions", body)
        except BaseException:
            conn.close()
            raise
        idle.append(conn)
        ttft.append(first if first is not None else total)
        e2e.append(total)

    try:
        await drive(one, n, concurrency, rate, rng or random.Random(0))
    finally:
        for conn in idle:
            conn.close()
    return ttft, e2e


async def direct_round(client, n: int, concurrency: int, max_tokens: int, ids, tokens: list[int],
                       rate: float | None = None, rng: random.Random | None = None):
    from engine_core.outputs import EngineCoreRequest
    from engine_core.sampling_params import SamplingParams

    ttft, e2e = [], []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)

    async def one() -> None:
        rid = f"direct-{next(ids)}"
        engine = int(rid.rsplit("-", 1)[1]) % client.num_engines
        t0 = time.perf_counter()
        first = None
        request = EngineCoreRequest(request_id=rid, prompt_token_ids=tokens, sampling_params=params,
                                    client_index=client.client_index, arrival_time=time.time())
        async for out in client.stream(engine, request):
            if first is None and out.new_token_ids:
                first = time.perf_counter() - t0
        ttft.append(first if first is not None else time.perf_counter() - t0)
        e2e.append(time.perf_counter() - t0)

    await drive(one, n, concurrency, rate, rng or random.Random(0))
    return ttft, e2e


TIMELINE = {"arrival -> engine request": "llm_cluster:router_time_to_engine_seconds",
            "engine's first output -> first chunk": "llm_cluster:router_first_chunk_delay_seconds"}


def replica_timeline(base: str) -> dict[str, tuple[float, float]]:
    """The router replicas' own time per request (router.request_timeline): each histogram's
    (count, sum) from the cluster's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    totals = {label: [0.0, 0.0] for label in TIMELINE}
    for family in text_string_to_metric_families(text):
        for label, name in TIMELINE.items():
            if family.name == name:
                for sample in family.samples:
                    if sample.name == f"{name}_count":
                        totals[label][0] += sample.value
                    elif sample.name == f"{name}_sum":
                        totals[label][1] += sample.value
    return {label: (count, total) for label, (count, total) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--ingress", choices=["haproxy", "proxy"], default="haproxy")
    parser.add_argument("--router-replicas", type=int, default=1)
    parser.add_argument("--routing-policy", default="round_robin",
                        help="The router's policy on the HTTP path (prefix_aware: with the engines' KV cache events).")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="Open loop: Poisson arrivals at this many requests/s instead of a fixed concurrency.")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="The router's --stream-interval: chunks per this many tokens after the first.")
    parser.add_argument("--disable-access-log", action="store_true",
                        help="The router's --disable-access-log: no log line per request in the replica.")
    parser.add_argument("--engine-cpus", default=None,
                        help="Pin the engines to these CPUs (e.g. 0) and everything else to the others, so the "
                             "router does not take CPU from the engines, as in a deployment with GPU engines.")
    args = parser.parse_args()
    configure_ingress(args.ingress)

    import ray
    from ray import serve

    from cluster.config import ClusterConfig, EngineSpec
    from router.engine_client import EngineClient
    from tests.serve_cluster import serve_cluster
    from tests.tiny_model import build_tiny_llama

    os.environ.setdefault("LLM_CLUSTER_ENGINE_HOST", "127.0.0.1")  # engines' request channels on loopback
    model_dir = build_tiny_llama(Path(tempfile.mkdtemp(prefix="bench-router-")))
    ray.init(include_dashboard=False, namespace="llm-cluster", log_to_driver=False)
    config = ClusterConfig(model=str(model_dir), served_model_name="tiny", num_engines=2,
                           routing_policy=args.routing_policy, num_router_replicas=args.router_replicas,
                           stream_interval=args.stream_interval, enable_access_log=not args.disable_access_log,
                           defaults=EngineSpec(num_gpu_blocks=256, max_model_len=256))
    with serve_cluster(config) as served:
        handles = [e.actor for e in served.engines]
        own_cpus = os.sched_getaffinity(0)
        if args.engine_cpus is not None:
            engine_cpus = {int(c) for c in args.engine_cpus.split(",")}
            rest = pin_roles(engine_cpus)
            print(f"engines pinned to CPUs {sorted(engine_cpus)}, everything else to {sorted(rest)}")
        tokens = list(range(3, 6))
        per_round = max(1, args.requests // args.rounds)

        async def run() -> dict[str, tuple[list[float], list[float]]]:
            client = EngineClient(handles, client_index=424242)
            await client.wait_connected()
            ids = itertools.count()
            results = {"direct": ([], []), "http": ([], [])}
            cpu = {name: dict.fromkeys(ROLES, 0.0) for name in results}
            wall = dict.fromkeys(results, 0.0)
            await http_round(served.base, 8, 4, args.max_tokens)  # warm-up
            await direct_round(client, 8, 4, args.max_tokens, ids, tokens)
            timeline_before = await asyncio.to_thread(replica_timeline, served.base)
            for _ in range(args.rounds):
                for name in ("direct", "http"):
                    before, t0 = role_cpu_seconds(), time.perf_counter()
                    rng = random.Random(len(results[name][0]))  # both paths see the same arrival times
                    if name == "http":
                        t, e = await http_round(served.base, per_round, args.concurrency, args.max_tokens,
                                                args.request_rate, rng)
                    else:
                        t, e = await direct_round(client, per_round, args.concurrency, args.max_tokens, ids, tokens,
                                                  args.request_rate, rng)
                    wall[name] += time.perf_counter() - t0
                    after = role_cpu_seconds()
                    for role in ROLES:
                        cpu[name][role] += after[role] - before[role]
                    results[name][0].extend(t)
                    results[name][1].extend(e)
            await client.close()
            timeline_after = await asyncio.to_thread(replica_timeline, served.base)
            timeline = {label: (timeline_after[label][0] - timeline_before[label][0],
                                timeline_after[label][1] - timeline_before[label][1]) for label in TIMELINE}
            return results, cpu, wall, timeline

        results, cpu, wall, timeline = asyncio.run(run())
        for tid in os.listdir(f"/proc/{os.getpid()}/task"):
            os.sched_setaffinity(int(tid), own_cpus)
    serve.shutdown()
    ray.shutdown()
    load = f"Poisson arrivals at {args.request_rate:g} req/s" if args.request_rate else \
        f"concurrency {args.concurrency}"
    print(f"\n{args.requests} streamed requests x {args.max_tokens} tokens, {load}, "
          f"2 engines (tiny model), ingress={args.ingress}, router replicas={args.router_replicas}, "
          f"routing={args.routing_policy}, stream interval={args.stream_interval}, "
          f"access log={'off' if args.disable_access_log else 'on'}\n")
    print(f"{'path':<10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'E2E p50 ms':>12}{'E2E p99 ms':>12}")
    rows = {}
    for name, (ttft, e2e) in results.items():
        rows[name] = [pct(ttft, 0.5), pct(ttft, 0.99), pct(e2e, 0.5), pct(e2e, 0.99)]
        print(f"{name:<10}" + "".join(f"{v * 1000:>12.2f} " for v in rows[name]))
    added = [h - d for h, d in zip(rows["http"], rows["direct"])]
    print(f"{'added':<10}" + "".join(f"{v * 1000:>12.2f} " for v in added))
    mean_direct = statistics.fmean(results["direct"][1]) * 1000
    mean_http = statistics.fmean(results["http"][1]) * 1000
    print(f"\nadded TTFT at p50: {added[0] * 1000:.2f} ms (target < 3 ms); "
          f"mean e2e direct {mean_direct:.1f} ms, http {mean_http:.1f} ms")
    # What of it is the router replica's own work (the rest: the engines, and HAProxy and the client).
    print("inside the router replica, mean per http request: " + ", ".join(
        f"{label} {total / count * 1000:.2f} ms" for label, (count, total) in timeline.items() if count))
    # The closed loop keeps `concurrency` requests in flight, so when the cores are saturated every
    # CPU-millisecond per request the HTTP path adds shows up as latency for all requests in flight.
    cores = os.cpu_count() or 1
    print(f"\nCPU per request (ms) by role, and the roles' share of the {cores} cores:")
    print(f"{'path':<10}" + "".join(f"{role:>16}" for role in ROLES)
          + f"{'all roles':>12}{'cores used':>12}{'req/s':>8}")
    for name in results:
        n = len(results[name][0])
        per_request = [cpu[name][role] / n * 1000 for role in ROLES]
        busy = sum(cpu[name].values()) / (wall[name] * cores) * 100
        print(f"{name:<10}" + "".join(f"{v:>16.2f}" for v in per_request) + f"{sum(per_request):>12.2f}"
              f"{busy:>11.0f}%{n / wall[name]:>8.0f}")


if __name__ == "__main__":
    main()
