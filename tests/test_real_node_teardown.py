"""After the session's node (issue 30): no process, mount, link, bridge, route, address,
cgroup or firewall chain of it is left on the machine, also with a pod still running when
it stops. This stops the session's node (the last node test: test files run in name
order; a node test after it would start another)."""

from __future__ import annotations

import pytest

from testenv import process_alive
from testenv.node import PAUSE_IMAGE, Node, leftovers
from tests.kube import eventually
from tests.real_node import get

pytestmark = pytest.mark.node

POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "left-running", "namespace": "default"},
    "spec": {"containers": [{"name": "pause", "image": PAUSE_IMAGE, "imagePullPolicy": "Never"}]},
}


async def test_stopping_the_node_leaves_nothing_of_it_on_the_machine(real_node: Node) -> None:
    cp = real_node.control_plane
    status, out = cp.request("POST", "/api/v1/namespaces/default/pods", POD)
    assert status == 201, out

    async def running() -> bool:
        pod = get(cp, "/api/v1/namespaces/default/pods/left-running") or {}
        return pod.get("status", {}).get("phase") == "Running"

    await eventually(running, timeout=120, interval=0.5)
    pids = dict(real_node.state.pids)
    processes = {p for p in real_node.state.processes() if p != real_node.state.holder}
    containers = real_node.container_pids()
    assert pids.keys() >= {"kubelet", "containerd", "kube-proxy", "kube-scheduler", "etcd"}
    assert processes and containers, "the node runs (its processes and a container are seen)"

    assert real_node.stop() == []
    assert {n: p for n, p in pids.items() if process_alive(p)} == {}
    assert {p for p in processes | containers if process_alive(p)} == set()
    assert leftovers(real_node.builds.programs, real_node.firewall_before) == []
