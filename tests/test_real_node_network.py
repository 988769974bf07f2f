"""No packet of the real node leaves the machine (issue 30): every range of the node (its
pods, its Services, its link) routes locally, in the host's network namespace and in the
node's, checked before anything started (testenv/node refuses otherwise) and here again
with pods running; a pod's connection to an address outside fails at once (no route), while
the Service it needs (the API server's) answers."""

from __future__ import annotations

import ipaddress
import json
import subprocess

import pytest

from testenv.node import HOST_IP, NODE_LINK, SERVICE_CIDR, Node, default_gateway, route_problems
from tests.real_node import pod_manifest, run_pod

pytestmark = pytest.mark.node

# From inside a pod: where a connection goes (errno, or "connected").
CONNECT = """
import json, socket, sys
out = {}
for host, port in [tuple(a.split(":")) for a in sys.argv[1:]]:
    s = socket.socket()
    s.settimeout(10)
    try:
        s.connect((host, int(port)))
        out[host] = "connected"
    except OSError as exc:
        out[host] = exc.errno if exc.errno is not None else type(exc).__name__
    finally:
        s.close()
print(json.dumps(out))
"""
EHOSTUNREACH, ENETUNREACH = 113, 101


def test_every_range_of_the_node_routes_locally(real_node: Node) -> None:
    assert route_problems(real_node.state.holder) == []


def test_a_route_off_the_machine_is_found(real_node: Node) -> None:
    # The check can fail: a route out of the node's namespace through the veth (a host
    # that forwards would send it on) is reported. Nothing is sent.
    in_node = ["nsenter", f"--target={real_node.state.holder}", "--net", "--"]
    route = ["1.1.1.0/24", "via", HOST_IP, "dev", NODE_LINK]
    subprocess.run([*in_node, "ip", "route", "add", *route], check=True, timeout=30)
    try:
        problems = route_problems(real_node.state.holder)
    finally:
        subprocess.run([*in_node, "ip", "route", "del", *route], check=True, timeout=30)
    assert problems == [
        f"1.1.1.1 routes to dev {NODE_LINK} in the node namespace (expected unreachable)"
    ]
    assert route_problems(real_node.state.holder) == []


async def test_a_pod_reaches_the_api_server_and_nothing_outside(real_node: Node) -> None:
    services = ipaddress.ip_network(SERVICE_CIDR)
    kubernetes, unused = str(services[1]), str(services[-6])
    outside = ["1.1.1.1", unused, default_gateway() or "192.0.2.1"]
    log = await run_pod(
        real_node.control_plane,
        "network",
        pod_manifest(
            "connect",
            ["python", "-c", CONNECT, f"{kubernetes}:443", *(f"{a}:80" for a in outside)],
        ),
    )
    seen = json.loads(log)
    assert seen[kubernetes] == "connected", seen  # the kubernetes Service, through kube-proxy
    for address in outside:
        assert seen[address] in (EHOSTUNREACH, ENETUNREACH), seen
