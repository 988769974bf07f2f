"""The review of the upgrade flow's gate, a Runnable of the Manager: which upgrade policy
gpu-operator reads now (``upgrade.policy.policy_sources``: the ClusterPolicy, or each
NVIDIADriver for the nodes it owns), and does each hold the flow for our consumers
(``upgrade.gate.review_gate``)? Reviewed once the ClusterPolicy, NVIDIADriver and CRD caches
are synced, again on each of their changes, when this replica becomes leader, and at the
latest every ``upgrade_resync_seconds`` (the nodes each verdict names are those cached
then); a Warning on each object whose gate does not hold, logged once and sent once per
finding (by the leader, or dry-run: the ``Announcer``), as one Event series across restarts.

The sources also decide, per node, whether a flow moves it at all (:meth:`flow`): the
controller plans every node with it, and looks at every node again when the sources change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from shared_svc.controllers.upgrade.announce import Announcer
from shared_svc.k8s.objects import K8sObject, label
from shared_svc.k8s.selectors import Selector
from shared_svc.kube.registry import AnyCache
from shared_svc.runtime.manager import Periodic
from shared_svc.runtime.source import all_synced
from shared_svc.upgrade.gate import GateVerdicts, review_gate
from shared_svc.upgrade.policy import (
    OWNER_LABEL,
    NodeFlow,
    PolicySources,
    policy_sources,
    reads_driver_policy,
)


class GateReview(Periodic):
    def __init__(
        self,
        policy_caches: tuple[AnyCache, AnyCache, AnyCache],
        nodes: Callable[[], Iterable[K8sObject]],
        consumer_selector: Selector,
        announcer: Announcer,
        *,
        seconds: Callable[[], float],
        on_sources: Callable[[], None] = lambda: None,
    ) -> None:
        """``policy_caches``: the ClusterPolicies, the NVIDIADrivers and the NVIDIADriver CRD;
        ``nodes``: the nodes in the upgrade flow (named in the verdicts); ``on_sources``:
        called when the sources changed (the controller plans every node again)."""
        super().__init__("upgrade-gate", self.review, seconds)
        self._caches = policy_caches
        self._cluster_policies, self._nvidia_drivers, self._crd = policy_caches
        self._blind = False  # a node was planned while the sources were not known
        self._nodes = nodes
        self._selector = consumer_selector
        self._announcer = announcer
        self.on_sources = on_sources
        self.sources: PolicySources | None = None  # once the caches synced
        self.gate: GateVerdicts | None = None  # the last verdicts, once the caches synced
        for cache in policy_caches:
            self.watch(cache)

    def _synced(self) -> bool:
        return all_synced(self._caches)

    def _sources_now(self) -> PolicySources:
        return policy_sources(
            self._cluster_policies.items(),
            self._nvidia_drivers.items(),
            driver_policy=any(reads_driver_policy(crd) for crd in self._crd.items()),
        )

    async def review(self) -> None:
        """Which policies gpu-operator reads, their gates, and what to say of them."""
        sources = self._sources_now()
        before, self.sources = self.sources, sources
        # Every node is planned again when some node's flow may differ from the one it was
        # planned with: the sources changed, or a node was planned before they were known.
        changed = self._blind or (before is not None and before.flows() != sources.flows())
        self._blind = False
        self.gate = review_gate(sources, self._selector, self._nodes())
        await self._announcer.gate(self.gate.reports)
        if changed:
            self.on_sources()

    def flow(self, node: K8sObject) -> NodeFlow | None:
        """What moves the node's upgrade (None: no gpu-operator CR says, or their caches
        have not synced yet: the node's state label decides, and every node is planned
        again once they have)."""
        if self.sources is None:
            if not self._synced():
                self._blind = True
                return None
            self.sources = self._sources_now()  # the review to come reports on them
        owner = label(node, OWNER_LABEL)  # all a flow reads of the node, without a copy
        return self.sources.flow({} if owner is None else {OWNER_LABEL: owner})

    def leadership_changed(self, leader: bool) -> None:
        if leader:
            self.wake.set()  # the Warning a standby only logged is the leader's to send
