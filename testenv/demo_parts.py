"""What the demos share: narration (``say``, ``step``), the service's log and config,
and the tables they show. ``demo.py`` (the walk), ``demo_gpu_operator.py`` and
``node/demo.py`` import it, and none of them imports another: no circle.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

NS = "gpu-operator"


def say(text: str = "") -> None:
    print(text, flush=True)


def step(n: int, title: str, why: str) -> None:
    say(f"\n=== {n}. {title}")
    for line in why.strip().splitlines():
        say(f"    {line.strip()}")


async def connect(cp: Any, log_file: Path) -> Any:
    """Sends the service's logs (JSON lines) to ``log_file``; returns an admin API client
    of the control plane ``cp``."""
    from kubernetes_asyncio import client, config

    from shared_svc import logs

    logs.configure("INFO")
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logs.JsonFormatter())
    logging.getLogger().handlers[:] = [handler]
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(cp.kubeconfig), client_configuration=configuration
    )
    return client.ApiClient(configuration=configuration)


def demo_config(cp: Any, **settings: Any) -> Any:
    """The service's settings in the demos: namespace ``gpu-operator`` on the control plane
    ``cp``, endpoints on a free 127.0.0.1 port, quick coalescing; ``settings`` add to them."""
    from shared_svc.config import Config

    base: dict[str, Any] = {
        "namespace": NS,
        "kubeconfig": str(cp.kubeconfig),
        "bind_address": "127.0.0.1",
        "port": 0,
        "pod_name": "shared-svc-demo",
        "coalesce_seconds": 0.1,
    }
    return Config(**{**base, **settings})


async def events_table(api: Any, namespaces: tuple[str, ...]) -> None:
    """shared-svc's Events in ``namespaces``, as a table."""
    from kubernetes_asyncio import client

    events: Any = client.EventsV1Api(api)
    rows = [
        (e.type, e.reason, f"{e.regarding.kind}/{e.regarding.name}", e.note[:70])
        for ns in namespaces
        for e in (await events.list_namespaced_event(ns)).items
        if e.reporting_controller == "nvidia.com/shared-svc"
    ]
    if rows:
        table(("TYPE", "REASON", "REGARDING", "NOTE"), sorted(rows, key=lambda r: r[1]))
    else:
        say("    no Events: nothing contested, nothing to warn about")


def shared_log(service: Any) -> str:
    handler = logging.getLogger().handlers[0]
    return str(getattr(handler, "baseFilename", "stderr"))


async def settle(service: Any) -> None:
    ctrl = service.controller
    runtime = service.controllers[ctrl.name]  # the runtime's Controller of the reconciler
    for _ in range(300):
        await asyncio.sleep(0.1)
        runtime.enqueue_all()
        await asyncio.sleep(0.3)
        plan = ctrl.last_plan
        if plan is not None and not plan.writes and ctrl.last_reconcile.get("result") == "success":
            return
    print("warning: the service did not converge within 2 minutes; see its log", file=sys.stderr)


async def show(core: Any, names: tuple[str, ...] | None = None) -> None:
    rows = []
    for s in sorted((await core.list_namespaced_service(NS)).items, key=lambda s: s.metadata.name):
        if names is not None and s.metadata.name not in names:
            continue
        owners = ",".join(
            f"{r.kind}/{r.name}{'(controller)' if r.controller else ''}"
            for r in s.metadata.owner_references or []
        )
        selector = ",".join(f"{k}={v}" for k, v in (s.spec.selector or {}).items())
        scrape = (s.metadata.annotations or {}).get("prometheus.io/scrape", "-")
        managed = (s.metadata.labels or {}).get("app.kubernetes.io/managed-by", "-")
        rows.append((s.metadata.name, s.spec.cluster_ip, selector, scrape, managed, owners))
    table(("SERVICE", "CLUSTER-IP", "SELECTOR", "SCRAPE", "MANAGED-BY", "OWNERS"), rows)


def show_pending(service: Any) -> None:
    for p in service.status()["pending"]:
        say(f"    pending: {p['reason']} {p['object']}: {p['message'][:140]}")


def table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for row in (header, *rows):
        say("    " + "  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=False)).rstrip())
