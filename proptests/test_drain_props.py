"""A ServiceMonitor going away first loses its targets (issue 46), over sequences of worlds
with a clock.

The steps of tests/test_monitor_selection_props.py (the stacks come and go, each CR's
``serviceMonitor.enabled`` turns on and off, the gate opens and closes, the API appears
later), each planned at a time that moves on by a drawn amount; between steps, the time
may also move on to when the last plan asked to be planned again (``recheck_after``), as
the controller does. At every plan:

- safety: a ServiceMonitor of ours is deleted only when, in the world planned against, it
  has selected nothing (``drained_selector``) for at least two of its scrape intervals and
  Prometheus' discovery time (10 s);
- the section 7 invariants of every state after each write still hold (``check_plan``: a
  drained ServiceMonitor selects nothing, so it never selects a Service twice);
- liveness: once the steps end with no CR needing it, a ServiceMonitor of ours is gone
  after at most two plans at the times the plans ask for (drained, then deleted).

The oracle reads the drained state from the object (its selector and the annotation's
time), independently of the planner's wait.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from proptests.test_monitor_selection_props import Step, check_plan, steps, world_of
from shared_svc.k8s.objects import K8sObject, name_of
from shared_svc.reconcile.model import Settings, World
from shared_svc.reconcile.names import (
    DRAINED_ANNOTATION,
    MANAGED_BY_LABEL,
    MANAGED_BY_VALUE,
    SERVICE_MONITOR_NAMES,
)
from shared_svc.reconcile.planner import plan
from shared_svc.reconcile.specs import duration_seconds
from tests.worlds import apply_plan

DEFAULT_INTERVAL = 30.0  # Settings.scrape_interval_seconds
T0 = 1_800_000_000.0


def drained_for(monitor: K8sObject, now: float) -> float | None:
    """How long ``monitor`` has selected nothing, by its selector and annotation."""
    selector = (monitor.get("spec") or {}).get("selector") or {}
    labels = selector.get("matchLabels") or {}
    if not any(str(v).endswith(".drained") for v in labels.values()):
        return None
    stamp = ((monitor.get("metadata") or {}).get("annotations") or {}).get(DRAINED_ANNOTATION)
    if stamp is None:
        return None
    return now - dt.datetime.fromisoformat(stamp).timestamp()


def ours_of(w: World) -> list[K8sObject]:
    """Every ServiceMonitor of ours, drained or not."""
    return [
        m
        for m in w.service_monitors
        if name_of(m) in SERVICE_MONITOR_NAMES
        and (m.get("metadata") or {}).get("labels", {}).get(MANAGED_BY_LABEL) == MANAGED_BY_VALUE
    ]


def interval_of(monitor: K8sObject) -> float:
    endpoints = (monitor.get("spec") or {}).get("endpoints") or []
    found = [duration_seconds(e.get("interval")) or DEFAULT_INTERVAL for e in endpoints]
    return max(found, default=DEFAULT_INTERVAL)


def check_deletes(w: World, settings: Settings) -> None:
    """No ServiceMonitor of ours deleted before it has selected nothing for two intervals."""
    assert w.now is not None
    p = plan(w, settings)
    ours = {name_of(m): m for m in ours_of(w)}
    for action in p.writes:
        if action.kind != "ServiceMonitor" or action.action != "delete" or action.name not in ours:
            continue
        monitor = ours[action.name]
        held = drained_for(monitor, w.now)
        assert held is not None, f"{action.name} deleted while it selects something"
        # two scrape intervals, and Prometheus' discovery (10 s)
        assert held >= 2 * interval_of(monitor) + 10.0, (action.name, held, interval_of(monitor))


@given(
    st.lists(steps, min_size=2, max_size=6),
    st.lists(st.floats(min_value=0, max_value=90), min_size=6, max_size=6),
    st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_a_monitor_of_ours_is_deleted_only_after_two_intervals_selecting_nothing(
    sequence: list[Step], moves: list[float], wait_for_recheck: list[bool]
) -> None:
    current = World()
    now = T0
    recheck: float | None = None
    for i, step in enumerate(sequence):
        settings = Settings(service_monitor_served=step.served)
        now += recheck if wait_for_recheck[i] and recheck is not None else moves[i]
        nxt = replace(world_of(step, current), now=now)
        check_deletes(nxt, settings)
        recheck = plan(nxt, settings).recheck_after
        if i == 0:
            current = apply_plan(nxt, plan(nxt, settings))
            continue
        current = check_plan(nxt, settings)
    # The CRs go (the workloads with them): every ServiceMonitor of ours goes, in time.
    last = replace(sequence[-1], cp=False, gc=False, cp_nodes=(), dra_nodes=(), served=True)
    settings = Settings()
    for _ in range(3):
        nxt = replace(world_of(last, current), now=now)
        check_deletes(nxt, settings)
        p = plan(nxt, settings)
        current = apply_plan(nxt, p)
        now += p.recheck_after or 0.0
    left = [name_of(m) for m in ours_of(current)]
    assert not left, left
