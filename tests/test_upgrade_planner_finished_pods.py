"""The upgrade planner and finished pods of a declared DaemonSet: they hold no GPU, so they do
not keep a node "freeing"; a running one does. Each test names the contract rule it holds."""

from __future__ import annotations

import pytest

from shared_svc.upgrade.planner import plan_node
from shared_svc.upgrade.settings import UpgradeSettings
from testenv import upgrade_examples as ex

S = UpgradeSettings()
T0 = 1_700_000_000.0


# upgrade-release.md section 2: finished pods are "never touched", and section 3: the node is
# freed once the declared DaemonSets have left it. A Succeeded/Failed pod of a declared
# DaemonSet (e.g. one the kubelet evicted under node pressure, not yet removed) holds no
# GPU: it must not keep the node "freeing" and delay GPUConsumersFreed.
@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_finished_declared_daemonset_pod_does_not_hold_the_node(phase: str) -> None:
    ds = ex.daemonset("dcgm-exporter", declared=True)
    node = ex.node(state="drain-required")
    finished = ex.daemonset_pod(ds, phase=phase)
    p = plan_node(node, [finished], [ds], S, T0)
    assert p.status.daemonset_pods == ()
    assert p.status.phase == "freed"
    assert [r.reason for r in p.reports] == ["GPUConsumersFreed"]
    assert p.pod_actions == ()


def test_running_declared_daemonset_pod_still_holds_the_node() -> None:
    ds = ex.daemonset("dcgm-exporter", declared=True)
    p = plan_node(ex.node(state="drain-required"), [ex.daemonset_pod(ds)], [ds], S, T0)
    assert p.status.daemonset_pods == ("monitoring/dcgm-exporter-node-1",)
    assert p.status.phase == "freeing" and p.pod_actions == ()
