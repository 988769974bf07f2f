"""``python -m testenv demo`` (``make demo``): the main job. A narrated walk through shared-svc on the embedded
test control plane: adoption of gpu-operator's Services, the selector gate, and a
migration from ClusterPolicy to GPUCluster that keeps the stable DNS names (and their
clusterIPs) alive throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from shared_svc.errors import UsageError

NS = "gpu-operator"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="walk through shared-svc on the embedded test control plane"
    )
    parser.add_argument(
        "--keep", action="store_true", help="leave the control plane running at the end"
    )
    parser.add_argument(
        "--with-gpu-operator",
        action="store_true",
        help="instead: shared-svc next to the real gpu-operator with the chart's admission "
        "guard (builds gpu-operator from its Go module on first use: minutes)",
    )
    parser.add_argument(
        "--node",
        action="store_true",
        help="instead: the chart and the image on the real node (kubelet, containerd; "
        "testenv/node, built on first use: about 20 minutes)",
    )
    parser.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    import testenv

    if args.node:
        from testenv.node import demo as node_demo

        return node_demo.run(keep=args.keep)
    if args.with_gpu_operator:
        from testenv import demo_gpu_operator

        log = Path(tempfile.gettempdir()) / "shared-svc-demo-gpu-operator.log"
        return demo_gpu_operator.run(log, keep=args.keep)

    say(
        "shared-svc demo: one API server (real kube-apiserver + etcd on 127.0.0.1), no kubelet, no controllers."
    )
    try:
        cp = testenv.start()
    except testenv.ControlPlaneError as exc:
        raise UsageError(f"the test control plane did not start: {exc}") from exc
    log_file = Path(tempfile.gettempdir()) / "shared-svc-demo.log"
    try:
        asyncio.run(_walk(cp, log_file))
    finally:
        if args.keep:
            say(
                f"\nControl plane left running; kubeconfig: {cp.kubeconfig} (stop it by killing its processes)."
            )
        else:
            cp.stop()
    return 0


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
        _table(("TYPE", "REASON", "REGARDING", "NOTE"), sorted(rows, key=lambda r: r[1]))
    else:
        say("    no Events: nothing contested, nothing to warn about")


async def _walk(cp: Any, log_file: Path) -> None:
    from kubernetes_asyncio import client

    from testenv.service import running
    from testenv.workloads import DcgmWorkloads, cp_body, gc_body

    api = await connect(cp, log_file)
    # Plain dict bodies throughout: the typed client models add nothing to a demo.
    core: Any = client.CoreV1Api(api)
    custom: Any = client.CustomObjectsApi(api)
    workloads = DcgmWorkloads(api, NS, field_manager="demo")
    await core.create_namespace({"metadata": {"name": NS}})

    step(
        1,
        "The cluster as gpu-operator's ClusterPolicy stack leaves it today",
        """A ClusterPolicy, the DCGM DaemonSets with their pods, and the two Services the
         operator created with controller owner references (only one controller is allowed).""",
    )
    spec = {"enabled": True, "service": {"internalTrafficPolicy": "Cluster"}}
    cp_obj = await custom.create_cluster_custom_object(
        "nvidia.com",
        "v1",
        "clusterpolicies",
        cp_body(dcgm={"enabled": True}, dcgmExporter=spec),
    )
    owner = {
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "name": "cluster-policy",
        "uid": cp_obj["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    for name, port, pname in (
        ("nvidia-dcgm", 5555, "dcgm"),
        ("nvidia-dcgm-exporter", 9400, "gpu-metrics"),
    ):
        body: dict[str, Any] = {
            "metadata": {"name": name, "labels": {"app": name}, "ownerReferences": [owner]},
            "spec": {
                "selector": {"app": name},
                "ports": [{"name": pname, "port": port, "targetPort": port}],
            },
        }
        if name == "nvidia-dcgm":
            body["spec"]["internalTrafficPolicy"] = "Local"
        else:
            body["metadata"]["annotations"] = {"prometheus.io/scrape": "true"}
        await core.create_namespaced_service(NS, body, field_manager="gpu-operator")
    for app in ("nvidia-dcgm", "nvidia-dcgm-exporter"):
        await workloads.daemonset(app, common=False)
        for node in ("node-a", "node-b"):
            await workloads.pod(f"{app}-{node}", app, common=False)
    await _show(core)

    step(
        2,
        "shared-svc starts and adopts them",
        """Same objects, same clusterIPs; the owner reference becomes a non-controller one, so
         either stack can own the Service too. Selectors stay on app labels: the pods have no
         common label yet, and switching now would drop endpoints.""",
    )
    cfg = demo_config(
        cp,
        leader_election=True,
        lease_duration_seconds=6,
        renew_deadline_seconds=4,
        retry_period_seconds=1,
    )
    try:
        async with running(cfg) as service:
            await _settle(service)
            await _show(core)

            step(
                3,
                "gpu-operator rolls out pods carrying the common labels",
                """Once the DaemonSet's rollout is complete and every pod carries
                 nvidia.com/gpu-operator.dcgm(-exporter)=true, the stable names move to the common label.""",
            )
            for app in ("nvidia-dcgm", "nvidia-dcgm-exporter"):
                await workloads.daemonset(app, common=True)
                for node in ("node-a", "node-b"):
                    await workloads.pod(f"{app}-{node}", app, common=True)
            await _settle(service)
            await _show(core)

            step(
                4,
                "Migration begins: a GPUCluster (DRA stack) is created",
                """Both CRs now own the stable Services (sorted, non-controller references). The DRA
                 stack also gets its -dra names. Its pods are not labelled yet, so the stable names keep
                 the legacy selector and the -dra exporter is scraped as well: no exporter goes unscraped.""",
            )
            await custom.create_cluster_custom_object(
                "nvidia.com", "v1alpha1", "gpuclusters", gc_body()
            )
            for app in ("nvidia-dcgm-dra", "nvidia-dcgm-exporter-dra"):
                await workloads.daemonset(app, common=False)
                for node in ("node-c",):
                    await workloads.pod(f"{app}-{node}", app, common=False)
            await _settle(service)
            await _show(core)
            _show_pending(service)

            step(
                5,
                "The ClusterPolicy is deleted",
                """Its references are removed; nvidia-dcgm and nvidia-dcgm-exporter stay, with the same
                 clusterIPs, now selecting the DRA pods. Consumers using the stable DNS names never noticed.""",
            )
            await custom.delete_cluster_custom_object(
                "nvidia.com", "v1", "clusterpolicies", "cluster-policy"
            )
            await _settle(service)
            await _show(core)

            step(
                6,
                "The DRA pods roll out with the common labels",
                "The stable names move to the common labels; the -dra names keep their own.",
            )
            for app in ("nvidia-dcgm-dra", "nvidia-dcgm-exporter-dra"):
                await workloads.daemonset(app, common=True)
                await workloads.pod(f"{app}-node-c", app, common=True)
            await _settle(service)
            await _show(core)

            step(
                7,
                "What shared-svc reported",
                "Events (events.k8s.io/v1) and an excerpt of /status.",
            )
            await events_table(api, (NS, "default"))
            status = service.status()
            excerpt = {
                k: status[k]
                for k in (
                    "leader",
                    "leaseHolder",
                    "lastReconcile",
                    "conflicts",
                    "pending",
                    "errors",
                )
            }
            excerpt["objects"] = [
                {k: o[k] for k in ("kind", "name", "neededBy", "selector")}
                for o in status["objects"]
            ]
            say(json.dumps(excerpt, indent=2))
            say(f"\nThe service's JSON logs: {shared_log(service)}")
    finally:
        await api.close()
    say("\nDone: the service stopped gracefully and released its Lease.")


def shared_log(service: Any) -> str:
    handler = logging.getLogger().handlers[0]
    return str(getattr(handler, "baseFilename", "stderr"))


async def _settle(service: Any) -> None:
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


async def _show(core: Any, names: tuple[str, ...] | None = None) -> None:
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
    _table(("SERVICE", "CLUSTER-IP", "SELECTOR", "SCRAPE", "MANAGED-BY", "OWNERS"), rows)


def _show_pending(service: Any) -> None:
    for p in service.status()["pending"]:
        say(f"    pending: {p['reason']} {p['object']}: {p['message'][:140]}")


def _table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for row in (header, *rows):
        say("    " + "  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=False)).rstrip())
