"""Liveness means "the loop is not wedged", not "reconciles succeed" (issue 10, item 2).

A persistent write error (here an admission policy refusing every Service write) keeps
reconciles failing and backing off; /livez must stay 200 all along, with a stall
threshold far below the backoff. /livez still fails when the loop really stops beating.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from shared_svc.controllers.services import reconciler as controller_module
from shared_svc.controllers.services.reconciler import KEY
from shared_svc.runtime import controller as runtime_controller
from testenv import ControlPlane
from tests.kube import eventually
from tests.refusals import ServiceWritesRefused
from tests.svc import Kube, cp_body, http_get, running, service_config, services_runtime

pytestmark = pytest.mark.apiserver

STALL = 3.0


async def test_livez_stays_ok_while_writes_keep_failing(
    control_plane: ControlPlane, kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime_controller, "STALL_SECONDS", STALL)
    monkeypatch.setattr(controller_module, "HEARTBEAT_SECONDS", 0.25)
    await kube.create_cr(cp_body())
    # Every retry waits 4-8 s, then 8-16 s, ...: each backoff is longer than the stall.
    config = service_config(
        control_plane, kube.ns, backoff_base_seconds=4.0, backoff_max_seconds=300.0
    )
    async with ServiceWritesRefused(kube.api, kube.ns), running(config) as svc:
        runtime = services_runtime(svc)

        async def failing() -> bool:
            return runtime.failures(KEY) >= 1

        await eventually(failing, timeout=30)
        assert "refused by a test policy" in (svc.status()["lastReconcile"]["error"] or "")
        answers = []
        deadline = time.monotonic() + 3 * STALL
        while time.monotonic() < deadline:
            answers.append((await http_get(svc.port or 0, "/livez"))[0])
            await asyncio.sleep(0.1)
        assert set(answers) == {200}, answers
        assert runtime.failures(KEY) >= 1 and svc.status()["lastReconcile"]["result"] == "error"
        # A loop that really stops beating is reported: its next beat is an hour away.
        monkeypatch.setattr(controller_module, "HEARTBEAT_SECONDS", 3600.0)

        async def stalled() -> bool:
            return not svc.alive()

        await eventually(stalled, timeout=3 * STALL)
        assert (await http_get(svc.port or 0, "/livez"))[0] == 500
