"""The guard's reach where the control plane is fenced (issue 43), on the real node: the
checkout's chart installed by the helm CLI, the API server calling the webhook through the
chart's Service (pod IP and container port), ``helm test`` running ``shared-svc admission
probe`` in a pod under shared-svc's ServiceAccount.

The fences are firewall rules in the node's network namespace on the connections the API
server's address opens to the pod range (the connections it keeps open included), as the
providers set them: GKE private clusters admit the control plane to nodes and pods on 443
and 10250 only. The pods' own connections to the API server (and their answers) pass."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Iterator

import pytest

from testenv.node import HOST_IP, POD_CIDR, Node
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
