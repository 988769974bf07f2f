"""shared-svc next to the real gpu-operator (issue 9, "What it must show"): its ClusterPolicy
controller built from its Go module (testenv/gpu_operator.py), shared-svc running
against gpu-operator's control plane in its namespace, and the admission guard as the chart
renders it (tests/admission.py): the MutatingAdmissionPolicy this 1.36 API server serves and
the delete webhook shared-svc serves by URL, or the mutating webhook instead of the policy.

Two control planes, each with its own gpu-operator, so the scenarios run side by side: on the
first, the 2-minute window under the guard runs in the background from the start of the module
(fixture ``window``) and ``test_guard_holds_through_two_minutes_of_gpu_operator_reconciles``
(last) collects it; the other scenarios run one after another on the second. In the window
gpu-operator's ServiceMonitor step is on too, so it PUTs the ServiceMonitor whole as well.

gpu-operator reconciles (and PUTs each DCGM Service whole, or deletes ``nvidia-dcgm`` when its
DCGM step is off) every ~5 s while one of its DaemonSets is not ready; this gpu-operator takes a
DaemonSet with no status as ready, so the tests mark them not ready first.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

import testenv
from shared_svc.reconcile.names import MANAGED_BY_LABEL, MANAGED_BY_VALUE
from shared_svc.service import Service
from testenv import ControlPlane
from testenv import gpu_operator as gpu_env
from tests.admission import (
    SimulatedOperator,
    Tls,
    guard_docs,
    guard_effective,
    install,
    make_tls,
    uninstall,
    webhook_sets,
)
from tests.kube import api_client, eventually
from tests.svc import Kube, gc_body, running, service_config, settle

pytestmark = [pytest.mark.apiserver, pytest.mark.gpu_operator]

NS = gpu_env.NAMESPACE
NAMES = ("nvidia-dcgm", "nvidia-dcgm-exporter")
OPERANDS = ("nvidia-operator-validator", "nvidia-dcgm", "nvidia-dcgm-exporter")
WINDOW = 120.0  # seconds of gpu-operator reconciles under the guard
# gpu-operator requeues every ~5 s while an operand is not ready: at least one reconcile in
# every 15 s, on a loaded machine.
RECONCILE_EVERY = 15.0
TIMEOUT = 90.0


# --- the clusters ------------------------------------------------------------------------


@dataclass
class Cluster:
    """One control plane with gpu-operator running on it, and an admin client to it."""

    op: gpu_env.GpuOperator
    api: ApiClient
    kube: Kube  # helpers in the namespace gpu-operator

    @property
    def cp(self) -> ControlPlane:
        return self.op.control_plane


@contextlib.contextmanager
def own_gpu_operator(workdir: Path) -> Iterator[gpu_env.GpuOperator]:
    """What the ``gpu_operator`` fixture makes (one GPU node), for a second control plane."""
    try:
        cp = gpu_env.start_control_plane(workdir)
    except testenv.ControlPlaneError as exc:
        pytest.fail(f"control plane for gpu-operator did not start: {exc}", pytrace=False)
    try:
        gpu_env.add_gpu_node(cp, "gpu-node-0")
        try:
            op = gpu_env.start(cp)
        except testenv.ControlPlaneError as exc:
            pytest.fail(f"gpu-operator did not start: {exc}", pytrace=False)
        with op:
            yield op
    finally:
        cp.stop()


@contextlib.asynccontextmanager
async def cluster_of(op: gpu_env.GpuOperator) -> AsyncIterator[Cluster]:
    api = await api_client(op.control_plane)
    try:
        yield Cluster(op, api, Kube(api, NS))
    finally:
        await api.close()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    return make_tls(tmp_path_factory.mktemp("webhook-tls"))


@pytest.fixture(scope="module")
def second_operator(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[gpu_env.GpuOperator]:
    with own_gpu_operator(tmp_path_factory.mktemp("gpu-operator-b")) as op:
        yield op


@pytest.fixture
async def second(second_operator: gpu_env.GpuOperator) -> AsyncIterator[Cluster]:
    async with cluster_of(second_operator) as c:
        yield c


# --- small helpers -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def requests(cp: ControlPlane) -> Counter[tuple[str, str]]:
    return gpu_env.request_counts(cp, "services")


def since(before: Counter[tuple[str, str]], after: Counter[tuple[str, str]]) -> Counter[str]:
    """Requests between two counts: "VERB code" -> count."""
    return Counter(
        {f"{v} {c}": n - before[v, c] for (v, c), n in after.items() if n > before[v, c]}
    )


def now() -> str:
    return gpu_env.now()


async def updated(c: Cluster, start: str, times: int) -> bool:
    """gpu-operator has PUT each of our Services ``times`` times since ``start`` (its log)."""
    counts = c.op.updates(start)
    return all(counts[n] >= times for n in NAMES)


def writes(svc: Service) -> int:
    assert svc.writer is not None
    return sum(svc.writer.writes.values())


async def conflicting_writers(c: Cluster) -> list[dict[str, Any]]:
    return await c.kube.events_for("ConflictingWriter")


async def policy_status(c: Cluster) -> dict[str, Any]:
    return await asyncio.to_thread(gpu_env.cluster_policy_status, c.cp)


async def policy_state(c: Cluster, state: str) -> None:
    async def reached() -> bool:
        assert c.op.alive(), f"gpu-operator exited:\n{c.op.tail()}"
        return (await policy_status(c)).get("state") == state

    await eventually(reached, timeout=TIMEOUT, interval=1)


def reconcile_failed(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Its ReconcileFailed conditions (a refused delete stalls its later states); an
    ``Error`` condition with reason OperandNotReady only says an operand is not ready."""
    return [c for c in status.get("conditions") or [] if c.get("reason") == "ReconcileFailed"]


async def operands(c: Cluster, names: Iterable[str], *, ready: bool) -> None:
    """Waits for gpu-operator's DaemonSets ``names`` and plays their status: every pod
    available, or none (then gpu-operator requeues every ~5 s)."""
    wanted = set(names)

    async def present() -> bool:
        found = {d["metadata"]["name"] for d in await asyncio.to_thread(gpu_env.daemonsets, c.cp)}
        return wanted <= found

    await eventually(present, timeout=TIMEOUT, interval=0.5)
    await asyncio.to_thread(gpu_env.mark_daemonsets, c.cp, ready=ready)


async def owner(c: Cluster) -> dict[str, Any]:
    out: dict[str, Any] = await c.kube.custom.get_cluster_custom_object(
        "nvidia.com", "v1", "clusterpolicies", gpu_env.CLUSTER_POLICY
    )
    return out


def controller(svc: dict[str, Any]) -> bool:
    return any(r.get("controller") for r in svc["metadata"].get("ownerReferences") or [])


def ours(svc: dict[str, Any] | None) -> bool:
    """shared-svc's shape: its managed-by label and no controller owner reference."""
    if svc is None:
        return False
    labels = svc["metadata"].get("labels") or {}
    return labels.get(MANAGED_BY_LABEL) == MANAGED_BY_VALUE and not controller(svc)


def operators(svc: dict[str, Any] | None) -> bool:
    """gpu-operator's shape: its controller owner reference, no managed-by label."""
    if svc is None:
        return False
    labels = svc["metadata"].get("labels") or {}
    return MANAGED_BY_LABEL not in labels and controller(svc)


async def every(
    c: Cluster, check: Callable[[dict[str, Any] | None], bool], names: Iterable[str]
) -> bool:
    return all([check(await c.kube.service(n)) for n in names])


def shape(svc: dict[str, Any] | None) -> dict[str, Any]:
    """What shared-svc owns on a Service, with its identity and version."""
    assert svc is not None
    meta = svc["metadata"]
    return {
        "labels": meta.get("labels"),
        "annotations": meta.get("annotations"),
        "ownerReferences": meta.get("ownerReferences"),
        "spec": svc["spec"],
        "uid": meta["uid"],
        "resourceVersion": meta["resourceVersion"],
    }


async def shapes(c: Cluster, names: Iterable[str] = NAMES) -> dict[str, dict[str, Any]]:
    return {n: shape(await c.kube.service(n)) for n in names}


def assert_ours(svc: Service, live: dict[str, dict[str, Any]]) -> None:
    """Non-controller owner refs, the managed-by label, and the selector shared-svc's gate
    chose (its last plan)."""
    planned = {o["name"]: o["selector"] for o in svc.status()["objects"] if o["kind"] == "Service"}
    for name, s in live.items():
        assert (s["labels"] or {}).get(MANAGED_BY_LABEL) == MANAGED_BY_VALUE, (name, s["labels"])
        refs = s["ownerReferences"] or []
        assert refs and all(not r.get("controller") for r in refs), (name, refs)
        assert s["spec"]["selector"] == planned[name], (name, s["spec"]["selector"], planned)


async def guard_holds(c: Cluster, names: Iterable[str] = NAMES) -> None:
    """The API server applies the guard to gpu-operator's shape of update (a dry run)."""
    writer = SimulatedOperator(c.api, NS, await owner(c))
    for name in names:
        await guard_effective(lambda n=name: writer.put(n, dry_run=True))


def chart_guard(tls: Tls, port: int, *, mutation: str) -> list[dict[str, Any]]:
    """The chart's admission objects out of cluster: the webhooks by URL, with the test CA."""
    return guard_docs(NS, *webhook_sets(tls, port, mutation=mutation))


@contextlib.contextmanager
def guard(cp: ControlPlane, docs: list[dict[str, Any]]) -> Iterator[None]:
    install(cp, docs)
    try:
        yield
    finally:
        uninstall(cp, docs)


def webhook_config(cp: ControlPlane, tls: Tls, port: int, **overrides: Any) -> Any:
    return service_config(
        cp,
        NS,
        webhook_cert_file=tls.cert_file,
        webhook_key_file=tls.key_file,
        webhook_port=port,
        **overrides,
    )


async def fresh(
    c: Cluster, spec: dict[str, Any] | None = None, *, operands_of: Iterable[str] = OPERANDS
) -> None:
    """The second cluster as gpu-operator alone leaves it with the ClusterPolicy ``spec``:
    no GPUCluster, no Event, its DaemonSets not ready, its own Services (re-created)."""
    for gc in (
        await c.kube.custom.list_cluster_custom_object("nvidia.com", "v1alpha1", "gpuclusters")
    )["items"]:
        await c.kube.delete_cr("GPUCluster", gc["metadata"]["name"])
    await asyncio.to_thread(gpu_env.apply_cluster_policy, c.cp, spec)
    for name in NAMES:
        with contextlib.suppress(ApiException):
            await c.kube.core.delete_namespaced_service(name, NS)
    await c.kube.events.delete_collection_namespaced_event(NS)
    await operands(c, operands_of, ready=False)
    expected = [n for n in NAMES if n != "nvidia-dcgm" or "nvidia-dcgm" in operands_of]

    await eventually(lambda: every(c, operators, expected), timeout=TIMEOUT, interval=0.5)


# --- the 2-minute window under the guard (first cluster, in the background) ---------------


@dataclass
class Window:
    seconds: float
    samples: int
    reconciles: int
    updates: Counter[str]  # gpu-operator's logged updates of our Services in the window
    requests: Counter[str]  # the API server's count of Service requests in the window
    writes: int  # shared-svc's writes in the window
    conflicts: list[dict[str, Any]]
    contested: list[dict[str, Any]]
    mode: str
    ready_state: str
    failed: list[dict[str, Any]]
    after_ready: dict[str, dict[str, Any]]
    baseline: dict[str, dict[str, Any]]
    monitor_requests: Counter[str]  # ... of ServiceMonitor requests in the window


# gpu-operator's ServiceMonitor step on too: it PUTs the ServiceMonitor whole as well.
MONITORED = {"dcgmExporter": {"serviceMonitor": {"enabled": True}}}
MONITOR = "ServiceMonitor/nvidia-dcgm-exporter"


async def watched(c: Cluster) -> dict[str, dict[str, Any]]:
    """The Services and the ServiceMonitor: what shared-svc owns, uid, resourceVersion."""
    out = await shapes(c)
    out[MONITOR] = shape(await c.kube.service_monitor("nvidia-dcgm-exporter"))
    return out


async def run_window(op: gpu_env.GpuOperator, tls: Tls) -> Window:
    async with cluster_of(op) as c:
        port = free_port()
        with guard(c.cp, chart_guard(tls, port, mutation="policy")):
            await asyncio.to_thread(gpu_env.apply_cluster_policy, c.cp, MONITORED)
            await operands(c, OPERANDS, ready=False)
            await policy_state(c, "notReady")
            async with running(webhook_config(c.cp, tls, port)) as svc:
                await settle(svc, timeout=TIMEOUT)
                await guard_holds(c)
                await settle(svc, timeout=TIMEOUT)
                baseline = await watched(c)
                assert_ours(svc, {n: baseline[n] for n in NAMES})
                monitor = baseline[MONITOR]
                assert (monitor["labels"] or {}).get(MANAGED_BY_LABEL) == MANAGED_BY_VALUE
                assert not any(r.get("controller") for r in monitor["ownerReferences"] or [])
                written, before, start = writes(svc), requests(c.cp), now()
                monitor_before = gpu_env.request_counts(c.cp, "servicemonitors")
                t0 = time.monotonic()
                samples = 0
                while time.monotonic() - t0 < WINDOW:
                    await asyncio.sleep(2)
                    live = await watched(c)
                    changed = {
                        n: [k for k in live[n] if live[n][k] != baseline[n][k]] for n in live
                    }
                    assert live == baseline, f"after {time.monotonic() - t0:.0f}s: {changed}"
                    assert op.alive(), op.tail()
                    samples += 1
                seconds = time.monotonic() - t0
                window = Window(
                    seconds=seconds,
                    samples=samples,
                    reconciles=op.reconciles(start),
                    updates=op.updates(start),
                    requests=since(before, requests(c.cp)),
                    writes=writes(svc) - written,
                    conflicts=await conflicting_writers(c),
                    contested=svc.status()["contested"],
                    mode=svc.status()["admissionGuard"]["mode"],
                    ready_state="",
                    failed=[],
                    after_ready={},
                    baseline=baseline,
                    monitor_requests=since(
                        monitor_before, gpu_env.request_counts(c.cp, "servicemonitors")
                    ),
                )
                # Its DaemonSets ready: the ClusterPolicy reaches ready, the Services kept.
                await operands(c, OPERANDS, ready=True)
                with contextlib.suppress(AssertionError):
                    await policy_state(c, "ready")
                status = await policy_status(c)
                window.ready_state = str(status.get("state"))
                window.failed = reconcile_failed(status)
                window.after_ready = await watched(c)
                window.conflicts = await conflicting_writers(c)
                return window


@pytest.fixture(scope="module", autouse=True)
async def window(
    gpu_operator: gpu_env.GpuOperator, second_operator: gpu_env.GpuOperator, tls: Tls
) -> AsyncIterator[asyncio.Future[Window]]:
    """Starts the window at the start of the module (both control planes up first: their
    start blocks) and stops it at the end if the window test did not collect it."""
    task = asyncio.ensure_future(run_window(gpu_operator, tls))
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# --- the scenarios on the second cluster ------------------------------------------------


async def test_without_a_guard_the_fight_is_reported_once_per_service_naming_gpu_operator(
    second: Cluster,
) -> None:
    c = second
    await fresh(c)
    async with running(service_config(c.cp, NS)) as svc:

        async def reported() -> list[dict[str, Any]]:
            events = await conflicting_writers(c)
            return events if len(events) >= len(NAMES) else []

        await eventually(reported, timeout=TIMEOUT, interval=1)
        # The fight goes on (gpu-operator keeps updating): no further report.
        start = now()
        await eventually(
            lambda: asyncio.sleep(0, c.op.reconciles(start) >= 3), timeout=TIMEOUT, interval=1
        )
        events = await conflicting_writers(c)
        missing = await c.kube.events_for("AdmissionGuardMissing")
        contested = {x["object"] for x in svc.status()["contested"]}
        mode = svc.status()["admissionGuard"]["mode"]
    # One Event object per Service (a repeat would be its series), naming the writer as its
    # managedFields entry does.
    assert sorted(e["regarding"]["name"] for e in events) == sorted(NAMES), events
    for event in events:
        assert "gpu-operator / Update" in event["note"], event["note"]
    assert [(e["type"], "gpu-operator" in e["note"]) for e in missing] == [("Warning", True)]
    assert contested == {f"Service/{n}" for n in NAMES}
    assert mode == "none"
    # gpu-operator's shape won: that is what the guard is for.
    assert await every(c, operators, NAMES)


async def test_webhook_down_lets_operator_writes_through_and_shared_svc_repairs(
    second: Cluster, tls: Tls
) -> None:
    c = second
    await fresh(c)
    port = free_port()
    config = webhook_config(c.cp, tls, port)
    docs = chart_guard(tls, port, mutation="webhook")
    assert {d["kind"] for d in docs} == {
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
    }, "the webhook mutates (no policy)"
    with guard(c.cp, docs):
        async with running(config) as svc:
            await settle(svc, timeout=TIMEOUT)
            await guard_holds(c)
            await settle(svc, timeout=TIMEOUT)
            kept = await shapes(c)
            assert_ours(svc, kept)
            assert svc.status()["admissionGuard"]["mode"] == "webhook"
            # The webhook makes gpu-operator's own PUTs no-ops.
            start = now()
            await eventually(lambda: updated(c, start, 2), timeout=TIMEOUT, interval=1)
            assert await shapes(c) == kept

        # shared-svc, and with it the webhook, is down: failurePolicy Ignore lets
        # gpu-operator's next updates through.
        await eventually(lambda: every(c, operators, NAMES), timeout=TIMEOUT, interval=0.5)
        async with running(config) as svc:
            await settle(svc, timeout=TIMEOUT)
            repaired = await shapes(c)
            for name in NAMES:
                for key in ("labels", "annotations", "ownerReferences", "uid"):
                    assert repaired[name][key] == kept[name][key], (name, key)
                assert repaired[name]["spec"]["selector"] == kept[name]["spec"]["selector"]
                assert repaired[name]["spec"]["clusterIP"] == kept[name]["spec"]["clusterIP"]
            assert_ours(svc, repaired)
            # ... and the webhook holds again through gpu-operator's next reconciles.
            start = now()
            await eventually(lambda: updated(c, start, 2), timeout=TIMEOUT, interval=1)
            assert await shapes(c) == repaired
            assert await conflicting_writers(c) == []


async def test_dcgm_disabled_keeps_the_service_a_gpucluster_needs(
    second: Cluster, tls: Tls
) -> None:
    c = second
    await fresh(
        c,
        {"dcgm": {"enabled": False}},
        operands_of=("nvidia-operator-validator", "nvidia-dcgm-exporter"),
    )
    await c.kube.create_cr(gc_body())
    port = free_port()
    docs = chart_guard(tls, port, mutation="policy")
    with guard(c.cp, docs):
        async with running(webhook_config(c.cp, tls, port)) as svc:
            # gpu-operator deleted nvidia-dcgm; shared-svc puts it back for the GPUCluster.
            await eventually(lambda: _ours(c, "nvidia-dcgm"), timeout=TIMEOUT, interval=0.5)
            await settle(svc, timeout=TIMEOUT)
            needed = {o["name"]: o["neededBy"] for o in svc.status()["objects"]}
            assert any("GPUCluster" in n for n in needed["nvidia-dcgm"]), needed
            before = await c.kube.service("nvidia-dcgm")
            assert before is not None
            counted = requests(c.cp)

            # Its deletes by name (one a reconcile) are answered 404.
            async def refused() -> bool:
                return since(counted, requests(c.cp))["DELETE 404"] >= 3

            await eventually(refused, timeout=TIMEOUT, interval=1)
            after = await c.kube.service("nvidia-dcgm")
            assert after is not None
            assert after["metadata"]["uid"] == before["metadata"]["uid"]
            assert after["spec"]["clusterIP"] == before["spec"]["clusterIP"]
            assert since(counted, requests(c.cp))["DELETE 200"] == 0
            assert reconcile_failed(await policy_status(c)) == []
            # and it goes on to its later states: ready once its DaemonSets are.
            await operands(c, ("nvidia-operator-validator", "nvidia-dcgm-exporter"), ready=True)
            await policy_state(c, "ready")
            assert reconcile_failed(await policy_status(c)) == []
            last = await c.kube.service("nvidia-dcgm")
            assert last is not None and last["metadata"]["uid"] == before["metadata"]["uid"]


async def _ours(c: Cluster, name: str) -> bool:
    return ours(await c.kube.service(name))


# --- the window's verdict (last: it runs from the start of the module) --------------------


async def test_guard_holds_through_two_minutes_of_gpu_operator_reconciles(
    window: asyncio.Future[Window],
) -> None:
    w = await window
    assert w.seconds >= WINDOW and w.samples >= WINDOW / 4
    # gpu-operator reconciled throughout, PUTting both Services whole each time ...
    assert w.reconciles >= WINDOW / RECONCILE_EVERY, w.reconciles
    for name in NAMES:
        assert w.updates[name] >= WINDOW / RECONCILE_EVERY, w.updates
    # (gpu-operator logs an update just before it sends it: at the window's end one PUT per
    # Service may be logged and not yet counted by the API server.)
    assert w.requests["PUT 200"] >= sum(w.updates.values()) - len(w.updates), w.requests
    assert [k for k in w.requests if k.startswith("PUT ") and k != "PUT 200"] == [], w.requests
    # ... and every PUT was accepted and changed nothing (sampled every 2 s: same
    # resourceVersion, labels, owner references, spec), with no write by shared-svc.
    assert w.writes == 0
    assert w.requests["APPLY 200"] == 0 and w.requests["PATCH 200"] == 0, w.requests
    # The same for its ServiceMonitor (only gpu-operator PUTs it; shared-svc applies).
    assert w.monitor_requests["PUT 200"] >= WINDOW / RECONCILE_EVERY, w.monitor_requests
    assert w.monitor_requests["APPLY 200"] == 0, w.monitor_requests
    assert w.conflicts == [] and w.contested == []
    assert w.mode == "policy"
    # Its DaemonSets ready: the ClusterPolicy is ready, the Services untouched.
    assert w.ready_state == "ready" and w.failed == []
    assert w.after_ready == w.baseline
