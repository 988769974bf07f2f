"""The real gpu-operator (v25.3.4's ClusterPolicy controller) next to shared-svc and the guard
``helm install`` renders on this version's API server (issue 31): part of the compatibility
suite (tests/compat.py), so it runs on 1.33, 1.34 and 1.35 (the guard is the webhook there),
1.36 and 1.37 (the policy).
tests/test_coexistence.py is the long form on the default version; this reuses its helpers.

Its DaemonSets not ready, gpu-operator reconciles every ~5 s: it PUTs both Services whole
(each a no-op under the guard) and, with ``dcgm.enabled: false``, deletes ``nvidia-dcgm`` by
name (answered 404 while a GPUCluster needs it); it stays healthy and reaches ``ready``.
"""

from __future__ import annotations

import asyncio

import pytest

from testenv import gpu_operator as gpu_env
from tests.admission import Tls, guard_docs, make_tls, webhook_sets
from tests.kube import eventually
from tests.svc import gc_body, running, settle
from tests.test_coexistence import (
    NAMES,
    NS,
    OPERANDS,
    TIMEOUT,
    _ours,
    assert_ours,
    cluster_of,
    conflicting_writers,
    free_port,
    guard,
    guard_holds,
    now,
    operands,
    policy_state,
    policy_status,
    reconcile_failed,
    requests,
    shapes,
    since,
    updated,
    webhook_config,
    writes,
)
from tests.test_compat import GUARD_KINDS, kinds, readme_guard_mode

pytestmark = [pytest.mark.apiserver, pytest.mark.gpu_operator]

PUTS = 3  # gpu-operator's PUTs of each Service (and its deletes) to see answered


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    return make_tls(tmp_path_factory.mktemp("webhook-tls"))


async def test_gpu_operator_next_to_the_guard_helm_install_renders_on_this_version(
    gpu_operator: gpu_env.GpuOperator, tls: Tls
) -> None:
    async with cluster_of(gpu_operator) as c:
        mode = readme_guard_mode(c.cp.server_version())
        port = free_port()
        docs = guard_docs(NS, *webhook_sets(tls, port, mutation="auto"), cluster=c.cp)
        assert kinds(docs) == GUARD_KINDS[mode]
        with guard(c.cp, docs):
            await asyncio.to_thread(gpu_env.apply_cluster_policy, c.cp)
            await operands(c, OPERANDS, ready=False)
            await policy_state(c, "notReady")
            async with running(webhook_config(c.cp, tls, port)) as svc:
                await settle(svc, timeout=TIMEOUT)
                await guard_holds(c)
                await settle(svc, timeout=TIMEOUT)
                kept = await shapes(c)
                assert_ours(svc, kept)
                written, start = writes(svc), now()
                # Its whole-object PUTs: accepted, and nothing changes (resourceVersion too).
                await eventually(lambda: updated(c, start, PUTS), timeout=TIMEOUT, interval=1)
                assert await shapes(c) == kept
                assert writes(svc) == written
                assert await conflicting_writers(c) == []
                assert svc.status()["admissionGuard"]["mode"] == mode

                # dcgm off while a GPUCluster needs nvidia-dcgm: its deletes by name are 404.
                await c.kube.create_cr(gc_body())
                await asyncio.to_thread(
                    gpu_env.apply_cluster_policy, c.cp, {"dcgm": {"enabled": False}}
                )
                await settle(svc, timeout=TIMEOUT)
                before = await c.kube.service("nvidia-dcgm")
                assert before is not None and await _ours(c, "nvidia-dcgm")
                counted = requests(c.cp)

                async def refused() -> bool:
                    return since(counted, requests(c.cp))["DELETE 404"] >= PUTS

                await eventually(refused, timeout=TIMEOUT, interval=1)
                assert since(counted, requests(c.cp))["DELETE 200"] == 0
                after = await c.kube.service("nvidia-dcgm")
                assert after is not None
                assert after["metadata"]["uid"] == before["metadata"]["uid"]
                assert after["spec"]["clusterIP"] == before["spec"]["clusterIP"]
                assert reconcile_failed(await policy_status(c)) == []
                # ... and it goes on to its later states: ready once its DaemonSets are.
                await operands(c, ("nvidia-operator-validator", "nvidia-dcgm-exporter"), ready=True)
                await policy_state(c, "ready")
                assert reconcile_failed(await policy_status(c)) == []
                last = await shapes(c)
                assert [last[n]["uid"] for n in NAMES] == [kept[n]["uid"] for n in NAMES]
