"""Properties of plan(): order independence, convergence, ownership, safety, conflicts."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from proptests.strategies import (
    check_endpoints,
    check_no_wrongful_delete,
    check_owners,
    check_scrape_once,
    malformed_spec,
    settings_strategy,
    workloads,
    worlds,
)
from shared_svc.reconcile.model import Settings, World
from shared_svc.reconcile.planner import plan
from shared_svc.reconcile.specs import parse_cr
from tests.worlds import apply_plan, cluster_policy, gpu_cluster, settled, with_objects


@given(worlds(), settings_strategy, st.randoms(use_true_random=False))
def test_result_is_independent_of_input_order(w: World, settings: Settings, rnd: Any) -> None:
    shuffled = {}
    for field in (
        "cluster_policies",
        "gpu_clusters",
        "daemonsets",
        "pods",
        "services",
        "service_monitors",
    ):
        items = list(getattr(w, field))
        rnd.shuffle(items)
        shuffled[field] = tuple(items)
    assert plan(replace(w, **shuffled), settings) == plan(w, settings)


@given(worlds(), settings_strategy)
def test_applying_a_plan_converges_in_one_step_and_keeps_the_invariants(
    w: World, settings: Settings
) -> None:
    result = plan(w, settings)
    after = apply_plan(w, result)
    again = plan(after, settings)
    assert again.writes == (), [(a.action, a.kind, a.name, a.changed_fields) for a in again.writes]
    check_no_wrongful_delete(w, after, settings)
    check_owners(after, result, settings)
    check_endpoints(after, settings)
    check_scrape_once(after, settings)


@given(worlds(), workloads(), settings_strategy)
def test_a_selector_change_never_drops_a_ready_pod(
    w: World, rollout: list[Any], settings: Settings
) -> None:
    # Settle, then the DaemonSets roll (labels on or off, pods half replaced): the next
    # plan may move selectors, and must keep every ready pod of a needing stack covered.
    before = apply_plan(w, plan(w, settings))
    rolled = replace(
        before,
        daemonsets=tuple(o for o in rollout if o["kind"] == "DaemonSet"),
        pods=tuple(o for o in rollout if o["kind"] == "Pod"),
    )
    check_endpoints(apply_plan(rolled, plan(rolled, settings)), settings)


@given(worlds(), settings_strategy)
def test_conflict_winner_is_an_input_and_the_oldest_setter(w: World, settings: Settings) -> None:
    result = plan(w, settings)
    crs = {
        (cr["kind"], cr["metadata"]["name"]): cr for cr in (*w.cluster_policies, *w.gpu_clusters)
    }
    for conflict in result.conflicts:
        parties = [conflict.winner, *conflict.losers]
        assert all((p.kind, p.name) in crs for p in parties)
        assert all(p.value != conflict.winner.value for p in conflict.losers)
        order = sorted(parties, key=lambda p: parse_cr(p.kind, crs[(p.kind, p.name)]).precedence)  # type: ignore[arg-type]
        assert order[0] == conflict.winner


@given(
    st.data(), malformed_spec(), st.sampled_from(["ClusterPolicy", "GPUCluster"]), settings_strategy
)
def test_malformed_specs_never_raise_never_remove_ownership_or_delete(
    data: st.DataObject, bad: Any, kind: str, settings: Settings
) -> None:
    settings = replace(settings, adopt=True)
    good_spec = {
        "dcgm": {"enabled": True},
        "dcgmExporter": {"serviceMonitor": {"enabled": data.draw(st.booleans())}},
    }
    make = cluster_policy if kind == "ClusterPolicy" else gpu_cluster
    other = gpu_cluster() if kind == "ClusterPolicy" else cluster_policy()
    with_other = data.draw(st.booleans())
    base = settled(World(**_crs(make(spec=good_spec), other if with_other else None)), settings)
    broken = with_objects(base, make(spec=bad))
    result = plan(broken, settings)
    assert [e.reason for e in result.errors] == ["InvalidSpec"]
    assert not any(a.action == "delete" for a in result.actions)
    after = apply_plan(broken, result)
    for obj in (*base.services, *base.service_monitors):
        kept = next(
            o
            for o in (*after.services, *after.service_monitors)
            if o["metadata"]["name"] == obj["metadata"]["name"] and o["kind"] == obj["kind"]
        )
        assert kept["metadata"]["ownerReferences"] == obj["metadata"]["ownerReferences"]


def _crs(*objs: Any) -> dict[str, tuple[Any, ...]]:
    return {
        "cluster_policies": tuple(o for o in objs if o and o["kind"] == "ClusterPolicy"),
        "gpu_clusters": tuple(o for o in objs if o and o["kind"] == "GPUCluster"),
    }


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=4),
        lambda c: (
            st.lists(c, max_size=3)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "dcgm",
                        "dcgmExporter",
                        "enabled",
                        "service",
                        "serviceMonitor",
                        "type",
                        "interval",
                        "additionalLabels",
                        "relabelings",
                        "x",
                    ]
                ),
                c,
                max_size=4,
            )
        ),
        max_leaves=12,
    )
)
def test_any_spec_value_is_total(spec: Any) -> None:
    w = World(cluster_policies=(cluster_policy(spec=spec),), gpu_clusters=(gpu_cluster(spec=spec),))
    plan(w, Settings())
