"""Amended section 7 over sequences of worlds: every exporter Service with scrape "true" is
selected by exactly one of the ServiceMonitors shared-svc keeps, and one with "false" by none,
at every step of a migration.

A sequence moves between the stacks (ClusterPolicy -> GPUCluster -> ClusterPolicy and back),
opens and closes the gate (the common labels roll out and back), turns each CR's
``serviceMonitor.enabled`` on and off, and lets the ServiceMonitor API appear (and go) later;
the GPUCluster controller creates its own ``nvidia-dcgm-exporter-dra`` ServiceMonitor whenever
its CR enables one and it is absent (its PUTs are no-ops under the guard,
tests/test_admission_monitor.py). After the first plan, every intermediate state after each
write of each plan, in the plan's order, is checked:

- no kept ServiceMonitor selects an exporter Service whose scrape is not "true", and none is
  selected by two;
- a Service selected by exactly one before the plan and after it is so after every write, and
  one that turns "true" in the plan is selected from that write on (the flip and the selection
  are one write);
- after the plan, while the canonical ServiceMonitor is kept, every scrape-"true" Service is
  selected by exactly one, and every ready exporter pod is a target of at most one (ServiceMonitor,
  Service) pair.

The oracle reads ServiceMonitors as prometheus-operator does (``namespaceSelector.matchNames``,
then the label selector: ``shared_svc/k8s/selectors.py``), independently of the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import given
from hypothesis import strategies as st

from shared_svc.k8s.objects import K8sObject, annotations_of, labels_of, name_of, owner_refs
from shared_svc.k8s.selectors import SelectorError, label_selector, selector_from_set
from shared_svc.reconcile.model import Settings, World
from shared_svc.reconcile.names import (
    EXPORTER,
    EXPORTER_DRA,
    LEGACY_APP,
    MANAGED_BY_LABEL,
    MANAGED_BY_VALUE,
    SCRAPE_ANNOTATION,
    SERVICE_MONITOR,
    SERVICE_MONITOR_NAMES,
)
from shared_svc.reconcile.planner import plan
from shared_svc.reconcile.selection import serving_node
from tests.worlds import (
    NS,
    apply_plan,
    cluster_policy,
    daemonset,
    gc_spec,
    gpu_cluster,
    gpu_cluster_objects,
    pod,
    world,
)

NODES = ("a", "b")


def _managed(obj: K8sObject) -> bool:
    return labels_of(obj).get(MANAGED_BY_LABEL) == MANAGED_BY_VALUE


def _selects(monitor: K8sObject, svc: K8sObject) -> bool:
    names = (monitor.get("spec", {}).get("namespaceSelector") or {}).get("matchNames") or []
    if NS not in names:
        return False
    try:
        return label_selector(monitor["spec"].get("selector")).matches(labels_of(svc))
    except SelectorError:
        return False


def kept_services(w: World) -> list[K8sObject]:
    """The exporter Services shared-svc keeps: its label and a reference to a CR."""
    return [
        s
        for s in w.services
        if name_of(s) in (EXPORTER, EXPORTER_DRA)
        and _managed(s)
        and any(r.get("kind") in ("ClusterPolicy", "GPUCluster") for r in owner_refs(s))
    ]


def kept_monitors(w: World) -> list[K8sObject]:
    """Ours, and not going away: a drained one (issue 46) selects nothing, a value of our
    label no Service carries, until it is deleted."""
    return [
        m
        for m in w.service_monitors
        if name_of(m) in SERVICE_MONITOR_NAMES and _managed(m) and not _drained(m)
    ]


def _drained(monitor: K8sObject) -> bool:
    labels = ((monitor.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return any(str(v).endswith(".drained") for v in labels.values())


def selection(w: World, adopting: frozenset[str] = frozenset()) -> dict[str, tuple[str, list[str]]]:
    """Kept exporter Service -> (its scrape annotation, every ServiceMonitor selecting it: a
    kept one by its name, any other as ``foreign:<name>``). ``adopting``: the GPUCluster's
    own ServiceMonitor while the plan has not adopted it yet (it selects the alias by
    ``app`` until then), left out."""
    out = {}
    for svc in kept_services(w):
        by = []
        for m in w.service_monitors:
            if not _selects(m, svc):
                continue
            if _managed(m) and name_of(m) in SERVICE_MONITOR_NAMES:
                by.append(name_of(m))
            elif name_of(m) not in adopting:
                by.append(f"foreign:{name_of(m)}")
        out[name_of(svc)] = (str(annotations_of(svc).get(SCRAPE_ANNOTATION)), sorted(by))
    return out


def exactly_once(sel: dict[str, tuple[str, list[str]]]) -> frozenset[str]:
    """Scrape "true" and selected by exactly one ServiceMonitor, one of ours."""
    return frozenset(
        n
        for n, (scrape, by) in sel.items()
        if scrape == "true" and len(by) == 1 and not by[0].startswith("foreign:")
    )


def check_state(sel: dict[str, tuple[str, list[str]]], where: object) -> None:
    for name, (scrape, by) in sel.items():
        if scrape != "true":
            assert by == [], (where, name, scrape, by)
        assert len(by) <= 1, (where, name, by)
        assert not any(m.startswith("foreign:") for m in by), (where, name, by)


def targets(w: World) -> dict[str, int]:
    """Ready exporter pod -> how many (kept ServiceMonitor, Service) pairs scrape it."""
    monitors = kept_monitors(w)
    counts: dict[str, int] = {}
    for p in w.pods:
        if serving_node(p) is None or "exporter" not in labels_of(p).get("app", ""):
            continue
        n = 0
        for svc in kept_services(w):
            chosen = svc.get("spec", {}).get("selector")
            if not isinstance(chosen, dict) or not chosen:
                continue
            if selector_from_set(chosen).matches(labels_of(p)):
                n += sum(1 for m in monitors if _selects(m, svc))
        counts[name_of(p)] = n
    return counts


def check_plan(w: World, settings: Settings) -> World:
    """Plans ``w``, checks every state after each write in order; returns the last state."""
    p = plan(w, settings)
    writes = p.writes
    states = [apply_plan(w, replace(p, actions=writes[:k])) for k in range(1, len(writes) + 1)]
    after = states[-1] if states else w
    # Ours after the plan, not before: the plan adopts it.
    adopting = frozenset(name_of(m) for m in kept_monitors(after)) - frozenset(
        name_of(m) for m in kept_monitors(w)
    )
    start = selection(w, adopting)
    end = selection(after)
    kept_through = exactly_once(start) & exactly_once(end)
    turned_on = {n for n, (scrape, _) in end.items() if scrape == "true"} - {
        n for n, (scrape, _) in start.items() if scrape == "true"
    }
    for k, state in enumerate(states, 1):
        sel = selection(state, adopting - {name_of(m) for m in kept_monitors(state)})
        where = (k, [(a.action, a.kind, a.name) for a in writes])
        check_state(sel, where)
        good = exactly_once(sel)
        assert kept_through <= good, (where, sorted(kept_through - good), sel)
        for name in turned_on & exactly_once(end):
            if sel.get(name, ("", []))[0] == "true":
                assert name in good, (where, name, sel)
    if any(name_of(m) == SERVICE_MONITOR for m in kept_monitors(after)):
        scraped = {n for n, (scrape, _) in end.items() if scrape == "true"}
        assert scraped <= exactly_once(end), end
        doubled = {pod: n for pod, n in targets(after).items() if n > 1}
        assert not doubled, doubled
    return after


@dataclass(frozen=True)
class Step:
    cp: bool  # a ClusterPolicy exists
    cp_monitor: bool
    gc: bool  # the GPUCluster exists
    gc_monitor: bool
    cp_common: bool  # the ClusterPolicy exporter pods carry the common label (rolled out)
    dra_common: bool
    served: bool  # the cluster serves the ServiceMonitor API
    cp_nodes: tuple[str, ...]  # nodes with a ready ClusterPolicy exporter pod
    dra_nodes: tuple[str, ...]


steps = st.builds(
    Step,
    cp=st.booleans(),
    cp_monitor=st.booleans(),
    gc=st.booleans(),
    gc_monitor=st.booleans(),
    cp_common=st.booleans(),
    dra_common=st.booleans(),
    served=st.booleans() | st.just(True),
    cp_nodes=st.sampled_from([(), ("a",), NODES]),
    dra_nodes=st.sampled_from([(), ("a",), NODES]),
)


def _monitor(on: bool) -> dict[str, object]:
    return {"enabled": on, "interval": "15s"} if on else {"enabled": False}


def world_of(step: Step, previous: World) -> World:
    """The CRs and workloads of ``step``; Services and ServiceMonitors as the last plan left
    them (none while the API is not served), plus the GPUCluster controller's own
    ServiceMonitor when its CR enables one and it is absent (its create)."""
    objs: list[K8sObject] = []
    gc = gpu_cluster(spec=gc_spec(dcgm=False, monitor=_monitor(step.gc_monitor)))
    if step.cp:
        spec = {
            "dcgm": {"enabled": False},
            "dcgmExporter": {"serviceMonitor": _monitor(step.cp_monitor)},
        }
        objs.append(cluster_policy(day=3, spec=spec))
        app = LEGACY_APP["exporter"]
        objs.append(daemonset(app, common=step.cp_common, desired=len(step.cp_nodes)))
        objs += [pod(app, f"{app}-{n}", common=step.cp_common, node=n) for n in step.cp_nodes]
    if step.gc:
        objs.append(gc)
        objs.append(daemonset(EXPORTER_DRA, common=step.dra_common, desired=len(step.dra_nodes)))
        objs += [
            pod(EXPORTER_DRA, f"{EXPORTER_DRA}-{n}", common=step.dra_common, node=n)
            for n in step.dra_nodes
        ]
    monitors = list(previous.service_monitors) if step.served else []
    absent = not any(name_of(m) == EXPORTER_DRA for m in monitors)
    if step.served and step.gc and absent:
        # Its create (with its controller reference and the state label); were it present, its
        # whole PUT would be a no-op under the guard.
        rendered = gpu_cluster_objects(gc, NS, monitors=True)
        monitors += [
            {**o, "metadata": {**o["metadata"], "uid": "uid-gc-sm", "resourceVersion": "3"}}
            for o in rendered
            if o["kind"] == "ServiceMonitor"
        ]
    return replace(world(*objs), services=previous.services, service_monitors=tuple(monitors))


@given(st.lists(steps, min_size=2, max_size=6), st.sampled_from(["auto", "app"]))
def test_every_scrape_true_exporter_service_is_selected_by_exactly_one_monitor_at_every_write(
    sequence: list[Step], mode: str
) -> None:
    current = World()
    for i, step in enumerate(sequence):
        settings = Settings(selector_mode=mode, service_monitor_served=step.served)  # type: ignore[arg-type]
        nxt = world_of(step, current)
        if i == 0:
            # From wherever the first world stands: one plan brings it to the invariant.
            current = apply_plan(nxt, plan(nxt, settings))
            check_state(selection(current), "first plan")
            continue
        current = check_plan(nxt, settings)


def migration(*, back_to_cp: bool, gc_first_alone: bool) -> list[Step]:
    """CP -> GC (-> CP): the new CR first, the old one's pods go, labels roll out and back."""
    base = Step(True, True, False, True, False, False, True, NODES, ())
    both = replace(base, gc=True)
    dra_up = replace(both, dra_nodes=NODES)
    labelled = replace(dra_up, cp_common=True, dra_common=True)  # the gate opens
    gc_only = replace(labelled, cp=False, cp_nodes=())
    out = [base, both, dra_up, labelled, gc_only]
    if back_to_cp:
        back = replace(gc_only, cp=True, cp_common=False, dra_common=False)  # the gate closes
        out += [back, replace(back, cp_nodes=NODES), replace(back, cp_nodes=NODES, gc=False)]
    if gc_first_alone:
        out = [replace(s, cp=False, cp_nodes=()) for s in out[:1]] + out
    return out


@given(st.booleans(), st.booleans(), st.booleans(), st.booleans())
def test_a_migration_cp_gc_cp_keeps_every_scraped_service_on_exactly_one_monitor(
    back_to_cp: bool, gc_first_alone: bool, late_api: bool, cp_monitor: bool
) -> None:
    sequence = migration(back_to_cp=back_to_cp, gc_first_alone=gc_first_alone)
    sequence = [replace(s, cp_monitor=cp_monitor) for s in sequence]
    if late_api:
        sequence = [replace(sequence[0], served=False), *sequence]
    current = World()
    for step in sequence:
        settings = Settings(service_monitor_served=step.served)
        current = check_plan(world_of(step, current), settings)
