"""The engine's periodic stats line in its log, as vLLM's LoggingStatLogger writes it:

    Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.1 tokens/s,
    Running: 6 reqs, Waiting: 0 reqs, GPU KV cache usage: 3.1%, Prefix cache hit rate: 41.7%

every ``VLLM_LOG_STATS_INTERVAL`` seconds (10 by default), from the counters the engine's Prometheus
metrics already keep (so it costs nothing per step). As vLLM's, a line goes out at INFO when this or
the last interval had throughput, else at DEBUG, so an idle (or paused) server's log stays quiet.
The prefix cache hit rate is the interval's (vLLM's is over its recent requests). With KV offloading
the line adds vLLM's "External prefix cache hit rate": of the tokens looked up in the host tier
(``vllm:external_prefix_cache_queries``), the share it held (``..._hits``). With speculative
decoding a second line gives the drafts' acceptance, per position too. ``--disable-log-stats`` turns
the line off with the metrics, as in vLLM; the offline ``LLM`` does not write it unless asked, as
vLLM's does not.
"""

from __future__ import annotations

import logging
import os
import threading

from engine_core.metrics import EngineMetrics

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0


def stats_interval() -> float:
    """vLLM's VLLM_LOG_STATS_INTERVAL (seconds; default 10)."""
    try:
        value = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value > 0 else DEFAULT_INTERVAL_S


class EngineStatsLogger:
    def __init__(self, metrics: EngineMetrics, engine_index: int, now: float) -> None:
        self.metrics = metrics
        self.engine_index = engine_index
        self._last_time = now
        self._last = self._read()
        self._was_active = False

    def _read(self) -> dict[str, float]:
        counters = self.metrics.counters
        read = {name: counters[name] for name in ("prompt_tokens", "generation_tokens", "prefix_queries",
                                                  "prefix_hits")}
        if self.metrics.offload is not None:
            read |= {name: self.metrics.offload[name] for name in ("external_queries", "external_hits")}
        if self.metrics.spec is not None:
            read |= {f"spec_{name}": value for name, value in self.metrics.spec.items()}
            read |= {f"spec_pos_{i}": value for i, value in enumerate(self.metrics.spec_accepted_per_pos)}
        return read

    def lines(self, now: float) -> tuple[int, list[str]]:
        """The log level and lines for the interval that ends ``now``."""
        current, elapsed = self._read(), max(now - self._last_time, 1e-9)
        delta = {name: current[name] - self._last[name] for name in current}
        self._last, self._last_time = current, now
        gauges = self.metrics.gauges
        prompt_rate = delta["prompt_tokens"] / elapsed
        generation_rate = delta["generation_tokens"] / elapsed
        # (The busy loop may count between two reads here: rates are kept within their bounds.)
        queries = delta["prefix_queries"]
        hit_rate = min(100.0, 100.0 * delta["prefix_hits"] / queries) if queries > 0 else 0.0
        lines = [f"Engine {self.engine_index:03d}: Avg prompt throughput: {prompt_rate:.1f} tokens/s, "
                 f"Avg generation throughput: {generation_rate:.1f} tokens/s, Running: {int(gauges['running'])} reqs, "
                 f"Waiting: {int(gauges['waiting'])} reqs, GPU KV cache usage: {100.0 * gauges['kv_usage']:.1f}%, "
                 f"Prefix cache hit rate: {hit_rate:.1f}%"]
        if self.metrics.offload is not None:
            looked_up = delta["external_queries"]
            external_rate = min(100.0, 100.0 * delta["external_hits"] / looked_up) if looked_up > 0 else 0.0
            lines[0] += f", External prefix cache hit rate: {external_rate:.1f}%"
        drafted, drafts = delta.get("spec_draft_tokens", 0.0), delta.get("spec_drafts", 0.0)
        if drafted > 0 and drafts > 0:
            accepted = delta["spec_accepted_tokens"]
            per_position = ", ".join(f"{min(1.0, delta[f'spec_pos_{i}'] / drafts):.3f}"
                                     for i in range(len(self.metrics.spec_accepted_per_pos)))
            lines.append(f"Engine {self.engine_index:03d}: SpecDecoding metrics: Mean acceptance length: "
                         f"{1 + accepted / drafts:.2f}, Accepted throughput: {accepted / elapsed:.2f} tokens/s, "
                         f"Drafted throughput: {drafted / elapsed:.2f} tokens/s, Accepted: {int(accepted)} tokens, "
                         f"Drafted: {int(drafted)} tokens, Per-position acceptance rate: {per_position}, "
                         f"Avg Draft acceptance rate: {min(100.0, 100.0 * accepted / drafted):.1f}%")
        active = bool(delta["prompt_tokens"] or delta["generation_tokens"])
        level = logging.INFO if active or self._was_active else logging.DEBUG
        self._was_active = active
        return level, lines

    def run(self, stopped: threading.Event, interval: float, clock) -> None:
        """Log every ``interval`` seconds until ``stopped`` is set (a daemon thread's body); a failed
        line is logged as such and the next interval tried, so one bad read does not end them."""
        while not stopped.wait(interval):
            try:
                level, lines = self.lines(clock())
                for line in lines:
                    logger.log(level, line)
            except Exception:
                logger.exception("engine %d: the stats line failed", self.engine_index)
