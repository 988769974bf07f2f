"""The soak's pure parts (tests/soak/): a history rebuilt from its steps alone (what
shrinking and ``--history`` replay rest on), the dump's steps read back, and the judge of
the replicas' logs. No world is started here (tests/test_soak.py runs the soak)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.soak import model as m
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
