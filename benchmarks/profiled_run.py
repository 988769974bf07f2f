"""``shared-svc run`` with cProfile switched by signals, for ``bench_memory.py --profile``
and ``bench_fleet.py --profile``.

SIGUSR1 starts profiling the main thread (the event loop) and timing the garbage
collector (at once, before the service's imports, when ``BENCH_PROFILE_FROM_START`` is set:
the start-up, for ``bench_fleet.py --startup-profile``) (``gc.callbacks``: cProfile does not see a collection, it is charged to whatever
function allocated at the time); SIGUSR2 stops both, writes the stats to the file named by
``BENCH_PROFILE_OUT`` and the collections (count and seconds per generation) to that name
with ``.gc`` appended. Not part of the product.
"""

from __future__ import annotations

import cProfile
import gc
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from shared_svc.cli import main

_profile = cProfile.Profile()
_gc: dict[int, list[float]] = {}  # generation -> [collections, seconds]
_gc_started: list[float] = []


def _collecting(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc_started[:] = [time.perf_counter()]
    elif _gc_started:
        entry = _gc.setdefault(int(info["generation"]), [0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - _gc_started[0]


def _start(_sig: int, _frame: FrameType | None) -> None:
    _gc.clear()
    gc.callbacks.append(_collecting)
    _profile.enable()


def _stop(_sig: int, _frame: FrameType | None) -> None:
    _profile.disable()
    if _collecting in gc.callbacks:
        gc.callbacks.remove(_collecting)
    out = os.environ["BENCH_PROFILE_OUT"]
    _profile.dump_stats(out)
    Path(f"{out}.gc").write_text(
        ", ".join(
            f"generation {g}: {int(n)} collections, {s:.3f} s" for g, (n, s) in sorted(_gc.items())
        )
        or "none"
    )


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    if os.environ.get("BENCH_PROFILE_FROM_START"):
        _start(signal.SIGUSR1, None)
    sys.exit(main(["run"]))
