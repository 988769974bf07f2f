"""Contract section 4, the hold: a stable name never moves to a selector whose ready pods
cover fewer nodes than the pods it selects now (DCGM is node-local)."""

from __future__ import annotations

from typing import Any

from shared_svc.reconcile.model import Plan, Settings, World
from shared_svc.reconcile.planner import plan
from tests.worlds import (
    apply_plan,
    cluster_policy,
    daemonset,
    find,
    gpu_cluster,
    manifest,
    pod,
    settled,
    with_objects,
    world,
)

DRA = {"app": "nvidia-dcgm-dra"}
LEGACY = {"app": "nvidia-dcgm"}
DCGM_ONLY = {"dcgm": {"enabled": True}}


def dcgm_pods(app: str, nodes: list[str], *, common: bool = False) -> list[dict[str, Any]]:
    return [pod(app, f"{app}-{n}", node=n, common=common) for n in nodes]


def gpu_cluster_running(nodes: list[str]) -> World:
    """A settled DRA-only world: the stable name selects the DRA pods on ``nodes``."""
    w = world(
        gpu_cluster(spec=DCGM_ONLY),
        daemonset("nvidia-dcgm-dra", common=False, desired=len(nodes)),
        dcgm_pods("nvidia-dcgm-dra", nodes),
    )
    settled_world = settled(w)
    svc = find(settled_world, "Service", "nvidia-dcgm")
    assert svc is not None and svc["spec"]["selector"] == DRA
    return settled_world


def add_cluster_policy(w: World, legacy_nodes: list[str]) -> World:
    return with_objects(
        w,
        cluster_policy(spec={"dcgmExporter": {"enabled": False}}),
        daemonset("nvidia-dcgm", common=False, desired=len(legacy_nodes)),
        *dcgm_pods("nvidia-dcgm", legacy_nodes),
    )


def stable_selector(result: Plan) -> dict[str, str]:
    chosen: dict[str, str] = manifest(result, "Service", "nvidia-dcgm")["spec"]["selector"]
    return chosen


def held_messages(result: Plan) -> list[str]:
    return [
        p.message
        for p in result.pending
        if p.object == "Service/nvidia-dcgm" and p.reason == "SelectorMigrationPending"
    ]


def test_a_cluster_policy_before_its_pods_run_does_not_take_the_stable_name() -> None:
    w = add_cluster_policy(gpu_cluster_running(["a", "b"]), [])
    result = plan(w, Settings())
    assert stable_selector(result) == DRA
    (message,) = held_messages(result)
    assert "keeps selector app=nvidia-dcgm-dra" in message
    assert "not yet on 2 node(s): a, b" in message
    # Reported as a Warning Event, like every pending selector migration.
    assert any(r.reason == "SelectorMigrationPending" for r in result.reports)


def test_the_move_waits_until_the_new_pods_cover_every_node() -> None:
    w = add_cluster_policy(gpu_cluster_running(["a", "b"]), ["a"])
    assert stable_selector(plan(w, Settings())) == DRA
    w = with_objects(w, *dcgm_pods("nvidia-dcgm", ["b"]))
    result = plan(w, Settings())
    assert stable_selector(result) == LEGACY
    assert not any("keeps selector app=nvidia-dcgm-dra until" in m for m in held_messages(result))


def test_pods_that_are_not_ready_or_terminating_cover_nothing() -> None:
    w = add_cluster_policy(gpu_cluster_running(["a"]), [])
    w = with_objects(
        w,
        pod("nvidia-dcgm", "not-ready", node="a", ready=False),
        pod("nvidia-dcgm", "unbound"),
    )
    assert stable_selector(plan(w, Settings())) == DRA
    # The DRA pod going away (terminating) uncovers node a: nothing left to hold on to.
    w = with_objects(w, pod("nvidia-dcgm-dra", "nvidia-dcgm-dra-a", node="a", deleting=True))
    assert stable_selector(plan(w, Settings())) == LEGACY


def test_when_the_old_pods_go_the_name_moves() -> None:
    w = add_cluster_policy(gpu_cluster_running(["a", "b"]), [])
    gone = World(**{**w.__dict__, "pods": ()})
    assert stable_selector(plan(gone, Settings())) == LEGACY


def test_no_hold_on_a_selector_the_rules_never_give() -> None:
    # A live Service with a hand-written selector that covers node a: not ours to keep.
    w = gpu_cluster_running(["a"])
    svc = find(w, "Service", "nvidia-dcgm")
    assert svc is not None
    odd = {**svc, "spec": {**svc["spec"], "selector": {"team": "x"}}}
    team_pod = pod("x", "x-a", node="a")
    team_pod["metadata"]["labels"]["team"] = "x"
    result = plan(add_cluster_policy(with_objects(w, odd, team_pod), []), Settings())
    assert stable_selector(result) == LEGACY


def test_a_rollout_to_the_common_label_is_not_held() -> None:
    # Both stacks rolled out with the common label on every pod: the common label covers
    # the nodes of both, so the move from the legacy label goes ahead.
    w = settled(
        world(
            cluster_policy(spec={"dcgmExporter": {"enabled": False}}),
            daemonset("nvidia-dcgm", common=False, desired=1),
            dcgm_pods("nvidia-dcgm", ["a"]),
        )
    )
    assert stable_selector(plan(w, Settings())) == LEGACY
    rolled = World(
        **{
            **w.__dict__,
            "daemonsets": (daemonset("nvidia-dcgm", common=True, desired=1),),
            "pods": tuple(dcgm_pods("nvidia-dcgm", ["a"], common=True)),
        }
    )
    result = plan(rolled, Settings())
    assert stable_selector(result) == {"nvidia.com/gpu-operator.dcgm": "true"}
    assert held_messages(result) == []
    assert find(apply_plan(rolled, result), "Service", "nvidia-dcgm") is not None


def test_the_exporter_name_does_not_hold_and_the_dra_alias_is_scraped_before_it_moves() -> None:
    # GPUCluster -> ClusterPolicy with unlabelled ClusterPolicy exporter pods: the canonical
    # Service moves to them at once (a hold would leave them on no scrape-"true" Service),
    # and nvidia-dcgm-exporter-dra turns "true" in an earlier write than that move.
    w = settled(
        world(
            gpu_cluster(),
            daemonset("nvidia-dcgm-exporter-dra", common=True, desired=2),
            [pod("nvidia-dcgm-exporter-dra", f"dra-{n}", node=n) for n in ("a", "b")],
        )
    )
    w = with_objects(
        w,
        cluster_policy(day=3),
        daemonset("nvidia-dcgm-exporter", common=False, desired=1),
        pod("nvidia-dcgm-exporter", "cp-a", node="a", common=False),
    )
    result = plan(w, Settings())
    canonical = manifest(result, "Service", "nvidia-dcgm-exporter")
    alias = manifest(result, "Service", "nvidia-dcgm-exporter-dra")
    assert canonical["spec"]["selector"] == {"app": "nvidia-dcgm-exporter"}
    assert alias["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    status = next(s for s in result.status if s.name == "nvidia-dcgm-exporter")
    assert status.held_back is None
    names = [a.name for a in result.writes if a.kind == "Service"]
    assert names.index("nvidia-dcgm-exporter-dra") < names.index("nvidia-dcgm-exporter")
