"""Benchmark (not a test): CR change -> converged Services, beside the bare API write.

On the embedded control plane, flips ``spec.dcgmExporter.service.internalTrafficPolicy``
of a ClusterPolicy N times and measures, per change, the time from the CR patch's
response until a watch on the Services sees the new value. Beside it, the same Service
change done as a bare server-side apply, measured the same way. Prints median and p99
of both, their ratio, and the number of writes shared-svc sent per change.

    .venv/bin/python benchmarks/bench_controller.py [--changes 60]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kubernetes_asyncio import client

from shared_svc import testenv
from tests.kube import api_client, make_namespace
from tests.svc import Kube, cp_body, running, service_config, settle

NAME = "nvidia-dcgm-exporter"


class ServiceWatch:
    """Records when each resourceVersion of the exporter Service showed which policy."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.seen: asyncio.Queue[tuple[float, str]] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        from kubernetes_asyncio import watch

        while True:
            w = watch.Watch()
            async for ev in w.stream(
                self.kube.core.list_namespaced_service, self.kube.ns, timeout_seconds=300
            ):
                obj = ev["object"]
                if obj.metadata.name == NAME:
                    self.seen.put_nowait((time.perf_counter(), obj.spec.internal_traffic_policy))

    async def wait_for(self, value: str) -> float:
        while True:
            at, got = await self.seen.get()
            if got == value:
                return at


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def main(changes: int) -> None:
    cp = await asyncio.get_running_loop().run_in_executor(None, testenv.start)
    try:
        api = await api_client(cp)
        kube = Kube(api, await make_namespace(api, "bench"))
        await kube.create_cr(
            cp_body(dcgmExporter={"service": {"internalTrafficPolicy": "Cluster"}})
        )
        watcher = ServiceWatch(kube)
        watch_task = asyncio.ensure_future(watcher.run())
        controller_ms: list[float] = []
        bare_ms: list[float] = []
        async with running(service_config(cp, kube.ns, coalesce_seconds=0.0)) as svc:
            await settle(svc)
            assert svc.writer is not None
            writes_before = sum(svc.writer.writes.values())
            policy = "Cluster"
            for _ in range(changes):
                policy = "Local" if policy == "Cluster" else "Cluster"
                await kube.patch_cr(
                    "ClusterPolicy",
                    "cluster-policy",
                    {"spec": {"dcgmExporter": {"service": {"internalTrafficPolicy": policy}}}},
                )
                start = time.perf_counter()
                seen = await asyncio.wait_for(watcher.wait_for(policy), 30)
                controller_ms.append((seen - start) * 1000)
            await settle(svc)
            writes = sum(svc.writer.writes.values()) - writes_before

        # The bare write: what the change costs without a controller (same watch, same server).
        svc_obj: dict[str, Any] = await kube.service(NAME) or {}
        body = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": NAME, "namespace": kube.ns},
            "spec": {"internalTrafficPolicy": policy},
        }
        for _ in range(changes):
            policy = "Local" if policy == "Cluster" else "Cluster"
            body["spec"]["internalTrafficPolicy"] = policy
            start = time.perf_counter()
            await client.CoreV1Api(api).patch_namespaced_service(
                NAME,
                kube.ns,
                body,
                field_manager="bench",
                force=True,
                _content_type="application/apply-patch+yaml",
            )
            seen = await asyncio.wait_for(watcher.wait_for(policy), 30)
            bare_ms.append((seen - start) * 1000)
        watch_task.cancel()
        await asyncio.gather(watch_task, return_exceptions=True)
        await api.close()
        assert svc_obj
    finally:
        cp.stop()

    med_c, p99_c = statistics.median(controller_ms), pct(controller_ms, 0.99)
    med_b, p99_b = statistics.median(bare_ms), pct(bare_ms, 0.99)
    print(f"changes: {changes}")
    print(f"{'':28}{'median ms':>12}{'p99 ms':>12}")
    print(f"{'CR change -> converged':28}{med_c:12.1f}{p99_c:12.1f}")
    print(f"{'bare Service apply':28}{med_b:12.1f}{p99_b:12.1f}")
    print(f"{'ratio (controller / bare)':28}{med_c / med_b:12.1f}{p99_c / p99_b:12.1f}")
    print(f"writes per change: {writes / changes:.2f} (the bare change needs 1)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--changes", type=int, default=60)
    asyncio.run(main(parser.parse_args().changes))
