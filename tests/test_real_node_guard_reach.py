"""The guard's reach where the control plane is fenced (issue 43), on the real node: the
checkout's chart installed by the helm CLI, the API server calling the webhook through the
chart's Service (pod IP and container port), ``helm test`` running ``shared-svc admission
probe`` in a pod under shared-svc's ServiceAccount.

The fences are firewall rules in the node's network namespace on the connections the API
server's address opens to the pod range (the connections it keeps open included), as the
providers set them: GKE private clusters admit the control plane to nodes and pods on 443
and 10250 only; EKS with a custom CNI reaches no pod IP at all. The pods' own connections
to the API server (and their answers) pass."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Iterator

import pytest

from testenv.node import HOST_IP, NODE_LINK, POD_CIDR, SERVICE_CIDR, Node
from tests.kube import eventually
from tests.real_node import (
    CHART,
    NS,
    RELEASE,
    SERVICES,
    OperatorWorld,
    gpu_operator_world,
    helm,
    install,
    service,
    uninstall,
)

pytestmark = pytest.mark.node

GKE = ["-m", "multiport", "!", "--dports", "443,10250"]  # what GKE's rule leaves open
EKS: list[str] = []  # no pod IP at all


def rule(*match: str) -> list[str]:
    return [
        "FORWARD", "-s", HOST_IP, "-d", POD_CIDR, "-p", "tcp",
        "-m", "conntrack", "--ctdir", "ORIGINAL", *match, "-j", "REJECT",
        "--reject-with", "tcp-reset",
    ]  # fmt: skip


class Fence:
    def __init__(self, node: Node, match: list[str]) -> None:
        self.node, self.rule = node, rule(*match)

    def iptables(self, op: str) -> None:
        proc = subprocess.run(
            self.node.in_node("iptables", "-w", op, *self.rule),
            capture_output=True, text=True, check=False, timeout=30,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr

    def __enter__(self) -> Fence:
        self.iptables("-I")
        return self

    def __exit__(self, *_: object) -> None:
        self.iptables("-D")


def helm_test(node: Node) -> subprocess.CompletedProcess[str]:
    return node.helm("test", RELEASE, "-n", NS, "--logs", "--timeout", "3m", timeout=300)


@pytest.fixture(scope="module")
async def world(
    real_node: Node, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[OperatorWorld]:
    """A ClusterPolicy and gpu-operator's Services: what the guard keeps (the probe asks
    about one of them)."""
    w = await gpu_operator_world(real_node.control_plane, NS, tmp_path_factory.mktemp("op"))
    try:
        yield w
    finally:
        await w.writer.close()


@pytest.fixture
def clean(real_node: Node, world: OperatorWorld) -> Iterator[Node]:
    uninstall(real_node)
    try:
        yield real_node
    finally:
        uninstall(real_node)


async def adopted(node: Node) -> None:
    """shared-svc manages gpu-operator's Services (the probe's target exists)."""

    async def managed() -> bool:
        await asyncio.sleep(0)
        found = [service(node.control_plane, n) or {} for n in SERVICES]
        return all(
            (s.get("metadata", {}).get("labels") or {}).get("app.kubernetes.io/managed-by")
            == "shared-svc"
            for s in found
        )

    await eventually(managed, timeout=120, interval=1)


async def test_a_fenced_webhook_port_fails_helm_test_and_port_10250_passes_it(clean: Node) -> None:
    node = clean
    install(node)  # the default port, 8443
    await adopted(node)
    passed = helm_test(node)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    with Fence(node, GKE):
        fenced = helm_test(node)
        assert fenced.returncode != 0, fenced.stdout
        assert "delete guard: fails_open" in fenced.stdout + fenced.stderr
        helm(
            node, "upgrade", RELEASE, str(CHART), "-n", NS, "--reuse-values",
            "--set", "admission.webhook.port=10250", "--wait", "--timeout", "3m",
        )  # fmt: skip
        moved = helm_test(node)
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert "delete guard: served" in moved.stdout + moved.stderr


@contextlib.contextmanager
def service_route(node: Node) -> Iterator[None]:
    """A process on the node's own network reaches the API server as a node's does: its
    packets to the kubernetes Service are routed (the node namespace has no default route:
    a route for the Service range through its link, the host's end refusing that range),
    then kube-proxy's OUTPUT rules translate the address to the API server's."""

    def ip(*args: str) -> str:
        proc = subprocess.run(
            node.in_node("ip", *args), capture_output=True, text=True, check=False, timeout=30
        )
        assert proc.returncode == 0, (args, proc.stderr)
        return proc.stdout

    before = ip("route", "show", SERVICE_CIDR).split()  # the node's own (unreachable) route
    ip("route", "replace", SERVICE_CIDR, "dev", NODE_LINK)
    try:
        yield
    finally:
        if before:
            ip("route", "replace", *before)
        else:
            ip("route", "del", SERVICE_CIDR, "dev", NODE_LINK)


async def test_no_pod_ip_reachable_fails_helm_test_and_host_network_passes_it(clean: Node) -> None:
    node = clean
    with Fence(node, EKS), service_route(node):
        install(node, "replicas=1")  # pod IPs: the API server reaches none
        await adopted(node)
        fenced = helm_test(node)
        assert fenced.returncode != 0, fenced.stdout
        assert "delete guard: fails_open" in fenced.stdout + fenced.stderr
        helm(
            node, "upgrade", RELEASE, str(CHART), "-n", NS, "--reuse-values",
            "--set", "admission.webhook.hostNetwork=true", "--wait", "--timeout", "3m",
        )  # fmt: skip
        values = node.helm("get", "values", RELEASE, "-n", NS).stdout
        assert "hostNetwork: true" in values
        passed = helm_test(node)
        assert passed.returncode == 0, passed.stdout + passed.stderr
        assert "delete guard: served" in passed.stdout + passed.stderr
