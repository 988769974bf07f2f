"""Property of sections 3 and 4 for the scraper: every ready exporter pod of a stack that needs
the exporter name is on a scrape-"true" Service after every plan, and no write of a plan, applied
one at a time in the plan's order, takes that away from a pod that had it before the plan.

The exporter name does not hold (section 4): a hold on the DRA pods would leave the returning
ClusterPolicy exporter pods on no scrape-"true" Service for the whole ClusterPolicy rollout.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from proptests.strategies import crs, settings_strategy, workloads, worlds
from shared_svc.k8s.objects import K8sObject, annotations_of, in_namespace, labels_of, name_of
from shared_svc.k8s.selectors import selector_from_set
from shared_svc.reconcile.model import Settings, World
from shared_svc.reconcile.names import (
    APP_LABEL,
    EXPORTER,
    EXPORTER_DRA,
    LEGACY_APP,
    MANAGED_BY_LABEL,
    MANAGED_BY_VALUE,
    SCRAPE_ANNOTATION,
)
from shared_svc.reconcile.needs import compute_needs, counting_crs
from shared_svc.reconcile.planner import live_objects, plan
from shared_svc.reconcile.selection import serving_node
from shared_svc.reconcile.specs import CLUSTER_POLICY
from tests.worlds import apply_plan, cluster_policy, daemonset, find, gpu_cluster, pod, world

Steps = list[tuple[list[K8sObject], list[K8sObject]]]


def scraped_pods(w: World, namespace: str) -> frozenset[str]:
    """Ready exporter pods selected by a Service annotated prometheus.io/scrape "true" (what
    the chart's kubernetes-service-endpoints job keeps)."""
    matchers = [
        selector_from_set(svc["spec"]["selector"])
        for svc in w.services
        if in_namespace(svc, namespace)
        and annotations_of(svc).get(SCRAPE_ANNOTATION) == "true"
        and isinstance(svc.get("spec", {}).get("selector"), dict)
        and svc["spec"]["selector"]
    ]
    return frozenset(
        name_of(p)
        for p in w.pods
        if in_namespace(p, namespace)
        and serving_node(p) is not None
        and any(m.matches(labels_of(p)) for m in matchers)
    )


def _ours(obj: K8sObject | None) -> bool:
    return obj is not None and labels_of(obj).get(MANAGED_BY_LABEL) == MANAGED_BY_VALUE


def must_be_scraped(w: World, settings: Settings) -> frozenset[str]:
    """Ready exporter pods of the stacks that need the exporter name, where the Services that
    scrape them are ours (a foreign or unadopted Service is reported, not written)."""
    needs = compute_needs(counting_crs(w), live_objects(w, settings))
    canonical, alias = find(w, "Service", EXPORTER), find(w, "Service", EXPORTER_DRA)
    apps = set()
    for stack in needs.stacks_needing(EXPORTER):
        if stack == CLUSTER_POLICY:
            if _ours(canonical):
                apps.add(LEGACY_APP["exporter"])
        elif _ours(canonical) and _ours(alias):
            apps.add(EXPORTER_DRA)
    return frozenset(
        name_of(p)
        for p in w.pods
        if in_namespace(p, settings.namespace)
        and serving_node(p) is not None
        and labels_of(p).get(APP_LABEL) in apps
    )


def check_plan_keeps_every_exporter_scraped(w: World, settings: Settings) -> World:
    """Applies the plan of ``w`` write by write; returns the world after the last write."""
    p = plan(w, settings)
    assert all(s.held_back is None for s in p.status if s.name == EXPORTER), p.status
    writes = p.writes
    before = scraped_pods(w, settings.namespace)
    after = apply_plan(w, p)
    required = must_be_scraped(after, settings)
    for k in range(1, len(writes)):
        step = apply_plan(w, replace(p, actions=writes[:k]))
        lost = (before & required) - scraped_pods(step, settings.namespace)
        assert not lost, (k, [(a.action, a.name) for a in writes], sorted(lost))
    missing = required - scraped_pods(after, settings.namespace)
    assert not missing, ([(a.action, a.name) for a in writes], sorted(missing))
    return after


@given(
    worlds(),
    st.lists(st.tuples(crs(), workloads()), min_size=1, max_size=3),
    settings_strategy,
)
def test_every_ready_exporter_pod_stays_on_a_scrape_true_service_through_every_write(
    w: World, steps: Steps, settings: Settings
) -> None:
    current = check_plan_keeps_every_exporter_scraped(w, settings)
    for cr_objs, rollout in steps:
        # CRs, DaemonSets and pods change (a migration, a rollout, a rollback); our Services
        # are what the last plan left.
        nxt = replace(
            current,
            cluster_policies=tuple(o for o in cr_objs if o["kind"] == "ClusterPolicy"),
            gpu_clusters=tuple(o for o in cr_objs if o["kind"] == "GPUCluster"),
            daemonsets=tuple(o for o in rollout if o["kind"] == "DaemonSet"),
            pods=tuple(o for o in rollout if o["kind"] == "Pod"),
        )
        current = check_plan_keeps_every_exporter_scraped(nxt, settings)


NODE_NAMES = ("a", "b", "c")


@st.composite
def exporter_pods(draw: st.DrawFn, app: str) -> list[K8sObject]:
    nodes = draw(st.lists(st.sampled_from(NODE_NAMES), unique=True))
    return [
        pod(app, f"{app}-{n}", node=n, common=draw(st.booleans()), ready=draw(st.booleans()))
        for n in nodes
    ]


@st.composite
def migrations(draw: st.DrawFn) -> list[World]:
    """A GPUCluster's exporters running, then a ClusterPolicy arriving and rolling out its own
    (labelled or not, on some nodes), then either stack going: the worlds in order."""
    gc, cp = gpu_cluster(), cluster_policy(day=3)
    dra_pods = draw(exporter_pods(EXPORTER_DRA))
    dra_ds = daemonset(EXPORTER_DRA, common=draw(st.booleans()), desired=len(dra_pods))
    cp_pods = draw(exporter_pods(LEGACY_APP["exporter"]))
    cp_ds = daemonset(LEGACY_APP["exporter"], common=draw(st.booleans()), desired=len(cp_pods))
    steps = [
        world(gc, dra_ds, dra_pods),
        world(gc, cp, dra_ds, dra_pods),
        world(gc, cp, dra_ds, dra_pods, cp_ds, cp_pods[: len(cp_pods) // 2]),
        world(gc, cp, dra_ds, dra_pods, cp_ds, cp_pods),
    ]
    if draw(st.booleans()):
        steps.append(world(cp, cp_ds, cp_pods))  # the GPUCluster goes (GC -> CP)
    else:
        steps.append(world(gc, dra_ds, dra_pods))  # the ClusterPolicy goes (CP -> GC)
    return steps


@given(migrations(), settings_strategy)
def test_a_migration_between_the_stacks_scrapes_every_ready_exporter_at_every_write(
    steps: list[World], settings: Settings
) -> None:
    services: tuple[K8sObject, ...] = ()
    monitors: tuple[K8sObject, ...] = ()
    for w in steps:
        after = check_plan_keeps_every_exporter_scraped(
            replace(w, services=services, service_monitors=monitors), settings
        )
        services, monitors = after.services, after.service_monitors
