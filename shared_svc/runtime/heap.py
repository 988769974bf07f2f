"""What the caches listed is kept out of the cyclic garbage collector's scans.

A full (generation 2) collection visits every object the collector tracks. At fleet scale
most of them are what the caches hold (40,000 operator pods' projections, 5,000 nodes'
metadata: about two million dicts and lists), objects that live as long as the process
and are never part of a cycle (JSON read from the wire). The collector starts a full
collection whenever the objects that reached generation 2 since the last one are a
quarter of those there: in a driver-upgrade wave, with 64 passes each holding a node's
pods across its requests, that happened about ten times in a wave, 0.27 s of the event
loop each (bench_fleet.py's profile, docs/benchmarks.md).

:func:`freeze` is CPython's answer (``gc.freeze``, as Instagram's servers and the
documentation's pre-fork advice use it): once every cache has synced, collect what is
garbage now, then move every object that survives to the permanent generation, which no
collection visits. Reference counting still frees a frozen object that is dropped (a
pod that changes, a node that goes); only a reference cycle among frozen objects would
never be freed, and nothing the caches hold makes one. The service freezes each time the
registry reports every cache synced: at the start, and after a re-list (an API-server
outage) replaced what the caches hold (``kube.registry.CacheRegistry``'s
``on_all_synced``). What is made later (statuses, objects that change) is collected as
before: a full collection then visits only what is not frozen.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze() -> None:
    """Collect what is garbage now, then freeze what survives (logged: the number of
    objects frozen in all, ``gc.get_freeze_count``, and the seconds it took)."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info(
        "caches synced: their objects are frozen out of the garbage collector's scans",
        extra={
            "objects": gc.get_freeze_count(),
            "seconds": round(time.perf_counter() - started, 3),
        },
    )
