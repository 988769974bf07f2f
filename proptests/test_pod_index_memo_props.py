"""The pod index kept from one plan to the next (``selection.pod_index``, issue 22) never
changes a plan: over sequences of generated worlds, where a world keeps the very pods
tuple of an earlier one (a change of the CRs, Services or DaemonSets only, as the caches
hand it out) or brings its own, and the namespace changes too, each plan equals the plan
of the same world with nothing kept."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from proptests.strategies import settings_strategy, worlds
from shared_svc.reconcile import selection
from shared_svc.reconcile.model import Plan, Settings, World
from shared_svc.reconcile.planner import plan
from tests.worlds import pod

# Each step: a world, whether it keeps the pods tuple of an earlier step's world (which
# one), and its namespace.
steps = st.lists(
    st.tuples(
        worlds(),
        st.one_of(st.none(), st.integers(0, 5)),
        st.sampled_from(["gpu-operator", "other"]),
    ),
    min_size=1,
    max_size=6,
)


def _sequence(drawn: list[tuple[World, int | None, str]]) -> list[tuple[World, str]]:
    out: list[tuple[World, str]] = []
    for w, earlier, namespace in drawn:
        if earlier is not None and out:
            w = replace(w, pods=out[earlier % len(out)][0].pods)
        out.append((w, namespace))
    return out


def _plans(sequence: list[tuple[World, str]], settings: Settings, *, kept: bool) -> list[Plan]:
    plans = []
    selection.pod_index.clear()
    for w, namespace in sequence:
        if not kept:
            selection.pod_index.clear()
        plans.append(plan(w, replace(settings, namespace=namespace)))
    return plans


@given(steps, settings_strategy)
def test_plans_with_the_kept_pod_index_equal_plans_from_scratch(
    drawn: list[tuple[World, int | None, str]], settings: Settings
) -> None:
    sequence = _sequence(drawn)
    assert _plans(sequence, settings, kept=True) == _plans(sequence, settings, kept=False)


@given(worlds(), settings_strategy)
def test_a_list_of_pods_is_indexed_anew_each_time(w: World, settings: Settings) -> None:
    """Only a tuple (which cannot change) is kept: a list changed in place is read again."""
    late = pod("nvidia-dcgm", "nvidia-dcgm-late", common=False, node="node-a")
    from_scratch = plan(replace(w, pods=(*w.pods, late)), settings)
    pods = list(w.pods)
    listed = replace(w, pods=pods)  # type: ignore[arg-type]  # a caller's list, not a cache's tuple
    plan(listed, settings)
    pods.append(late)
    assert plan(listed, settings) == from_scratch
