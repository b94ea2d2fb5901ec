"""Our log lines in Ray's processes (engine actors, router replicas), at INFO by default.

Ray leaves a worker process's root logger at WARNING with no handler, so an engine's INFO lines (the
periodic stats line, the sampling defaults it found, "restarted while paused", ...) were dropped.
Each of our packages' loggers gets a stderr handler there, which Ray forwards to the driver's
console and to its log files, at ``VLLM_LOGGING_LEVEL`` (vLLM's variable; default INFO). Called only
by the Ray actor classes (engine actors, their TP worker actors, router replicas, the metrics hub),
never in a process that configures its own logging (the CLI, tests).
"""

from __future__ import annotations

import logging
import os

PACKAGES = ("engine_core", "gpu_worker", "router", "cluster")
# The logging variables an actor reads, passed on from the process that starts it (a Ray cluster
# joined with --address was started without them).
LOGGING_ENV = ("VLLM_LOGGING_LEVEL", "VLLM_LOG_STATS_INTERVAL")


def logging_runtime_env() -> dict[str, dict[str, str]]:
    """A Ray ``runtime_env`` carrying this process's logging variables to an actor ({} when none is set)."""
    env = {name: os.environ[name] for name in LOGGING_ENV if name in os.environ}
    return {"env_vars": env} if env else {}


FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def configure_actor_logging() -> None:
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        level = "INFO"
    for name in PACKAGES:
        package_logger = logging.getLogger(name)
        if any(getattr(h, "_llm_cluster", False) for h in package_logger.handlers):
            continue  # (another actor of this process configured it)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%m-%d %H:%M:%S"))
        handler._llm_cluster = True  # type: ignore[attr-defined]
        package_logger.addHandler(handler)
        package_logger.setLevel(level)
        package_logger.propagate = False  # (Ray's root has no handler; this keeps lines single if one is added)
