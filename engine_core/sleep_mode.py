"""vLLM's sleep mode: its levels, the pause modes a sleep may use, and the tags wake_up takes, with
the checks every layer (router, engine, offline LLM) applies the same way."""

from __future__ import annotations

from collections.abc import Iterable

# 1: the weights go to host memory; 2: they are discarded (read from the checkpoint again on wake-up).
SLEEP_LEVELS = (1, 2)
# How the requests in flight end before a sleep ("keep" would leave them holding the released KV cache).
SLEEP_MODES = ("abort", "wait")
# What wake_up restores, in the order it does.
WAKE_UP_TAGS = ("weights", "kv_cache")


def check_sleep(level: int, mode: str = "abort") -> None:
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be one of {list(SLEEP_LEVELS)}, got {level!r}")
    if mode not in SLEEP_MODES:
        raise ValueError(f"sleep mode must be one of {list(SLEEP_MODES)}, got {mode!r} (a kept request would lose "
                         "its KV cache)")


def wake_up_tags(tags: Iterable[str] | None) -> list[str]:
    """The tags to restore, in order (None or empty: all); ValueError naming unknown ones."""
    wanted = set(tags or WAKE_UP_TAGS)
    unknown = wanted - set(WAKE_UP_TAGS)
    if unknown:
        raise ValueError(f"wake_up tags must be among {list(WAKE_UP_TAGS)}, got {sorted(unknown)}")
    return [tag for tag in WAKE_UP_TAGS if tag in wanted]
