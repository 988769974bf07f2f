"""The review of the upgrade flow's gate, a Runnable of the Manager: is the active
ClusterPolicy's ``waitForCompletion.podSelector`` holding the flow for our consumers
(``upgrade.gate.check_gate``)? Reviewed once the ClusterPolicy cache is synced, again on
each of its changes, when this replica becomes leader, and at the latest every
``upgrade_resync_seconds``; a Warning on the ClusterPolicy when freeing races the driver
restart, logged once and sent once per finding (by the leader, or dry-run: the
``Announcer``), as one Event series across restarts."""

from __future__ import annotations

from collections.abc import Callable

from shared_svc.controllers.upgrade.announce import Announcer
from shared_svc.k8s.selectors import Selector
from shared_svc.kube.registry import AnyCache
from shared_svc.runtime.manager import Periodic
from shared_svc.upgrade.gate import GateCheck, check_gate


class GateReview(Periodic):
    def __init__(
        self,
        cluster_policies: AnyCache,
        consumer_selector: Selector,
        announcer: Announcer,
        *,
        seconds: Callable[[], float],
    ) -> None:
        super().__init__("upgrade-gate", self.review, seconds)
        self._cluster_policies = cluster_policies
        self._selector = consumer_selector
        self._announcer = announcer
        self.gate: GateCheck | None = None  # the last verdict, once the cache synced
        self.watch(cluster_policies)

    async def review(self) -> None:
        """Checks the active ClusterPolicy's gate and says what it finds."""
        self.gate, report = check_gate(self._cluster_policies.items(), self._selector)
        await self._announcer.gate(report)

    def leadership_changed(self, leader: bool) -> None:
        if leader:
            self.wake.set()  # the Warning a standby only logged is the leader's to send
