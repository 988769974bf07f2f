"""``shared-svc run`` writing a timestamp at each step of a Services reconcile, for
``bench_controller.py --trace`` and ``bench_fleet.py --trace``. Not part of the product.

Each line of the file named by ``BENCH_TRACE_OUT`` is ``<time.perf_counter()> <step>``:
``event <resource> <type> <name>`` when the ClusterPolicy or Service cache has decoded a
watch event, ``reconcile-start``, ``plan-start``, ``plan-end``, ``write-start``,
``write-end``, ``reconcile-end``. ``perf_counter`` is CLOCK_MONOTONIC on Linux, the
benchmark's clock too, so the steps line up with the benchmark's own times.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import shared_svc.controllers.services.reconciler as controller
import shared_svc.kube.reflector as reflector
import shared_svc.kube.writer as writer
from shared_svc.cli import main

_out = open(os.environ["BENCH_TRACE_OUT"], "w", buffering=1)  # noqa: SIM115 - the process's life
TRACED = ("clusterpolicies", "services")


def mark(step: str) -> None:
    _out.write(f"{time.perf_counter():.6f} {step}\n")


_watch_event = reflector.watch_event
_reconcile = controller.ServicesReconciler.reconcile
_make_plan = controller.make_plan
_send = writer.Writer.send


def watch_event(line: bytes, resource: Any = None) -> Any:
    out = _watch_event(line, resource)
    if resource is not None and resource.plural in TRACED:
        mark(f"event {resource.plural} {out[0]} {out[1].get('metadata', {}).get('name')}")
    return out


async def reconcile(self: Any, key: str) -> Any:
    mark("reconcile-start")
    try:
        return await _reconcile(self, key)
    finally:
        mark("reconcile-end")


def make_plan(*args: Any, **kwargs: Any) -> Any:
    mark("plan-start")
    try:
        return _make_plan(*args, **kwargs)
    finally:
        mark("plan-end")


async def write(self: Any, *args: Any, **kwargs: Any) -> Any:
    mark("write-start")
    try:
        return await _send(self, *args, **kwargs)
    finally:
        mark("write-end")


if __name__ == "__main__":
    reflector.watch_event = watch_event
    controller.ServicesReconciler.reconcile = reconcile  # type: ignore[method-assign]
    controller.make_plan = make_plan
    writer.Writer.send = write  # type: ignore[method-assign]
    sys.exit(main(["run"]))
