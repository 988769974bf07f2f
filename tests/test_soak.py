"""The soak, bounded (issue 44): a seeded life of the cluster on the real parties (the
control plane with kube-controller-manager, the real gpu-operator, the chart's guard, two
``shared-svc run`` replicas with the shipped defaults and the chart's RBAC), faults
included, every invariant checked after every step (tests/soak/). ``make soak`` runs it
long.

- The bounded run: :data:`STEPS` steps of seed :data:`SEED`, no violation, driver upgrades
  on both paths among them.
- A planted bug (tests/soak/replica.py: a Service two CRs need gets the first reference
  only) is caught at the first step whose model has a Service two CRs need, never later:
  the soak checks every step.
- A failing history shrinks to the steps that matter (``shrink``): the planted bug's
  three steps to the two CR creations that make a shared Service.
- The invariants about time (tests/soak/timeline.py) catch what a settled world cannot
  show: a build without the hold (``no-hold``), a build that frees on the restart-only
  path (``restart-frees``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.soak import model as m
from tests.soak.runner import SETTLE, shrink, soak

pytestmark = [
    pytest.mark.apiserver,
    pytest.mark.controller_manager,
    pytest.mark.gpu_operator,
    pytest.mark.helm,
    pytest.mark.upgrade_libs,
]

SEED = 0  # three full driver upgrades (one while etcd is killed), two restart-only ones
STEPS = 20
BUDGET = 1200.0  # seconds: a bound against a hang, not a figure (20 steps take about 5 min)


async def test_a_bounded_life_keeps_every_invariant(tmp_path: Path) -> None:
    report = await soak(tmp_path, seed=SEED, steps=STEPS, budget=BUDGET)
    assert report.violation is None, report.as_dict()
    assert report.steps == STEPS, report.as_dict()
    # The seed's upgrades happened, and freed what they had to: 2 consumers a node each.
    assert report.upgrades["full"] >= 1 and report.upgrades["restart-only"] >= 1, report.upgrades
    assert report.timeline["consumers asked to go"] >= 4 * report.upgrades["full"], report.timeline


def first_shared(seed: int, steps: int) -> int:
    """The first step after which the model has a Service that two CRs need."""
    for step, model in m.history(seed, steps):
        if any(len(crs) > 1 for crs in model.needs().values()):
            return step.index
    raise AssertionError(f"seed {seed}: no Service two CRs need in {steps} steps")


async def test_a_planted_bug_is_caught_at_the_first_step_that_shows_it(tmp_path: Path) -> None:
    # Seed 1's first shared Service comes inside a guard fault, after a SIGTERM, cut watches
    # and a rollout, with no driver upgrade before it.
    seed = 1
    first = first_shared(seed, STEPS)
    report = await soak(tmp_path, seed=seed, steps=STEPS, budget=BUDGET, plant="owner-refs")
    assert report.violation is not None, report.as_dict()
    assert report.violation["step"] == first, report.as_dict()
    assert "owner references" in str(report.violation["detail"]), report.violation
    assert report.out is not None and (report.out / "violation.json").is_file()


async def test_a_leader_frozen_past_its_lease_never_leads_beside_the_next(tmp_path: Path) -> None:
    """Kept from the soak: the leader stopped (SIGSTOP) for longer than the Lease while a
    GPUCluster arrives; the standby takes over, and the old leader, continued, must not say
    it leads (nor write) for a moment beside it: its renew deadline passed while it was
    stopped, whatever its lease loop has not noticed yet."""
    policy = m.CR(m.CP, m.CP_NAME, 0, dcgm=True, exporter=True)
    cluster = m.CR(m.GC, m.GC_NAME, 1, dcgm=True, exporter=True)
    first = m.Model().with_cr(policy)
    second = first.with_cr(cluster)
    history = [
        (m.Step(0, "cp-create", change="cp-create", cr=policy), first),
        (m.Step(1, "freeze", change="gc-create", cr=cluster, leader=True, seconds=20.0), second),
    ]
    report = await soak(tmp_path, seed=0, steps=2, budget=BUDGET, history=history)
    assert report.violation is None, report.as_dict()
    assert report.steps == 2
    first_leader, second_leader = report.leaders
    assert first_leader != second_leader, "the standby took over while the leader was stopped"


async def test_a_failing_history_shrinks_to_the_steps_that_matter(tmp_path: Path) -> None:
    """The planted bug's history of three steps (test_a_planted_bug_... proves such a one
    fails): the Lease fault goes, the two creations stay."""
    policy = m.CR(m.CP, m.CP_NAME, 0, dcgm=True, exporter=True)
    cluster = m.CR(m.GC, m.GC_NAME, 2, dcgm=True, exporter=True)
    steps = [
        m.Step(0, "cp-create", change="cp-create", cr=policy),
        m.Step(1, "lease"),
        m.Step(2, "gc-create", change="gc-create", cr=cluster),
    ]
    what = f"not settled after {SETTLE:g} s"  # the owner references never right
    shorter, runs = await shrink(tmp_path, steps, what, plant="owner-refs", budget=BUDGET)
    assert [(s.change, s.cr) for s in shorter] == [
        ("cp-create", policy),
        ("gc-create", cluster),
    ], shorter
    assert runs == 2  # one run per step that could go, the last one kept


def _scripted(*steps: m.Step) -> list[tuple[m.Step, m.Model]]:
    history = m.rebuild(list(steps))
    assert history is not None, steps
    return history


async def test_the_hold_is_judged_over_time_and_a_build_without_it_is_caught(
    tmp_path: Path,
) -> None:
    """A GPUCluster, then a ClusterPolicy: ``nvidia-dcgm`` must keep the DRA pods' label
    until the ClusterPolicy's pods cover both nodes (the settled world is the same either
    way, so only the timeline can tell). With the hold it does; with the hold planted away
    (``no-hold``) the timeline sees the move that left the nodes uncovered."""
    cluster = m.CR(m.GC, m.GC_NAME, 0, dcgm=True)
    policy = m.CR(m.CP, m.CP_NAME, 1, dcgm=True, exporter=False)
    history = _scripted(
        m.Step(0, "gc-create", change="gc-create", cr=cluster),
        m.Step(1, "cp-create", change="cp-create", cr=policy),
    )
    held = await soak(tmp_path / "held", seed=0, steps=2, budget=BUDGET, history=history)
    assert held.violation is None, held.as_dict()
    assert held.timeline["selector moves judged"] >= 1, held.as_dict()
    planted = await soak(
        tmp_path / "planted", seed=0, steps=2, budget=BUDGET, history=history, plant="no-hold"
    )
    assert planted.violation is not None, planted.as_dict()
    assert planted.violation["step"] == 1, planted.violation
    assert "(the hold)" in str(planted.violation["detail"]), planted.violation


async def test_a_build_that_frees_on_the_restart_only_path_is_caught(tmp_path: Path) -> None:
    """A ClusterPolicy, then a ``helm upgrade`` of gpu-operator (the driver DaemonSet's chart
    label only): the driver restarts in place. With the restart-only rule planted away
    (``restart-frees``) shared-svc frees the node's consumers, which the timeline sees."""
    policy = m.CR(m.CP, m.CP_NAME, 0, dcgm=True, exporter=True)
    history = _scripted(
        m.Step(0, "cp-create", change="cp-create", cr=policy),
        m.Step(1, "driver-restart", change="driver-restart"),
    )
    report = await soak(
        tmp_path, seed=0, steps=2, budget=BUDGET, history=history, plant="restart-frees"
    )
    assert report.violation is not None, report.as_dict()
    assert report.violation["step"] == 1, report.violation
    assert report.violation["what"] == "the restart-only upgrade path broke", report.violation
    assert "asked to go" in str(report.violation["detail"]), report.violation
