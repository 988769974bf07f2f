"""A random life of a cluster: CRs come, change, break and go; DaemonSets roll both ways.

After every step the reconciler plans, the plan is applied to the in-memory API server,
and the invariants are checked: convergence (a second plan writes nothing), ownership,
no wrongful delete, every ready pod covered, every exporter scraped once.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from proptests.strategies import (
    check_endpoints,
    check_no_wrongful_delete,
    check_owners,
    check_scrape_once,
    malformed_spec,
    monitor_block,
    service_block,
)
from shared_svc.reconcile.model import Settings, World
from shared_svc.reconcile.planner import plan
from tests.worlds import (
    APPS,
    apply_plan,
    cluster_policy,
    daemonset,
    gc_spec,
    gpu_cluster,
    gpu_operator_service,
    pod,
    with_objects,
    without,
)

PODS = 2
spec_strategy = st.one_of(
    st.builds(
        gc_spec,
        dcgm=st.one_of(st.none(), st.booleans()),
        exporter=st.one_of(st.none(), st.booleans()),
        service=st.one_of(st.none(), service_block),
        monitor=st.one_of(st.none(), monitor_block),
    ),
    malformed_spec(),
)


class ClusterLife(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.world = World()
        self.settings = Settings()
        self.generation = 0
        self.day = 1

    @initialize(mode=st.sampled_from(["auto", "app"]), adopt=st.booleans())
    def configure(self, mode: Any, adopt: bool) -> None:
        self.settings = Settings(selector_mode=mode, adopt=adopt)

    def _next(self) -> int:
        self.generation += 1
        return self.generation

    # ------------------------------------------------------------ custom resources

    @rule(kind=st.sampled_from(["ClusterPolicy", "GPUCluster"]), spec=spec_strategy)
    def create_or_change_cr(self, kind: str, spec: Any) -> None:
        existing = self._cr(kind)
        if existing is None:
            self.day += 1
            uid = f"uid-{kind}-{self._next()}"
        else:
            uid = existing["metadata"]["uid"]
        day = self.day if existing is None else int(existing["metadata"]["creationTimestamp"][8:10])
        make = cluster_policy if kind == "ClusterPolicy" else gpu_cluster
        self._reconcile(with_objects(self.world, make(spec=spec, uid=uid, day=day)))

    @rule(spec=spec_strategy)
    def add_another_cluster_policy(self, spec: Any) -> None:
        self.day += 1
        cp = cluster_policy(f"cp-{self._next()}", day=self.day, spec=spec)
        self._reconcile(with_objects(self.world, cp))

    @rule(kind=st.sampled_from(["ClusterPolicy", "GPUCluster"]), finalizing=st.booleans())
    def delete_cr(self, kind: str, finalizing: bool) -> None:
        existing = self._cr(kind)
        if existing is None:
            return
        if finalizing:
            dying = {
                **existing,
                "metadata": {**existing["metadata"], "deletionTimestamp": "2024-03-01T00:00:00Z"},
            }
            self._reconcile(with_objects(self.world, dying))
        else:
            self._reconcile(without(self.world, kind, existing["metadata"]["name"]))

    @rule(kind=st.sampled_from(["ClusterPolicy", "GPUCluster"]))
    def recreate_cr_with_new_uid(self, kind: str) -> None:
        existing = self._cr(kind)
        if existing is None:
            return
        self.day += 1
        reborn = {
            **existing,
            "metadata": {**existing["metadata"], "uid": f"uid-reborn-{self._next()}"},
        }
        reborn["metadata"].pop("deletionTimestamp", None)
        self._reconcile(with_objects(self.world, reborn))

    @rule(
        name=st.sampled_from(sorted(APPS.values())),
        kind=st.sampled_from(["ClusterPolicy", "GPUCluster"]),
    )
    def gpu_operator_leaves_a_service(self, name: str, kind: str) -> None:
        cr = self._cr(kind)
        if cr is None or any(s["metadata"]["name"] == name for s in self.world.services):
            return
        self._reconcile(with_objects(self.world, gpu_operator_service(name, cr)))

    # ------------------------------------------------------------ workloads

    @rule(app=st.sampled_from(sorted(APPS.values())), common=st.booleans(), on_delete=st.booleans())
    def change_daemonset_template(self, app: str, common: bool, on_delete: bool) -> None:
        """A new template (label on: upgrade; label off: rollback); pods not replaced yet."""
        generation = self._next()
        pods = [pod(app, f"{app}-{i}", common=self._pod_common(app, i)) for i in range(PODS)]
        ds = daemonset(
            app,
            common=common,
            desired=PODS,
            generation=generation,
            observed=generation,
            on_delete=on_delete,
        )
        self._reconcile(with_objects(self.world, *self._with_status(ds, pods), *pods))

    @rule(app=st.sampled_from(sorted(APPS.values())), index=st.integers(0, PODS - 1))
    def replace_one_pod(self, app: str, index: int) -> None:
        """A pod is re-created from the current template (rolling update or OnDelete)."""
        ds = next((d for d in self.world.daemonsets if d["metadata"]["name"] == app), None)
        if ds is None:
            return
        common = self._template_common(ds)
        pods = [
            pod(app, f"{app}-{i}", common=common if i == index else self._pod_common(app, i))
            for i in range(PODS)
        ]
        self._reconcile(with_objects(self.world, *self._with_status(ds, pods), *pods))

    # ------------------------------------------------------------ helpers

    def _cr(self, kind: str) -> dict[str, Any] | None:
        items = self.world.cluster_policies if kind == "ClusterPolicy" else self.world.gpu_clusters
        named = [c for c in items if c["metadata"]["name"] in ("cluster-policy", "gpu-cluster")]
        return named[0] if named else None

    def _pod_common(self, app: str, i: int) -> bool:
        current = next((p for p in self.world.pods if p["metadata"]["name"] == f"{app}-{i}"), None)
        component = "exporter" if "exporter" in app else "dcgm"
        key = f"nvidia.com/gpu-operator.{'dcgm-exporter' if component == 'exporter' else 'dcgm'}"
        return current is not None and current["metadata"]["labels"].get(key) == "true"

    @staticmethod
    def _template_common(ds: dict[str, Any]) -> bool:
        labels = ds["spec"]["template"]["metadata"]["labels"]
        return any(k.startswith("nvidia.com/gpu-operator.dcgm") for k in labels)

    def _with_status(self, ds: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        common = self._template_common(ds)
        updated = sum(
            1
            for p in pods
            if any(k.startswith("nvidia.com/gpu-operator.dcgm") for k in p["metadata"]["labels"])
            == common
        )
        ds = {**ds, "status": {**ds["status"], "updatedNumberScheduled": updated}}
        return [ds]

    def _reconcile(self, world: World) -> None:
        result = plan(world, self.settings)
        after = apply_plan(world, result)
        check_no_wrongful_delete(world, after, self.settings)
        check_owners(after, result, self.settings)
        self.world = after
        self.last_plan = result

    @invariant()
    def converged_and_safe(self) -> None:
        again = plan(self.world, self.settings)
        assert again.writes == (), [
            (a.action, a.name, a.reason, a.changed_fields) for a in again.writes
        ]
        check_endpoints(self.world, self.settings)
        check_scrape_once(self.world, self.settings)


# The active profile (conftest) applies; a life is up to 25 steps long.
ClusterLife.TestCase.settings = settings(stateful_step_count=25)
TestClusterLife = ClusterLife.TestCase
