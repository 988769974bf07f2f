"""The soak's real parties and its faults (see tests/soak/__init__.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

import testenv
from testenv import ControlPlane
from testenv import gpu_operator as gpu_env
from testenv.workloads import pod_labels
from tests.admission import ADMISSION_KINDS, Tls, install, make_tls, webhook_sets
from tests.apiproxy import TcpProxy, kubeconfig_via
from tests.soak import model as m
from tests.soak.api import answer, items
from tests.soak.model import CP, CR, GC, Key
from tests.soak.upgrades import NODE_LABELS, Upgrades, start_upgrades, stop_upgrades
from tests.test_deploy_chart import rbac_docs, render_docs
from tests.upgrade_flow import node_eligible

NS = gpu_env.NAMESPACE
RELEASE = "shared-svc"
ROOT = Path(__file__).resolve().parents[2]
REPLICAS = ("shared-svc-0", "shared-svc-1")
GC_API = "/apis/nvidia.com/v1alpha1/gpuclusters"
CP_API = "/apis/nvidia.com/v1/clusterpolicies"
BINDINGS = ("RoleBinding", "ClusterRoleBinding")
NODES = ("gpu-node-0", "gpu-node-1")
APPS = (m.DCGM, m.EXPORTER, m.DCGM_DRA, m.EXPORTER_DRA)  # each stack's DaemonSet and app label
MERGE = "application/merge-patch+json"
STAND_IN = "soak-gpucluster-controller"  # the field manager of the DRA DaemonSets
START = "--- start "  # the line a replica's log gets before each of its starts


def dra_daemonset(app: str, common: bool) -> dict[str, Any]:
    """A DaemonSet of the GPUCluster stack, as gpu-operator's GPUCluster controller makes it
    (the common label on its template once its rollout brings it)."""
    labels = pod_labels(app, common=common)
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": app, "namespace": NS, "labels": {"app": app}},
        "spec": {
            "selector": {"matchLabels": {"app": app}},
            "updateStrategy": {"type": "OnDelete"},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "registry.invalid/dcgm:soak"}]},
            },
        },
    }


def _cr_path(key: Key) -> str:
    kind, name = key
    return f"{CP_API if kind == CP else GC_API}/{name}"


class FailoverProxy(TcpProxy):
    """The chart's webhook Service: each connection goes to a replica that accepts it,
    the next one in turn first (``freeze`` makes every replica unreachable)."""

    def __init__(self, ports: list[int]) -> None:
        super().__init__(ports[0])
        self.ports = ports
        self.turn = 0

    @classmethod
    async def serving(cls, ports: list[int]) -> FailoverProxy:
        proxy = cls(ports)
        proxy.server = await asyncio.start_server(proxy._serve, "127.0.0.1", 0)
        proxy.port = proxy.server.sockets[0].getsockname()[1]
        return proxy

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.turn += 1
        for i in range(len(self.ports)):
            port = self.ports[(self.turn + i) % len(self.ports)]
            try:
                _, probe = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                continue
            probe.close()
            self.target_port = port
            await super()._serve(reader, writer)
            return
        writer.close()


@dataclass
class Replica:
    """One ``shared-svc run`` process (the chart's defaults, its RBAC, through the API
    proxy); ``plant`` runs it through tests/soak/replica.py with a known bug planted."""

    name: str
    env: dict[str, str]
    log: Path
    port: int
    plant: str = ""
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    read_to: int = 0  # how far the runner has read its log

    def start(self) -> None:
        args = [sys.executable, "-m", "tests.soak.replica", self.plant or "-", "run"]
        with self.log.open("ab") as out:
            out.write(f"{START}{self.starts} ---\n".encode())
            self.proc = subprocess.Popen(
                args, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def wait(self, timeout: float) -> bool:
        """Whether it exited within ``timeout``."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self) -> None:
        if self.alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            if not self.wait(60):
                self.signal(signal.SIGKILL)
                self.wait(10)

    def get(self, path: str, timeout: float = 2.0) -> str | None:
        """The replica's answer at ``path`` (None: it does not answer)."""
        if not self.alive():
            return None
        try:
            url = f"http://127.0.0.1:{self.port}{path}"
            with urllib.request.urlopen(url, timeout=timeout) as r:
                text: str = r.read().decode()
                return text
        except (OSError, ValueError):
            return None

    def status(self) -> dict[str, Any] | None:
        text = self.get("/status")
        with contextlib.suppress(ValueError):
            return json.loads(text) if text else None
        return None

    def writes(self) -> float | None:
        """Its ``shared_svc_writes_total``, all labels summed (None: no answer)."""
        text = self.get("/metrics")
        if text is None:
            return None
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("shared_svc_writes_total{")
        )


@dataclass
class World:
    workdir: Path
    cp: ControlPlane
    op: gpu_env.GpuOperator
    api_proxy: TcpProxy
    webhook: FailoverProxy
    replicas: list[Replica]
    rbac: list[dict[str, Any]]
    guard: list[dict[str, Any]]
    upgrades: Upgrades
    # the DRA DaemonSets as last applied (which, and with the common labels or not)
    dra: tuple[frozenset[str], bool] | None = None

    # --- the CRs ----------------------------------------------------------------------

    def apply_cr(self, cr: CR) -> None:
        """Server-side applies ``cr`` (a later apply drops the fields an earlier one set)."""
        if cr.kind == CP:
            gpu_env.apply_cluster_policy(self.cp, cr.spec(), name=cr.name)
            return
        body = {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": GC,
            "metadata": {"name": cr.name},
            "spec": cr.spec(),
        }
        self.cp.apply_manifests([body])

    def delete_cr(self, key: Key) -> None:
        path = _cr_path(key)
        status, body = self.cp.request("DELETE", path)
        if status not in (200, 202, 404):
            raise AssertionError(f"DELETE {path}: {status} {body}")
        # Gone before the step ends (no finalizers here): the next create is a new CR.
        gpu_env.wait_for(
            lambda: self.cp.request("GET", path)[0] == 404, 10, f"{path} gone after its delete"
        )

    def uid_of(self, key: Key) -> str | None:
        status, body = answer(self.cp, "GET", _cr_path(key))
        return body["metadata"]["uid"] if status == 200 else None

    def objects(self, plural: str) -> dict[str, dict[str, Any]]:
        api = "/api/v1" if plural == "services" else "/apis/monitoring.coreos.com/v1"
        return {o["metadata"]["name"]: o for o in self._list(f"{api}/namespaces/{NS}/{plural}")}

    # --- the stand-ins: gpu-operator's GPUCluster controller, the DaemonSet controller, the
    # kubelet (kube-controller-manager here runs the collector and EndpointSlices only) ---

    def sync(self, model: m.Model) -> None:
        """One round of the stand-ins: the DRA DaemonSets as ``model``'s GPUCluster needs
        them; a Running, Ready pod per node of each DaemonSet of the four apps, a pod whose
        labels differ from its template's relabelled one per DaemonSet and round (an
        OnDelete rollout, node by node) on each node its template's nodeSelector takes
        (gpu-operator's DaemonSets select their deploy label, which the driver-manager
        parks during a driver upgrade), none on the others; each DaemonSet's status as its
        controller reports it; the pods of a DaemonSet that went deleted. Then the upgrade
        side's round (tests/soak/upgrades.py)."""
        nodes = {n["metadata"]["name"]: n for n in self._list("/api/v1/nodes")}
        self.upgrades.sync(model, nodes)
        wanted = frozenset({m.DCGM_DRA, m.EXPORTER_DRA} & model.needs().keys())
        if self.dra != (wanted, model.dra_common):  # once per change of the model
            for app in (m.DCGM_DRA, m.EXPORTER_DRA):
                if app in wanted:
                    self.cp.apply_manifests(
                        [dra_daemonset(app, model.dra_common)], field_manager=STAND_IN
                    )
                else:
                    self.cp.request("DELETE", f"/apis/apps/v1/namespaces/{NS}/daemonsets/{app}")
            self.dra = (wanted, model.dra_common)
        daemonsets = {
            d["metadata"]["name"]: d
            for d in self._list(f"/apis/apps/v1/namespaces/{NS}/daemonsets")
            if d["metadata"]["name"] in APPS
        }
        pods = {p["metadata"]["name"]: p for p in self._list(f"/api/v1/namespaces/{NS}/pods")}
        for name, live in list(pods.items()):
            of = (live["metadata"].get("labels") or {}).get("app")
            if of in APPS and (of not in daemonsets or live["metadata"].get("deletionTimestamp")):
                # the kubelet confirms at once: the pod's containers are gone
                path = f"/api/v1/namespaces/{NS}/pods/{name}"
                self.cp.request("DELETE", path, {"gracePeriodSeconds": 0})
                del pods[name]
        for app, ds in daemonsets.items():
            labels = ds["spec"]["template"]["metadata"].get("labels") or {}
            relabelled = False
            updated = 0
            eligible = [n for n in NODES if node_eligible(ds["spec"]["template"]["spec"], nodes[n])]
            for node in NODES:
                pod_name = f"{app}-{node}"
                pod = pods.get(pod_name)
                if node not in eligible:
                    if pod is not None:  # the kubelet confirms at once
                        path = f"/api/v1/namespaces/{NS}/pods/{pod_name}"
                        self.cp.request("DELETE", path, {"gracePeriodSeconds": 0})
                    continue
                if pod is None:
                    self._pod(pod_name, node, labels)
                elif (pod["metadata"].get("labels") or {}) != labels and not relabelled:
                    relabelled = True
                    path = f"/api/v1/namespaces/{NS}/pods/{pod_name}"
                    # merge patch: a label the template dropped is removed (null)
                    drop = {k: None for k in pod["metadata"].get("labels") or {} if k not in labels}
                    self.cp.request(
                        "PATCH",
                        path,
                        {"metadata": {"labels": {**drop, **labels}}},
                        content_type=MERGE,
                    )
                else:
                    updated += pod is not None and (pod["metadata"].get("labels") or {}) == labels
            updated += relabelled
            status = {
                "observedGeneration": ds["metadata"].get("generation", 1),
                "desiredNumberScheduled": len(eligible),
                "currentNumberScheduled": len(eligible),
                "numberScheduled": len(eligible),
                "updatedNumberScheduled": updated,
                "numberReady": len(eligible),
                "numberAvailable": len(eligible),
                "numberMisscheduled": 0,
            }
            if ds.get("status") != {**ds.get("status", {}), **status}:
                self.cp.request(
                    "PATCH",
                    f"/apis/apps/v1/namespaces/{NS}/daemonsets/{app}/status",
                    {"status": status},
                    content_type=MERGE,
                )

    def _list(self, path: str) -> list[dict[str, Any]]:
        return items(self.cp, path)

    def _pod(self, name: str, node: str, labels: dict[str, str]) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {
                "nodeName": node,
                "containers": [{"name": "c", "image": "registry.invalid/dcgm:soak"}],
            },
        }
        path = f"/api/v1/namespaces/{NS}/pods"
        status, out = self.cp.request("POST", path, body)
        if status not in (201, 409):
            raise AssertionError(f"POST {path}: {status} {out}")
        ready = {
            "status": {
                "phase": "Running",
                "podIP": f"10.244.{NODES.index(node)}.{APPS.index(labels['app']) + 10}",
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        }
        self.cp.request("PATCH", f"{path}/{name}/status", ready, content_type=MERGE)

    def pods(self) -> list[dict[str, Any]]:
        return self._list(f"/api/v1/namespaces/{NS}/pods")

    # --- the faults -------------------------------------------------------------------

    def replica_of(self, leader: bool) -> int:
        """The index of the leading replica (``leader``) or of a standby; the first one
        when none says it leads."""
        leading = [i for i, r in enumerate(self.replicas) if (r.status() or {}).get("leader")]
        lead = leading[0] if leading else 0
        return lead if leader else 1 - lead

    def restart_replica(self, i: int, sig: int) -> None:
        r = self.replicas[i]
        r.signal(sig)
        if not r.wait(60):
            r.signal(signal.SIGKILL)
            r.wait(10)
        r.start()

    def set_rbac(self, granted: bool) -> None:
        bindings = [d for d in self.rbac if d["kind"] in BINDINGS]
        if granted:
            self.cp.apply_manifests(bindings, field_manager="helm")
            return
        for d in bindings:
            ns = d["metadata"].get("namespace")
            plural = "rolebindings" if d["kind"] == "RoleBinding" else "clusterrolebindings"
            where = f"namespaces/{ns}/" if ns else ""
            path = f"/apis/rbac.authorization.k8s.io/v1/{where}{plural}/{d['metadata']['name']}"
            self.cp.request("DELETE", path)

    def delete_lease(self) -> None:
        self.cp.request("DELETE", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{RELEASE}")

    def log_lines(self) -> list[tuple[str, str]]:
        """The lines each replica logged since the last call, as (replica, line)."""
        out = []
        for r in self.replicas:
            with r.log.open("rb") as f:
                f.seek(r.read_to)
                data = f.read()
            complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits
            r.read_to += len(complete)
            out += [(r.name, line) for line in complete.decode(errors="replace").splitlines()]
        return out


def chart_sets(tls: Tls, webhook_port: int) -> tuple[str, ...]:
    return (
        "controllers.upgrade=true",
        *webhook_sets(tls, webhook_port, mutation="policy"),
    )


def _parties(workdir: Path) -> tuple[ControlPlane, gpu_env.GpuOperator, Tls]:
    workdir.mkdir(parents=True, exist_ok=True)
    cp = gpu_env.start_control_plane(workdir / "control-plane", controller_manager=True)
    try:
        for node in NODES:
            gpu_env.add_gpu_node(cp, node, labels=NODE_LABELS)
        op = gpu_env.start(cp, upgrade_controller=False)
    except BaseException:
        cp.stop()
        raise
    return cp, op, make_tls(workdir / "tls")


def _replicas(
    cp: ControlPlane, workdir: Path, api_url: str, tls: Tls, ports: list[int], plant: str
) -> list[Replica]:
    """The replicas (not started): the chart's ServiceAccount's token, through the proxy."""
    token = cp.service_account_token(NS, RELEASE, seconds=7 * 24 * 3600)  # a long soak
    own = cp.write_kubeconfig(workdir / "shared-svc.kubeconfig", token, user=RELEASE)
    kubeconfig = kubeconfig_via(cp, api_url, workdir / "via-proxy.kubeconfig")
    config = yaml.safe_load(kubeconfig.read_text())
    config["users"] = yaml.safe_load(own.read_text())["users"]
    config["contexts"][0]["context"]["user"] = config["users"][0]["name"]
    kubeconfig.write_text(yaml.safe_dump(config))
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHARED_SVC_")}
    replicas = []
    for name, wport in zip(REPLICAS, ports, strict=True):
        port = testenv.free_port()
        env = {
            **base,
            "KUBECONFIG": str(kubeconfig),
            "OPERATOR_NAMESPACE": NS,
            "POD_NAME": name,
            "SHARED_SVC_BIND_ADDRESS": "127.0.0.1",
            "SHARED_SVC_PORT": str(port),
            "SHARED_SVC_WEBHOOK_PORT": str(wport),
            "SHARED_SVC_WEBHOOK_CERT_FILE": tls.cert_file,
            "SHARED_SVC_WEBHOOK_KEY_FILE": tls.key_file,
            "SHARED_SVC_UPGRADE_CONTROLLER": "true",
        }
        replicas.append(Replica(name, env, workdir / f"{name}.log", port, plant))
    return replicas


async def start_world(workdir: Path, *, plant: str = "") -> World:
    """Starts every party and the two replicas (the runner waits for them to settle)."""
    cp, op, tls = await asyncio.to_thread(_parties, workdir)
    try:
        webhook_ports = [testenv.free_port() for _ in REPLICAS]
        webhook = await FailoverProxy.serving(webhook_ports)
        api_proxy = await TcpProxy.start(cp)
        docs = render_docs(*chart_sets(tls, webhook.port), name=RELEASE, namespace=NS)
        rbac = rbac_docs(docs)
        guard = [d for d in docs if d["kind"] in ADMISSION_KINDS]
        await asyncio.to_thread(cp.apply_manifests, rbac, field_manager="helm")
        await asyncio.to_thread(install, cp, guard)
        replicas = await asyncio.to_thread(
            _replicas, cp, workdir, api_proxy.url, tls, webhook_ports, plant
        )
    except BaseException:
        op.stop()
        cp.stop()
        raise
    try:
        upgrades = await start_upgrades(cp, NS, NODES, leave=world_runs)
    except BaseException:
        await webhook.close()
        await api_proxy.close()
        op.stop()
        cp.stop()
        raise
    world = World(workdir, cp, op, api_proxy, webhook, replicas, rbac, guard, upgrades)
    for r in replicas:
        r.start()
    return world


def world_runs(obj: dict[str, Any]) -> bool:
    """The DaemonSets and pods :meth:`World.sync` runs (the upgrade side's stand-ins leave
    them): the DCGM stacks' in the operator namespace."""
    labels = obj["metadata"].get("labels") or {}
    return obj["metadata"].get("namespace") == NS and labels.get("app") in APPS


async def stop_world(world: World) -> None:
    for r in world.replicas:
        await asyncio.to_thread(r.stop)
    await stop_upgrades(world.upgrades)
    await world.webhook.close()
    await world.api_proxy.close()
    world.op.stop()
    world.cp.stop()
