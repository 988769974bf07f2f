"""Benchmark (not a test): what a cache spends per object of a list page, in-process.

A list page of ``--page`` realistic DCGM pods (``tests/realistic.api_pod``, ~15 KiB each,
as the API server lists them: no kind or apiVersion per item) and one of realistic
DaemonSets, read the way the reflector reads them (``kube.reflector.read_page``: depth
check, decode, the projection, the cache's shared values), the exact way (``json.loads``
of every field) and with the resource's msgspec decoder (``kube.decode``). Prints per
object: each step's time (the best of ``--repeat`` rounds, in microseconds) and the peak
of Python allocations while one page is read (tracemalloc, measured apart).

    .venv/bin/python benchmarks/bench_decode.py [--page 100] [--repeat 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared_svc.controllers.services.caches import operator_pods
from shared_svc.controllers.shared_caches import ALL_DAEMONSETS
from shared_svc.kube.reflector import Listed, Resource, read_page
from shared_svc.kube.store import SharedValues
from shared_svc.kube.untrusted import json_depth
from tests.realistic import api_daemonset, api_pod

APPS = ("nvidia-dcgm-exporter", "nvidia-dcgm", "nvidia-dcgm-exporter-dra", "nvidia-dcgm-dra")


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    item.pop("kind", None)
    item.pop("apiVersion", None)
    return item


def page(kind: str, n: int) -> bytes:
    if kind == "Pod":
        items = [_listed(api_pod(APPS[i % 4], f"p-{i:05d}", f"node-{i:05d}")) for i in range(n)]
    else:
        items = [_listed(api_daemonset(APPS[i % 4], 5000)) for i in range(n)]
        for i, ds in enumerate(items):
            ds["metadata"]["name"] = f"ds-{i}"
    meta = {"resourceVersion": "123", "continue": "next"}
    return json.dumps({"metadata": meta, "items": items}, separators=(",", ":")).encode()


def best(f: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


def read(raw: bytes, resource: Resource) -> Listed:
    listed = Listed({}, {}, "", set())
    shared = SharedValues()
    read_page(raw, resource, listed, ({}, {}), lambda o: shared(resource.kept(o)))
    return listed


def peak_mib(f: Callable[[], Any]) -> float:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    kept = f()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    del kept
    return peak / 2**20


def report(resource: Resource, n: int, r: int) -> None:
    raw = page(resource.kind, n)
    exact = dataclasses.replace(resource, decoder=None)
    assert resource.decoder is not None
    assert read(raw, resource).items == read(raw, exact).items
    decode = resource.decoder.page
    us = 1e6 / n
    print(f"{resource.kind}: {len(raw) // n} bytes per object")
    print(f"  json_depth                      {best(lambda: json_depth(raw), r) * us:8.1f} us")
    print(f"  json.loads                      {best(lambda: json.loads(raw), r) * us:8.1f} us")
    print(f"  msgspec decoder                 {best(lambda: decode(raw), r) * us:8.1f} us")
    for label, res in (("exact", exact), ("decoder", resource)):
        t = best(lambda: read(raw, res), r) * us  # noqa: B023 (called at once)
        mib = peak_mib(lambda: read(raw, res))  # noqa: B023
        print(f"  read_page, {label:8s}             {t:8.1f} us   peak {mib:6.2f} MiB/page")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--page", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    print(
        f"in-process, one page of {args.page} objects, best of {args.repeat}; "
        f"Python {sys.version.split()[0]}"
    )
    for resource in (operator_pods("gpu-operator"), ALL_DAEMONSETS):
        report(resource, args.page, args.repeat)


if __name__ == "__main__":
    main()
