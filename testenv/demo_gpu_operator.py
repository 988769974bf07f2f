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
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from shared_svc.errors import UsageError
from testenv.demo_parts import (
    NS,
    connect,
    demo_config,
    events_table,
    say,
    settle,
    show,
    step,
    table,
)

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
    binary = testenv.build_helmrender()
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
    from kubernetes_asyncio import client

    from testenv import gpu_operator as gpu_env
    from testenv.service import running

    api = await connect(cp, log_file)
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
    await show(core, NAMES)

    step(
        2,
        "The chart's admission guard is installed",
        """Kubernetes 1.36 serves MutatingAdmissionPolicy (admissionregistration.k8s.io/v1): for an
         update by gpu-operator of a Service shared-svc manages, it puts back from the old object
         what shared-svc owns, managedFields included, so the update changes nothing.""",
    )
    await blocking(cp.apply_manifests, docs, field_manager="helm")
    table(("KIND", "NAME"), [(d["kind"], d["metadata"]["name"]) for d in docs])

    step(
        3,
        "shared-svc starts and adopts the Services",
        """Same objects, same clusterIPs; the controller reference becomes a non-controller one and
         the managed-by label is added. Without the guard, gpu-operator's next PUT would undo this
         and shared-svc would report a ConflictingWriter.""",
    )
    cfg = demo_config(cp, leader_election=False, discovery_seconds=1.0)
    try:
        async with running(cfg) as service:
            await settle(service)
            await show(core, NAMES)

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
                say(
                    f"    {name}: resourceVersion {rv_before[name]} -> {rv_after[name]} ({verdict})"
                )
            say(f"    shared-svc: {writes_after - writes_before} writes")
            await show(core, NAMES)

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
            await events_table(api, (NS,))
            guard = service.status()["admissionGuard"]
            say(f"    admissionGuard: mode={guard['mode']} objects={guard['objects']}")
            say(f"\nThe service's JSON logs: {log_file}")
    finally:
        await api.close()
    say("\nDone: shared-svc stopped; gpu-operator and its control plane stop next.")
