"""``make demo NODE=1`` (``python -m testenv demo --node``): shared-svc as users run it, on
the real node (testenv/node): the checkout's chart installed with the helm CLI, the image
built from the Dockerfile running as two pods under a real kubelet, gpu-operator's DCGM
Services adopted with their clusterIPs, and gpu-operator's delete of one answered 404 by
the pods' delete guard, called by kube-apiserver through the chart's Service."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from testenv.demo_parts import say, step
from testenv.node import NODE_IP, POD_CIDR, SERVICE_CIDR, Node, NodeError, start
from testenv.workloads import cp_body

NS = "gpu-operator"
CHART = Path(__file__).resolve().parents[2] / "deploy" / "chart" / "shared-svc"
# What gpu-operator's ClusterPolicy controller renders (tests/admission.py OPERATOR_SHAPE).
SHAPES = {
    "nvidia-dcgm": ({"name": "dcgm", "port": 5555, "protocol": "TCP"}, "Local", None),
    "nvidia-dcgm-exporter": (
        {"name": "gpu-metrics", "port": 9400, "targetPort": 9400, "protocol": "TCP"},
        "Cluster",
        {"prometheus.io/scrape": "true"},
    ),
}


def run(keep: bool = False) -> int:
    say("shared-svc on a real node: kubelet, containerd, kube-proxy and kube-scheduler next to")
    say("etcd, kube-apiserver and kube-controller-manager, all built from their Go modules.")
    say("(First use builds them, the base image and the project's image: about 30 minutes.)")
    logs = Path(tempfile.gettempdir()) / "shared-svc-demo-node"
    try:
        node = start(keep_logs=logs)
    except NodeError as exc:
        say(f"\nThe node did not start: {exc}")
        return 1
    try:
        _walk(node)
    finally:
        if keep:
            say(
                f"\nNode left running; kubeconfig: {node.kubeconfig} (its record: /run/shared-svc-node.json)."
            )
        else:
            problems = node.stop()
            say("\nNode stopped: every process, mount, route and cgroup of it removed.")
            say(f"Its logs (kubelet, containerd, kube-apiserver, ...): {logs}")
            for p in problems:
                say(f"    left behind: {p}")
    return 0


def _kubectl(node: Node, *args: str) -> None:
    proc = node.kubectl(*args)
    for line in (proc.stdout + proc.stderr).rstrip().splitlines():
        say(f"    {line}")


def _services(node: Node) -> None:
    _kubectl(
        node, "get", "services", "-n", NS, "nvidia-dcgm", "nvidia-dcgm-exporter", "-o",
        "custom-columns=SERVICE:.metadata.name,CLUSTER-IP:.spec.clusterIP,"
        "MANAGED-BY:.metadata.labels.app\\.kubernetes\\.io/managed-by,"
        "CONTROLLER-REF:.metadata.ownerReferences[0].controller,RESOURCE-VERSION:.metadata.resourceVersion",
    )  # fmt: skip


def _walk(node: Node) -> None:
    cp = node.control_plane
    step(
        1,
        "The node is up",
        f"""Node {NODE_IP} in a network namespace of its own (pods {POD_CIDR}, Services
         {SERVICE_CIDR}): nothing it runs can reach an address off this machine.""",
    )
    _kubectl(node, "get", "nodes", "-o", "wide")

    step(
        2,
        "gpu-operator's ClusterPolicy and its two DCGM Services, as it creates them",
        """Under gpu-operator's own ServiceAccount, with its controller owner reference.""",
    )
    cp.ensure_namespace(NS)
    _, policy = cp.request(
        "POST", "/apis/nvidia.com/v1/clusterpolicies", cp_body(dcgm={"enabled": True})
    )
    cp.apply_manifests(
        [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "gpu-operator", "namespace": NS},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "cluster-admin",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "gpu-operator", "namespace": NS}],
            }
        ]
    )
    operator = cp.service_account_token(NS, "gpu-operator")
    owner = {
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "name": policy["metadata"]["name"],
        "uid": policy["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }

    def body(name: str, live: dict[str, Any] | None) -> dict[str, Any]:
        port, itp, annotations = SHAPES[name]
        meta: dict[str, Any] = {"name": name, "labels": {"app": name}, "ownerReferences": [owner]}
        if annotations:
            meta["annotations"] = annotations
        spec: dict[str, Any] = {
            "selector": {"app": name},
            "ports": [port],
            "internalTrafficPolicy": itp,
        }
        if live is not None:
            meta["resourceVersion"] = live["metadata"]["resourceVersion"]
            spec["clusterIP"] = live["spec"]["clusterIP"]
        return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec}

    base = f"/api/v1/namespaces/{NS}/services"
    for name in SHAPES:
        cp.request("POST", f"{base}?fieldManager=gpu-operator", body(name, None), token=operator)
    _services(node)

    step(
        3,
        "helm install: the chart with its defaults, the image built from the Dockerfile",
        """The hook Jobs make the webhook's certificate and patch the caBundle; the two pods
         are Ready through the chart's probes; one of them holds the Lease.""",
    )
    started = time.monotonic()
    proc = node.helm("install", "shared-svc", str(CHART), "-n", NS, "--wait", "--timeout", "5m")
    if proc.returncode != 0:
        raise NodeError(f"helm install failed: {proc.stderr}")
    say(f"    helm install --wait: {time.monotonic() - started:.0f} s")
    _kubectl(node, "get", "pods", "-n", NS, "-o", "wide")
    _, lease = cp.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/shared-svc")
    say(f"    Lease shared-svc held by {lease['spec'].get('holderIdentity')}")

    step(
        4,
        "gpu-operator's Services adopted",
        """Same objects and clusterIPs; managed by shared-svc, the owner reference no longer a
         controller one (either stack can own them).""",
    )
    for _ in range(120):
        _, svc = cp.request("GET", f"{base}/nvidia-dcgm-exporter")
        if (svc["metadata"].get("labels") or {}).get(
            "app.kubernetes.io/managed-by"
        ) == "shared-svc":
            break
        time.sleep(0.5)
    _services(node)

    step(
        5,
        "gpu-operator deletes nvidia-dcgm, and PUTs both Services whole",
        """kube-apiserver calls the delete guard through the chart's Service, served by the
         pods: 404 (gpu-operator takes it as already deleted). The PUTs go through and change
         nothing (the MutatingAdmissionPolicy puts shared-svc's shape back).""",
    )
    code = 0
    for _ in range(120):
        code, answer = cp.request("DELETE", f"{base}/nvidia-dcgm?dryRun=All", token=operator)
        if code == 404:
            break
        time.sleep(0.5)
    code, answer = cp.request("DELETE", f"{base}/nvidia-dcgm", token=operator)
    say(
        f"    DELETE nvidia-dcgm as gpu-operator: {code} {answer.get('message', '') if isinstance(answer, dict) else answer}"
    )
    _, metrics = cp.request("GET", "/metrics")
    for line in str(metrics).splitlines():
        if line.startswith("apiserver_admission_webhook_request_total{") and "delete-guard" in line:
            say(f"    {line}")
    for name in SHAPES:
        _, live = cp.request("GET", f"{base}/{name}")
        code, out = cp.request(
            "PUT", f"{base}/{name}?fieldManager=gpu-operator", body(name, live), token=operator
        )
        same = out["metadata"]["resourceVersion"] == live["metadata"]["resourceVersion"]
        say(
            f"    PUT {name} as gpu-operator: {code}, resourceVersion {'unchanged' if same else 'CHANGED'}"
        )
    _services(node)

    step(
        6,
        "helm uninstall",
        """The pre-delete Job removes the guard first; the Deployment and the chart's objects
         go; the DCGM Services stay, as they are (docs/install.md, Uninstall).""",
    )
    proc = node.helm("uninstall", "shared-svc", "-n", NS, "--wait", "--timeout", "3m")
    say(f"    helm uninstall: {'ok' if proc.returncode == 0 else proc.stderr.strip()}")
    _services(node)
