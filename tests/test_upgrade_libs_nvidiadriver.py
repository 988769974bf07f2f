"""shared-svc on the real driver-upgrade state machine in NVIDIADriver mode (issue 42).

k8s-operator-libs at the pseudo-version gpu-operator v26.7.0 vendors, driven as gpu-operator
v26.7.0 drives it (``testenv/upgrade-libs/main.go``): in ClusterPolicy mode with the
ClusterPolicy's policy; with ``useNvidiaDriverCRD: true`` or no ClusterPolicy, one cluster
state of the driver pods ``app.kubernetes.io/component=nvidia-driver``, partitioned by the
nodes' ``nvidia.com/gpu-operator.driver.owner`` label, one ``ApplyState`` per NVIDIADriver with
its own ``spec.upgradePolicy``. The NVIDIADriver CRD is gpu-operator v26.7.0's
(tests/data/upstream-crds/). The test plays the DaemonSet controller, the kubelet and the
driver-manager (tests/upgrade_flow.py), and gpu-operator's NVIDIADriver controller where it
matters: each NVIDIADriver's DaemonSet ``nvidia-gpu-driver-ubuntu22.04-<name>`` on the nodes it
owns. The flow's requeue is 30 s here (gpu-operator's is 2 minutes: only the waits shorten).

In the order a cluster lives them, on one control plane:

1. A running ClusterPolicy cluster switched to ``useNvidiaDriverCRD: true``: ``configure-gate``
   writes the ClusterPolicy in its mode, the NVIDIADriver after the switch (the ClusterPolicy's
   gate then shown unread, the NVIDIADriver's verdict missing until it is set); the switch
   orphans the ClusterPolicy's driver pods (its nodes annotated upgrade-requested, as the libs
   mean orphaned pods to be handed over) and every node goes through the flow under the
   NVIDIADriver's gate: each waits in ``wait-for-jobs-required`` until every freed consumer is
   gone, none is left at the driver unload, all is restored at ``upgrade-done``. On today's code
   configure-gate writes the ClusterPolicy again, the NVIDIADriver's gate stays empty, and the
   consumers are still there when the driver restarts.
2. A driver change of the NVIDIADriver (the ordinary upgrade in this mode): the same holds.
3. A GPUCluster cluster (no ClusterPolicy): the review names the NVIDIADriver (never "no upgrade
   flow"), and an upgrade holds the same way.
4. Two NVIDIADrivers with different gates on different nodes: two verdicts (one ``ok``, one
   ``missing`` with its Warning on that NVIDIADriver) in ``/status`` and ``upgrade status``;
   with the first's gate made foreign, ``configure-gate`` writes nothing while one needs
   ``--replace``, then the one named (``--nvidia-driver``), then the other with ``--replace``;
   an upgrade of both holds each node under its own NVIDIADriver's gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient

import testenv
from shared_svc.cli import main as cli
from shared_svc.kube.writer import MERGE_PATCH, raw_request
from shared_svc.upgrade.policy import OWNER_LABEL
from testenv import upgrade_examples as ex
from testenv import upgrade_libs as libs_env
from tests.kube import eventually
from tests.svc import running
from tests.upgrade_flow import (
    APPS,
    DRIVER_COMPONENT,
    DRIVER_DS,
    EXPORTER,
    NODES,
    OPERATOR_NS,
    PARKED,
    UPGRADE_POLICY,
    Cluster,
    K8sObject,
    Recorder,
    consumer_stop_seconds,
    explained,
    exporter_daemonset,
    is_driver,
    libs_plane,
    libs_stand_ins,
    list_items,
    post,
    recording,
    unsettled_nodes,
    upgrade_service_config,
    validator_daemonset,
    wait_until,
    workloads,
)

pytestmark = [pytest.mark.apiserver, pytest.mark.upgrade_libs]

CP_PATH = f"/apis/nvidia.com/v1/clusterpolicies/{libs_env.CLUSTER_POLICY}"
NVD_PATH = "/apis/nvidia.com/v1alpha1/nvidiadrivers"
DS_PATH = f"/apis/apps/v1/namespaces/{OPERATOR_NS}/daemonsets"
DEPLOY_DRIVER = "nvidia.com/gpu.deploy.driver"
DEPLOY_VALIDATOR = "nvidia.com/gpu.deploy.operator-validator"
CONSUMER = "nvidia.com/gpu-driver-upgrade.consumer=true"
DRIVER_STOP_SECONDS = 1.5
REQUEUE_SECONDS = 30.0
REQUESTED = "nvidia.com/gpu-driver-upgrade-requested"  # the libs' "upgrade this node" annotation


def nvd_ds_name(nvd: str) -> str:
    """The DaemonSet gpu-operator's NVIDIADriver controller names for an NVIDIADriver."""
    return f"nvidia-gpu-driver-ubuntu22.04-{nvd}"


@dataclass
class World:
    cp: testenv.ControlPlane
    libs: libs_env.UpgradeLibs
    api: ApiClient
    cluster: Cluster
    versions: dict[str, str]  # driver DaemonSet name -> driver version

    def log(self) -> str:
        return f"upgrade-libs log {self.libs.log}; stand-in errors {self.cluster.errors[-5:]}"


def _stop_seconds(pod: K8sObject) -> float:
    return DRIVER_STOP_SECONDS if is_driver(pod) else consumer_stop_seconds(pod)


def _driver_daemonset(name: str, version: str, *, owner: str | None) -> dict[str, Any]:
    """A driver DaemonSet as gpu-operator writes it: the ClusterPolicy's (``owner`` None:
    ``nvidia-driver-daemonset`` on ``nvidia.com/gpu.deploy.driver``), or an NVIDIADriver's
    (on the nodes it owns), ``OnDelete``, the digest of its driver on both containers."""
    ds = ex.driver_daemonset(f"digest-{version}", name=name, namespace=OPERATOR_NS)
    for key in ("uid", "resourceVersion", "generation"):
        del ds["metadata"][key]
    labels = {"app": name, DRIVER_COMPONENT[0]: DRIVER_COMPONENT[1]}
    ds["metadata"]["labels"] = dict(labels)
    ds["spec"]["selector"] = {"matchLabels": {"app": name}}
    template = ds["spec"]["template"]
    template["metadata"]["labels"] = dict(labels)
    spec = template["spec"]
    spec["terminationGracePeriodSeconds"] = 3
    spec["containers"][0]["image"] = f"nvcr.io/nvidia/driver:{version}-ubuntu22.04"
    if owner is not None:
        spec["nodeSelector"] = {DEPLOY_DRIVER: "true", OWNER_LABEL: owner}
    return ds


def _nvidia_driver(name: str, **policy: Any) -> dict[str, Any]:
    obj = ex.nvidia_driver(name)
    for key in ("uid", "resourceVersion"):
        del obj["metadata"][key]
    obj["spec"]["upgradePolicy"] = {**UPGRADE_POLICY, **policy}
    return obj


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[testenv.ControlPlane]:
    with libs_plane(tmp_path_factory.mktemp("upgrade-libs-nvd")) as cp:
        yield cp


@pytest.fixture(scope="module")
async def world(plane: testenv.ControlPlane) -> AsyncIterator[World]:
    """A ClusterPolicy cluster (ClusterPolicy mode, its driver DaemonSet on both nodes), the
    libs' state machine, the stand-ins, the consumers and the prepared DaemonSet."""
    cp = plane
    stand_ins = libs_stand_ins(cp, _stop_seconds, requeue_seconds=REQUEUE_SECONDS)
    async with stand_ins as (libs, api, cluster):
        w = World(cp, libs, api, cluster, {DRIVER_DS: "580.82.07"})
        for ns in (OPERATOR_NS, APPS):
            await post(api, "/api/v1/namespaces", {"metadata": {"name": ns}})
        policy = ex.cluster_policy(libs_env.CLUSTER_POLICY, auto_upgrade=True)
        for key in ("uid", "resourceVersion", "creationTimestamp"):
            del policy["metadata"][key]
        policy["spec"]["driver"] = {"enabled": True, "upgradePolicy": dict(UPGRADE_POLICY)}
        await post(api, "/apis/nvidia.com/v1/clusterpolicies", policy)
        await post(api, DS_PATH, _driver_daemonset(DRIVER_DS, w.versions[DRIVER_DS], owner=None))
        await post(api, DS_PATH, validator_daemonset())
        await post(api, f"/apis/apps/v1/namespaces/{APPS}/daemonsets", exporter_daemonset())
        assert await _cli(w, "upgrade", "prepare-daemonset", f"{APPS}/{EXPORTER}") == 0
        await wait_until("driver install", lambda: _unsettled(w), w.log)
        yield w


async def _cli(w: World, *args: str) -> int:
    code: int = await asyncio.to_thread(cli, [*args, "--kubeconfig", str(w.cp.kubeconfig)])
    return code


async def _cli_out(w: World, *args: str) -> tuple[int, str]:
    out = io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out):
            return cli([*args, "--kubeconfig", str(w.cp.kubeconfig)])

    code = await asyncio.to_thread(run)
    return code, out.getvalue()


async def _unsettled(w: World) -> str | None:
    assert w.libs.alive(), f"upgrade-libs exited:\n{w.libs.tail()}"
    return await unsettled_nodes(w.api)


async def _get(w: World, path: str) -> dict[str, Any]:
    obj: dict[str, Any] = await raw_request(w.api, "GET", path)
    return obj


async def _merge(w: World, path: str, body: dict[str, Any]) -> dict[str, Any]:
    obj: dict[str, Any] = await raw_request(
        w.api, "PATCH", path, body=body, content_type=MERGE_PATCH
    )
    return obj


def _wait_selector(obj: dict[str, Any], *path: str) -> Any:
    for key in path:
        obj = obj.get(key) or {}
    return (obj.get("waitForCompletion") or {}).get("podSelector")


async def _label_nodes(w: World, nodes: tuple[str, ...], owner: str) -> None:
    """gpu-operator's node labelling controller: the NVIDIADriver that owns each node."""
    for node in nodes:
        await _merge(w, f"/api/v1/nodes/{node}", {"metadata": {"labels": {OWNER_LABEL: owner}}})


async def _orphan(w: World, name: str) -> None:
    """Deletes a DaemonSet leaving its pods (``propagationPolicy: Orphan``), and does what the
    garbage collector (not run here) does then: drops the pods' owner reference to it and
    the DaemonSet's ``orphan`` finalizer. Its pods are orphaned driver pods for the libs."""
    ds = await _get(w, f"{DS_PATH}/{name}")
    await raw_request(w.api, "DELETE", f"{DS_PATH}/{name}", body={"propagationPolicy": "Orphan"})
    for pod in await list_items(w.api, f"/api/v1/namespaces/{OPERATOR_NS}/pods"):
        refs = pod["metadata"].get("ownerReferences") or []
        if any(r.get("uid") == ds["metadata"]["uid"] for r in refs):
            path = f"/api/v1/namespaces/{OPERATOR_NS}/pods/{pod['metadata']['name']}"
            await _merge(w, path, {"metadata": {"ownerReferences": None}})
    await _merge(w, f"{DS_PATH}/{name}", {"metadata": {"finalizers": None}})


async def _change_driver(w: World, ds_name: str, version: str) -> int:
    """A new driver version in a driver DaemonSet (a new digest); the patch's resourceVersion."""
    w.versions[ds_name] = version
    owner = None if ds_name == DRIVER_DS else ds_name.rsplit("-", 1)[1]
    template = _driver_daemonset(ds_name, version, owner=owner)["spec"]["template"]
    patched = await _merge(w, f"{DS_PATH}/{ds_name}", {"spec": {"template": template}})
    return int(patched["metadata"]["resourceVersion"])


async def _gate(service: Any) -> dict[str, Any]:
    gate: dict[str, Any] = await eventually(lambda: _shown_gate(service), timeout=30)
    return gate


async def _shown_gate(service: Any) -> dict[str, Any] | None:
    gate = (service.status().get("upgrade") or {}).get("gate")
    return gate if isinstance(gate, dict) and "verdicts" in gate else None


async def _verdicts(
    service: Any, expected: list[tuple[str, str]], nodes: list[list[str]] | None = None
) -> dict[str, Any]:
    """The gate review once its verdicts are ``expected`` (policy, state), in order, and
    (``nodes``) name those nodes (the review names the cached nodes at its last pass: one
    resync at most after a node's owner label changed)."""

    async def seen() -> dict[str, Any] | None:
        gate = await _shown_gate(service)
        if (
            gate
            and [(v["policy"], v["state"]) for v in gate["verdicts"]] == expected
            and (nodes is None or [v["nodes"] for v in gate["verdicts"]] == nodes)
        ):
            return gate
        return None

    try:
        gate: dict[str, Any] = await eventually(seen, timeout=30)
    except AssertionError:
        raise AssertionError(f"verdicts not {expected}: {await _shown_gate(service)}") from None
    return gate


def _assert_held(
    rec: Recorder,
    started: int,
    nodes: tuple[str, ...],
    freed: dict[str, list[K8sObject]],
    cluster: Cluster,
) -> None:
    """On every node of ``nodes``, from revision ``started`` on: each freed consumer was asked
    to go after cordon and was gone while the node waited in wait-for-jobs-required (the gate
    held), before pod deletion and the driver restart; no consumer was on the node when the
    driver unloaded; the parked label was set and removed after upgrade-done."""
    with explained(rec, (APPS,)):
        for node in nodes:
            cordon = rec.reached_after(node, "cordon-required", started)
            waiting = rec.reached_after(node, "wait-for-jobs-required", started)
            deleting = rec.reached_after(node, "pod-deletion-required", started)
            restart = rec.reached_after(node, "pod-restart-required", started)
            done = rec.reached_after(node, "upgrade-done", restart)
            for pod in freed[node]:
                uid = pod["metadata"]["uid"]
                asked, gone = rec.pod_deletion_requested(uid), rec.pod_deleted(uid)
                assert asked is not None and gone is not None, (node, pod["metadata"]["name"])
                assert cordon < asked < restart, (node, pod["metadata"]["name"], asked)
                assert waiting < gone < deleting < restart, (node, pod["metadata"]["name"], gone)
            parked = [(rv, v) for rv, v in rec.label_changes(node, PARKED) if rv > started]
            while parked and parked[0][1] is None:  # the recorder's first look: not parked
                parked.pop(0)
            assert [v for _, v in parked] == ["true", None], parked
            assert cordon < parked[0][0] < restart and parked[1][0] > done, parked
            # 0 consumers on the node when the driver unloaded.
            assert cluster.at_unload[node] == [[]], cluster.at_unload


async def _upgrade(w: World, rec: Recorder, started: int, nodes: tuple[str, ...] = NODES) -> None:
    async def through() -> str | None:
        return rec.not_through_restart(nodes, started) or await _unsettled(w)

    await wait_until("upgrade", through, w.log)


def _freed(
    declared: dict[str, K8sObject], exporter: dict[str, K8sObject]
) -> dict[str, list[K8sObject]]:
    return {n: [declared[n], exporter[n]] for n in NODES}


async def test_a_switch_to_nvidiadriver_mode_is_gated_where_gpu_operator_reads(
    world: World,
) -> None:
    """1. ClusterPolicy mode, then ``useNvidiaDriverCRD: true`` with an NVIDIADriver."""
    w = world
    async with running(upgrade_service_config(w.cp)) as service:
        # ClusterPolicy mode: configure-gate writes the ClusterPolicy.
        assert await _cli(w, "upgrade", "configure-gate", "--apply") == 0
        assert _wait_selector(await _get(w, CP_PATH), "spec", "driver", "upgradePolicy") == CONSUMER
        await _verdicts(service, [("ClusterPolicy/cluster-policy", "ok")])
        # The switch: an NVIDIADriver as the chart renders it (the ClusterPolicy's policy,
        # without its gate: configure-gate had written only the ClusterPolicy), the mode on.
        await post(w.api, NVD_PATH, _nvidia_driver("default"))
        await _merge(w, CP_PATH, {"spec": {"driver": {"useNvidiaDriverCRD": True}}})
        gate = await _verdicts(service, [("NVIDIADriver/default", "missing")])
        assert gate["mode"] == "nvidia-driver"
        assert gate["unread"] == [f"ClusterPolicy/cluster-policy: {CONSUMER!r}"]
        warned = await eventually(lambda: _events(w, "GPUConsumerGateMissing", "NVIDIADriver"))
        assert warned[0]["regarding"]["name"] == "default"
        # configure-gate now writes the NVIDIADriver, dry-run first: the exact patch, nothing written.
        before = await _get(w, f"{NVD_PATH}/default")
        code, out = await _cli_out(w, "upgrade", "configure-gate")
        assert code == 0 and "kubectl patch nvidiadriver default --type merge" in out, out
        assert '"spec":{"upgradePolicy":{"waitForCompletion":{"podSelector"' in out, out
        after = await _get(w, f"{NVD_PATH}/default")
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
        assert await _cli(w, "upgrade", "configure-gate", "--apply") == 0
        assert (
            _wait_selector(await _get(w, f"{NVD_PATH}/default"), "spec", "upgradePolicy")
            == CONSUMER
        )
        await _verdicts(service, [("NVIDIADriver/default", "ok")])
        code, out = await _cli_out(w, "upgrade", "configure-gate", "--apply")
        assert code == 0 and "nothing to do" in out, out  # idempotent
        # gpu-operator hands its ClusterPolicy driver over as the libs mean orphaned pods to
        # be (as the network operator's migration does): the nodes running it are annotated
        # upgrade-requested, the DaemonSet deleted with its pods orphaned; the NVIDIADriver's
        # DaemonSet takes the nodes it owns. Every node goes through the flow.
        declared, exporter, _ = await workloads(w.api)
        w.cluster.at_unload.clear()
        async with recording(w.api) as rec:
            started = int((await _get(w, CP_PATH))["metadata"]["resourceVersion"])
            for node in NODES:
                await _merge(
                    w, f"/api/v1/nodes/{node}", {"metadata": {"annotations": {REQUESTED: "true"}}}
                )
            await _orphan(w, DRIVER_DS)
            await _label_nodes(w, NODES, "default")
            w.versions[nvd_ds_name("default")] = "580.95.05"
            await post(
                w.api,
                DS_PATH,
                _driver_daemonset(nvd_ds_name("default"), "580.95.05", owner="default"),
            )
            await _upgrade(w, rec, started)
        _assert_held(rec, started, NODES, _freed(declared, exporter), w.cluster)
        await _verdicts(service, [("NVIDIADriver/default", "ok")], [list(NODES)])
    assert w.libs.alive(), w.libs.tail()


async def test_a_driver_change_of_the_nvidiadriver_waits_for_the_consumers(world: World) -> None:
    """2. The ordinary upgrade in NVIDIADriver mode, shared-svc's status naming the source."""
    w = world
    declared, exporter, _ = await workloads(w.api)
    w.cluster.at_unload.clear()
    async with recording(w.api) as rec, running(upgrade_service_config(w.cp)) as service:
        await _verdicts(service, [("NVIDIADriver/default", "ok")])
        started = await _change_driver(w, nvd_ds_name("default"), "590.10.01")
        await _upgrade(w, rec, started)
        shown = service.status()["upgrade"]["nodes"]
        assert all(shown[n]["policy"] == "NVIDIADriver/default" for n in NODES), shown
    _assert_held(rec, started, NODES, _freed(declared, exporter), w.cluster)


async def test_a_gpucluster_cluster_is_reviewed_and_gated_through_its_nvidiadriver(
    world: World,
) -> None:
    """3. No ClusterPolicy: each NVIDIADriver's policy, never "no upgrade flow"."""
    w = world
    await raw_request(w.api, "DELETE", CP_PATH)
    declared, exporter, _ = await workloads(w.api)
    w.cluster.at_unload.clear()
    async with recording(w.api) as rec, running(upgrade_service_config(w.cp)) as service:
        gate = await _verdicts(service, [("NVIDIADriver/default", "ok")])
        assert gate["mode"] == "nvidia-driver" and "no ClusterPolicy" in gate["why"]
        code, out = await _cli_out(w, "upgrade", "status", "-o", "json")
        assert code == 0
        shown = json.loads(out)["gate"]
        assert [(v["policy"], v["state"]) for v in shown["verdicts"]] == [
            ("NVIDIADriver/default", "ok")
        ]
        started = await _change_driver(w, nvd_ds_name("default"), "590.20.02")
        await _upgrade(w, rec, started)
    _assert_held(rec, started, NODES, _freed(declared, exporter), w.cluster)


async def _events(w: World, reason: str, kind: str) -> list[K8sObject]:
    items = await list_items(w.api, "/apis/events.k8s.io/v1/namespaces/default/events")
    return [
        e
        for e in items
        if e.get("reason") == reason and (e.get("regarding") or {}).get("kind") == kind
    ]


async def test_two_nvidiadrivers_with_different_gates_get_two_verdicts(world: World) -> None:
    """4. NVIDIADriver ``other`` owns the second node, without a gate; then both upgrade."""
    w = world
    first, second = NODES
    other = nvd_ds_name("other")
    async with running(upgrade_service_config(w.cp)) as service:
        await post(w.api, NVD_PATH, _nvidia_driver("other"))
        # gpu-operator's controllers: the node's owner, then its driver DaemonSet (the same
        # driver: the modules stay loaded).
        version = w.versions[nvd_ds_name("default")]
        w.versions[other] = version
        await post(w.api, DS_PATH, _driver_daemonset(other, version, owner="other"))
        await _label_nodes(w, (second,), "other")

        async def moved() -> str | None:
            pods = await list_items(w.api, f"/api/v1/namespaces/{OPERATOR_NS}/pods")
            on = [p for p in pods if p["spec"].get("nodeName") == second and is_driver(p)]
            if [p["metadata"]["labels"].get("app") for p in on] != [other]:
                return f"driver pods on {second}: {[p['metadata']['name'] for p in on]}"
            return await _unsettled(w)

        await wait_until("the second node moves to NVIDIADriver other", moved, w.log)
        await _verdicts(
            service,
            [("NVIDIADriver/default", "ok"), ("NVIDIADriver/other", "missing")],
            [[first], [second]],
        )
        warned = await eventually(lambda: _events(w, "GPUConsumerGateMissing", "NVIDIADriver"))
        assert any(e["regarding"]["name"] == "other" for e in warned), warned
        code, out = await _cli_out(w, "upgrade", "status")
        assert code == 0 and "WARNING: missing: NVIDIADriver/other" in out, out
        # The first NVIDIADriver's gate made foreign (it gates Jobs, say): configure-gate
        # writes nothing while that one needs --replace, then the one named, then --replace.
        await _merge(
            w,
            f"{NVD_PATH}/default",
            {"spec": {"upgradePolicy": {"waitForCompletion": {"podSelector": "app=batch"}}}},
        )
        await _verdicts(
            service, [("NVIDIADriver/default", "mismatch"), ("NVIDIADriver/other", "missing")]
        )
        before = (await _get(w, f"{NVD_PATH}/other"))["metadata"]["resourceVersion"]
        assert await _cli(w, "upgrade", "configure-gate", "--apply") == 2
        assert (await _get(w, f"{NVD_PATH}/other"))["metadata"]["resourceVersion"] == before
        code, out = await _cli_out(
            w, "upgrade", "configure-gate", "--apply", "--nvidia-driver", "other"
        )
        assert code == 0 and "applied to NVIDIADriver/other" in out, out
        assert "NVIDIADriver/default" not in out.split(":", 1)[1], out  # the one named only
        await _verdicts(
            service, [("NVIDIADriver/default", "mismatch"), ("NVIDIADriver/other", "ok")]
        )
        code, out = await _cli_out(
            w, "upgrade", "configure-gate", "--apply", "--replace", "--nvidia-driver", "default"
        )
        assert code == 0 and "applied to NVIDIADriver/default" in out, out
        await _verdicts(service, [("NVIDIADriver/default", "ok"), ("NVIDIADriver/other", "ok")])
        # Both upgrade; each node is held by its own NVIDIADriver's gate.
        declared, exporter, _ = await workloads(w.api)
        w.cluster.at_unload.clear()
        async with recording(w.api) as rec:
            started = await _change_driver(w, nvd_ds_name("default"), "600.01.01")
            await _change_driver(w, other, "600.01.01")
            await _upgrade(w, rec, started)
        _assert_held(rec, started, NODES, _freed(declared, exporter), w.cluster)
