"""Which niceness an engine applies, and that it really applies to the calling thread only."""

from __future__ import annotations

import os
import threading

import pytest

from engine_core.config import EngineConfig
from engine_core.cpu_priority import DEFAULT_CPU_ENGINE_NICENESS, engine_niceness, lower_cpu_priority


def test_default_depends_on_where_the_engine_computes():
    assert engine_niceness(None, on_gpu=False) == DEFAULT_CPU_ENGINE_NICENESS == 4
    assert engine_niceness(None, on_gpu=True) == 0
    assert engine_niceness(7, on_gpu=True) == 7 and engine_niceness(0, on_gpu=False) == 0


def test_config_accepts_none_and_0_to_19_only():
    assert EngineConfig(model="m").engine_niceness is None
    assert EngineConfig(model="m", engine_niceness=19).engine_niceness == 19
    with pytest.raises(ValueError, match="engine_niceness"):
        EngineConfig(model="m", engine_niceness=-1)
    with pytest.raises(ValueError, match="non-negative"):
        lower_cpu_priority(-1)


def test_lowering_applies_to_the_calling_thread_and_the_threads_it_starts():
    seen: dict[str, int] = {}

    def worker() -> None:
        before = os.getpriority(os.PRIO_PROCESS, 0)
        lower_cpu_priority(2)
        child = threading.Thread(target=lambda: seen.update(child=os.getpriority(os.PRIO_PROCESS, 0)))
        child.start()
        child.join()
        seen.update(before=before, after=os.getpriority(os.PRIO_PROCESS, 0))

    main_before = os.getpriority(os.PRIO_PROCESS, 0)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["after"] == min(19, seen["before"] + 2) == seen["child"]
    assert os.getpriority(os.PRIO_PROCESS, 0) == main_before  # this thread is untouched
