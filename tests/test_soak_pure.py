"""The soak's pure parts (tests/soak/): a history rebuilt from its steps alone (what
shrinking and ``--history`` replay rest on), the dump's steps read back, and the judge of
the replicas' logs. No world is started here (tests/test_soak.py runs the soak)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.soak import model as m
from tests.soak import timeline as tl
from tests.soak.__main__ import read_history
from tests.soak.runner import EXPLAINED_ERRORS, judge_log


@pytest.mark.parametrize("seed", [1, 2, 3, 7, 11])
def test_a_seeds_steps_rebuild_its_history(seed: int) -> None:
    history = m.history(seed, 300)
    assert m.rebuild([step for step, _ in history]) == history


def test_a_step_reads_back_as_written() -> None:
    for step, _ in m.history(5, 200):
        assert m.step_from_json(json.loads(json.dumps(m.step_json(step)))) == step


def test_a_history_without_a_step_is_rebuilt_or_refused() -> None:
    policy = m.CR(m.CP, m.CP_NAME, 0, dcgm=True, exporter=True)
    edited = m.CR(m.CP, m.CP_NAME, 0, dcgm=False, exporter=True)
    create = m.Step(0, "cp-create", change="cp-create", cr=policy)
    edit = m.Step(1, "kill", change="cp-edit", cr=edited)
    delete = m.Step(2, "cp-delete", change="cp-delete", cr=edited)
    assert m.rebuild([edit, delete]) is None  # the CR it edits was never created
    assert m.rebuild([create, create]) is None
    rebuilt = m.rebuild([create, delete])
    assert rebuilt is not None
    assert [step.index for step, _ in rebuilt] == [0, 1]
    assert rebuilt[0][1].needs() == {m.DCGM: {policy.key}, m.EXPORTER: {policy.key}}
    assert rebuilt[1][1].needs() == {}
    after_edit = m.rebuild([create, edit])
    assert after_edit is not None and after_edit[1][1].needs() == {m.EXPORTER: {policy.key}}


def record(level: str, msg: str, **extra: str) -> str:
    return json.dumps({"ts": "t", "level": level, "logger": "shared_svc", "msg": msg, **extra})


def test_the_log_judge_names_errors_tracebacks_and_stray_lines_and_counts_warnings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = [
        ("r0", "--- start 1 ---"),
        ("r0", record("info", "starting")),
        ("r0", record("warning", "watch failed; will re-list")),
        ("r1", record("warning", "watch failed; will re-list")),
        ("r1", record("warning", "lease request failed")),
    ]
    problems, warnings = judge_log(lines, "apiserver")
    assert problems == []
    assert warnings == {"watch failed; will re-list": 2, "lease request failed": 1}
    bad = [
        ("r0", record("error", "controller ended unexpectedly")),
        ("r1", "Traceback (most recent call last):"),
        ("r1", record("warning", "beat", exc="Traceback (most recent call last): ...")),
    ]
    problems, _ = judge_log(bad, "kill")
    assert len(problems) == 3, problems
    assert problems[0].startswith("r0: error after a kill step")
    assert "not a log record" in problems[1]
    assert "a traceback at warning" in problems[2]
    monkeypatch.setitem(EXPLAINED_ERRORS, "kill", ("controller ended",))
    assert judge_log(bad[:1], "kill")[0] == []
    assert judge_log(bad[:1], "term")[0] != []


def test_a_history_file_that_is_not_a_dump_is_refused_clearly(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    path.write_text("{}")
    with pytest.raises(SystemExit, match="not a soak dump with its steps"):
        read_history(path)
    edited = m.CR(m.GC, m.GC_NAME, 0)
    path.write_text(json.dumps({"steps": [m.step_json(m.Step(0, "gc-edit", "gc-edit", edited))]}))
    with pytest.raises(SystemExit, match="cannot be made in this order"):
        read_history(path)
    created = m.Step(0, "gc-create", "gc-create", edited)
    path.write_text(json.dumps({"steps": [m.step_json(created)]}))
    assert read_history(path) == m.rebuild([created])


# --- the upgrade side's model and the timeline's verdicts (tests/soak/timeline.py) ---


def test_a_driver_change_is_installed_while_a_cluster_policy_is_active() -> None:
    """The upgrade flow runs in ClusterPolicy mode only here: a change made with no
    ClusterPolicy waits for the next one, and its path is the one the nodes then take."""
    empty = m.Model()
    upgraded = m.driver_changed(empty, "driver-upgrade").normalized()
    assert (upgraded.driver, upgraded.installed) == ((1, 0), (0, 0))
    assert m.upgrade_path(empty, upgraded) == "none"
    policy = m.CR(m.CP, m.CP_NAME, 0, dcgm=True, exporter=True)
    active = upgraded.with_cr(policy).normalized()
    assert active.installed == (1, 0) and m.upgrade_path(upgraded, active) == "full"
    restarted = m.driver_changed(active, "driver-restart").normalized()
    assert restarted.installed == (1, 1) and m.upgrade_path(active, restarted) == "restart-only"
    both = m.driver_changed(m.driver_changed(restarted, "driver-restart"), "driver-upgrade")
    assert m.upgrade_path(restarted, both.normalized()) == "full"
    assert policy.spec()["driver"]["upgradePolicy"]["waitForCompletion"]["podSelector"] == (
        m.CONSUMER_SELECTOR
    )


def _node(name: str, state: str | None, parked: bool = False) -> dict[str, Any]:
    labels = {} if state is None else {tl.STATE: state}
    if parked:
        labels[tl.PARKED] = "true"
    return {"metadata": {"name": name, "labels": labels}}


def _pod(
    uid: str, node: str, labels: dict[str, str], *, ns: str = "ml", ready: bool = True
) -> dict[str, Any]:
    return {
        "metadata": {"uid": uid, "name": uid, "namespace": ns, "labels": labels},
        "spec": {"nodeName": node},
        "status": {"conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def _going(pod: dict[str, Any]) -> dict[str, Any]:
    return {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "2026-12-07T00:00:00Z"}}


def _feed(t: tl.Timeline, path: str, *objs: tuple[str, dict[str, Any], float]) -> list[str]:
    events = [
        tl.Event(kind, "MODIFIED", rv, at, obj) for rv, (kind, obj, at) in enumerate(objs, 100)
    ]
    return t.feed(events, path)


def test_a_consumer_asked_to_go_outside_the_freeing_states_is_a_violation() -> None:
    trainer = _pod("u1", "n0", {tl.CONSUMER[0]: "true"})
    web = _pod("u2", "n0", {"app": "web"})
    t = tl.Timeline("ml", "gpu-operator")
    assert not _feed(t, "full", ("node", _node("n0", "cordon-required"), 0), ("pod", trainer, 0))
    assert not _feed(t, "full", ("pod", _going(trainer), 0), ("pod", _going(trainer), 0))
    for state, path in (("upgrade-done", "full"), ("pod-restart-required", "restart-only")):
        t = tl.Timeline("ml", "gpu-operator")
        found = _feed(t, path, ("node", _node("n0", state), 0), ("pod", _going(trainer), 0))
        assert len(found) == 1 and "consumer ml/u1 asked to go" in found[0], found
        assert not _feed(t, path, ("pod", _going(web), 0))  # not a consumer: not judged
    t = tl.Timeline("ml", "gpu-operator")
    found = _feed(t, "full", ("node", _node("n0", "upgrade-required"), 0),
                  ("node", _node("n0", "upgrade-required", parked=True), 0))  # fmt: skip
    assert len(found) == 1 and "parked in state 'upgrade-required'" in found[0], found
    # On the restart-only path, freeing on a guess shared-svc recorded (and reported) is the
    # contract's side that cannot stall a full upgrade: explained, and counted.
    t = tl.Timeline("ml", "gpu-operator")
    node = _node("n0", "pod-restart-required", parked=True)
    node["metadata"]["annotations"] = {tl.RECORD: json.dumps({"pathEvidence": "guess"})}
    assert not _feed(t, "restart-only", ("node", node, 0), ("pod", _going(trainer), 0))
    assert t.guessed == 2  # the node parked, the consumer asked to go
    node["metadata"]["annotations"] = {tl.RECORD: json.dumps({"pathEvidence": "driver-pod"})}
    other = _pod("u3", "n0", {tl.CONSUMER[0]: "true"})
    assert _feed(t, "restart-only", ("node", node, 0), ("pod", _going(other), 0))


def _dcgm(selector: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": tl.HELD, "namespace": "gpu-operator", "uid": "s1"},
        "spec": {"selector": selector},
    }


def test_the_hold_is_judged_on_the_pods_at_the_moment_of_the_move() -> None:
    legacy, dra = {"app": "nvidia-dcgm"}, {"app": "nvidia-dcgm-dra"}
    pods = [
        ("pod", _pod(f"{app}-{n}", n, {"app": app}, ns="gpu-operator"), 0.0)
        for app in ("nvidia-dcgm", "nvidia-dcgm-dra")
        for n in ("n0", "n1")
    ]
    t = tl.Timeline("ml", "gpu-operator")
    assert not _feed(t, "none", *pods, ("service", _dcgm(legacy), 0.0))
    assert not _feed(t, "none", ("service", _dcgm(dra), 1.0))  # both nodes covered
    assert t.moves == 1
    # The DRA pod on n1 not ready any more: a move to the DRA label leaves n1 uncovered...
    gone = ("pod", _pod("nvidia-dcgm-dra-n1", "n1", dra, ns="gpu-operator", ready=False), 10.0)
    assert not _feed(t, "none", ("service", _dcgm(legacy), 5.0), gone)
    found = _feed(t, "none", ("service", _dcgm(dra), 20.0))
    assert len(found) == 1 and "leaving ['n1'] uncovered" in found[0], found
    # ... unless it went within LAG seconds before the move (shared-svc's cache a moment old).
    back = ("pod", _pod("nvidia-dcgm-dra-n1", "n1", dra, ns="gpu-operator"), 21.0)
    again = ("pod", _pod("nvidia-dcgm-dra-n1", "n1", dra, ns="gpu-operator", ready=False), 30.0)
    assert not _feed(t, "none", ("service", _dcgm(legacy), 22.0), back, again)
    assert not _feed(t, "none", ("service", _dcgm(dra), 30.0 + tl.LAG / 2))
