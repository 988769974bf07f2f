"""``python -m testenv demo`` (``make demo``): the main job. A narrated walk through shared-svc on the embedded
test control plane: adoption of gpu-operator's Services, the selector gate, and a
migration from ClusterPolicy to GPUCluster that keeps the stable DNS names (and their
clusterIPs) alive throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from shared_svc.errors import UsageError
from testenv.demo_parts import (
    NS,
    connect,
    demo_config,
    events_table,
    say,
    settle,
    shared_log,
    show,
    show_pending,
    step,
)


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
    await show(core)

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
            await settle(service)
            await show(core)

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
            await settle(service)
            await show(core)

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
            await settle(service)
            await show(core)
            show_pending(service)

            step(
                5,
                "The ClusterPolicy is deleted",
                """Its references are removed; nvidia-dcgm and nvidia-dcgm-exporter stay, with the same
                 clusterIPs, now selecting the DRA pods. Consumers using the stable DNS names never noticed.""",
            )
            await custom.delete_cluster_custom_object(
                "nvidia.com", "v1", "clusterpolicies", "cluster-policy"
            )
            await settle(service)
            await show(core)

            step(
                6,
                "The DRA pods roll out with the common labels",
                "The stable names move to the common labels; the -dra names keep their own.",
            )
            for app in ("nvidia-dcgm-dra", "nvidia-dcgm-exporter-dra"):
                await workloads.daemonset(app, common=True)
                await workloads.pod(f"{app}-node-c", app, common=True)
            await settle(service)
            await show(core)

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
