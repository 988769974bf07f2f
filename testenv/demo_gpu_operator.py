"""``python -m testenv demo --with-gpu-operator`` (``make demo GPU_OPERATOR=1``): shared-svc
next to the real gpu-operator.

gpu-operator's ClusterPolicy controller, built from its Go module (testenv/gpu_operator.py,
cached; the first build takes minutes), runs on a control plane of its own with one GPU node.
Its DaemonSets are kept not ready (there is no kubelet), so it reconciles every ~5 s and PUTs
each DCGM Service whole, as it does in a cluster until its operands are up. The chart's
admission guard (the MutatingAdmissionPolicy, rendered by Helm's engine) turns those PUTs into
no-ops, so shared-svc's shape stays and neither side writes again. Needs a source checkout
(the chart and the build scripts).
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from shared_svc.errors import UsageError
from testenv.demo import NS, _settle, _show, _table, say, step

NAMES = ("nvidia-dcgm", "nvidia-dcgm-exporter")
OPERANDS = ("nvidia-operator-validator", "nvidia-dcgm", "nvidia-dcgm-exporter")
WATCH_SECONDS = 30
ADMISSION_KINDS = ("MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")


def run(log_file: Path, *, keep: bool) -> int:
    import testenv
    from testenv import gpu_operator as gpu_env

    say(
        "shared-svc demo with the real gpu-operator: its ClusterPolicy controller, built from\n"
        "its Go module (cached; the first build takes minutes), on a control plane of its own\n"
        "(real kube-apiserver + etcd on 127.0.0.1) with one GPU node and no kubelet."
    )
    docs = guard_manifests()  # first: the build notes print before the walk
    try:
        cp = gpu_env.start_control_plane()
    except testenv.ControlPlaneError as exc:
        raise UsageError(f"gpu-operator's control plane did not start: {exc}") from exc
    try:
        gpu_env.add_gpu_node(cp, "gpu-node-0")
        with gpu_env.running(cp) as op:
            say(f"gpu-operator is running (its log: {op.log}).")
            asyncio.run(_walk(cp, op, docs, log_file))
    except testenv.ControlPlaneError as exc:
        raise UsageError(str(exc)) from exc
    finally:
        if keep:
            say(f"\nControl plane left running; kubeconfig: {cp.kubeconfig}.")
        else:
            cp.stop()
    return 0


def guard_manifests() -> list[dict[str, Any]]:
    """The chart's admission guard for namespace ``gpu-operator`` as Helm renders it with
    ``admission.mutation=policy`` (the delete webhook needs a serving certificate: off here)."""
    import testenv

    chart = testenv.REPO_ROOT / "deploy" / "chart" / "shared-svc"
    binary = testenv.build_binaries() / "helmrender"
    if not chart.is_dir() or not binary.exists():
        raise UsageError(f"the chart ({chart}) and helmrender ({binary}) need a source checkout")
    args = [str(binary), "--name", "shared-svc", "--namespace", NS]
    for value in ("admission.mutation=policy", "admission.webhook.enabled=false"):
        args += ["--set", value]
    proc = subprocess.run(
        [*args, str(chart)], capture_output=True, text=True, check=False, timeout=60
    )
    if proc.returncode != 0:
        raise UsageError(f"rendering the chart failed: {proc.stderr.strip()}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d and d.get("kind") in ADMISSION_KINDS]


async def _walk(cp: Any, op: Any, docs: list[dict[str, Any]], log_file: Path) -> None:
    from kubernetes_asyncio import client, config

    from shared_svc import logs
    from shared_svc.config import Config
    from shared_svc.service import Service
    from testenv import gpu_operator as gpu_env

    logs.configure("INFO")
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logs.JsonFormatter())
    logging.getLogger().handlers[:] = [handler]
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(cp.kubeconfig), client_configuration=configuration
    )
    api = client.ApiClient(configuration=configuration)
    core: Any = client.CoreV1Api(api)

    async def blocking(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def until(check: Any, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not await check():
            if not op.alive():
                raise UsageError(f"gpu-operator exited; its log: {op.log}")
            if time.monotonic() > deadline:
                raise UsageError(f"{what} did not happen within {timeout:.0f}s; see {op.log}")
            await asyncio.sleep(0.5)

    async def operands(ready: bool) -> None:
        async def present() -> bool:
            found = {d["metadata"]["name"] for d in await blocking(gpu_env.daemonsets, cp)}
            return set(OPERANDS) <= found

        await until(present, f"gpu-operator's DaemonSets {', '.join(OPERANDS)}")
        await blocking(gpu_env.mark_daemonsets, cp, ready=ready)

    async def state(wanted: str) -> None:
        async def reached() -> bool:
            return bool((await blocking(gpu_env.cluster_policy_status, cp)).get("state") == wanted)

        await until(reached, f"ClusterPolicy state {wanted}")

    async def versions() -> dict[str, str]:
        out = {}
        for name in NAMES:
            svc = await core.read_namespaced_service(name, NS)
            out[name] = svc.metadata.resource_version
        return out

    step(
        1,
        "gpu-operator reconciles a ClusterPolicy",
        """It deploys its DCGM DaemonSets and creates the two Services with a controller owner
         reference. The DaemonSets stay not ready (no kubelet here), so it reconciles again every
         ~5 s and PUTs each Service whole, as in a cluster until its operands are up.""",
    )
    await blocking(gpu_env.apply_cluster_policy, cp)
    await operands(ready=False)
    await state("notReady")
    await _show(core, NAMES)

    step(
        2,
        "The chart's admission guard is installed",
        """Kubernetes 1.36 serves MutatingAdmissionPolicy (admissionregistration.k8s.io/v1): for an
         update by gpu-operator of a Service shared-svc manages, it puts back from the old object
         what shared-svc owns, managedFields included, so the update changes nothing.""",
    )
    await blocking(cp.apply_manifests, docs, field_manager="helm")
    _table(("KIND", "NAME"), [(d["kind"], d["metadata"]["name"]) for d in docs])

    step(
        3,
        "shared-svc starts and adopts the Services",
        """Same objects, same clusterIPs; the controller reference becomes a non-controller one and
         the managed-by label is added. Without the guard, gpu-operator's next PUT would undo this
         and shared-svc would report a ConflictingWriter.""",
    )
    cfg = Config(
        namespace=NS,
        kubeconfig=str(cp.kubeconfig),
        bind_address="127.0.0.1",
        port=0,
        pod_name="shared-svc-demo",
        leader_election=False,
        coalesce_seconds=0.1,
        discovery_seconds=1.0,
    )
    service = Service(cfg)
    stop = asyncio.Event()
    task = asyncio.ensure_future(service.run(stop))
    try:
        await asyncio.wait_for(service.started.wait(), 30)
        await _settle(service)
        await _show(core, NAMES)

        step(
            4,
            f"gpu-operator keeps reconciling for {WATCH_SECONDS} s",
            """Its PUTs are accepted and change nothing: the resourceVersions stay, and shared-svc
             has nothing to repair.""",
        )
        assert service.writer is not None
        rv_before, writes_before = await versions(), sum(service.writer.writes.values())
        counts_before, start = await blocking(gpu_env.request_counts, cp), gpu_env.now()
        await asyncio.sleep(WATCH_SECONDS)
        rv_after, writes_after = await versions(), sum(service.writer.writes.values())
        counts_after = await blocking(gpu_env.request_counts, cp)
        updates = op.updates(start)
        refused = sum(
            n - counts_before[key]
            for key, n in counts_after.items()
            if key[0] == "PUT" and key[1] != "200"
        )
        say(
            f"    gpu-operator: {op.reconciles(start)} reconciles, PUTting "
            f"{' and '.join(f'{n} {updates[n]} times' for n in NAMES)}; "
            + ("every PUT accepted (200)" if not refused else f"{refused} PUTs refused")
        )
        for name in NAMES:
            verdict = "unchanged" if rv_before[name] == rv_after[name] else "CHANGED"
            say(f"    {name}: resourceVersion {rv_before[name]} -> {rv_after[name]} ({verdict})")
        say(f"    shared-svc: {writes_after - writes_before} writes")
        await _show(core, NAMES)

        step(
            5,
            "gpu-operator's DaemonSets become ready",
            "The ClusterPolicy reaches ready; gpu-operator stops requeueing.",
        )
        await operands(ready=True)
        await state("ready")
        status = await blocking(gpu_env.cluster_policy_status, cp)
        say(f"    ClusterPolicy cluster-policy: {status.get('state')}")

        step(6, "What shared-svc reported", "Its Events and the guard in /status.")
        events: Any = client.EventsV1Api(api)
        rows = [
            (e.type, e.reason, f"{e.regarding.kind}/{e.regarding.name}", e.note[:70])
            for e in (await events.list_namespaced_event(NS)).items
            if e.reporting_controller == "nvidia.com/shared-svc"
        ]
        if rows:
            _table(("TYPE", "REASON", "REGARDING", "NOTE"), sorted(rows, key=lambda r: r[1]))
        else:
            say("    no Events: nothing contested, nothing to warn about")
        guard = service.status()["admissionGuard"]
        say(f"    admissionGuard: mode={guard['mode']} objects={guard['objects']}")
        say(f"\nThe service's JSON logs: {log_file}")
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await api.close()
    say("\nDone: shared-svc stopped; gpu-operator and its control plane stop next.")
