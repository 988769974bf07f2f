"""``shared-svc plan`` on hostile files: a wrong type in any one field never gives a traceback.

A world of the usual strategies is written as a manifest with one value replaced, at any
path of any one object (the object itself included), by a value of another type: YAML-only
values (dates, binary, sets, non-string keys), numbers out of range, deep nesting. Half the
cases put it in the relabelings of two conflicting CRs, which the core copies into its
output. The command either prints a plan (exit 0) or refuses the input in one line (exit 2).
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import io
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from proptests.strategies import worlds
from shared_svc.cli import main
from shared_svc.k8s.objects import K8sObject
from shared_svc.reconcile.model import WORLD_KINDS, World
from tests.worlds import cluster_policy, gc_spec, gpu_cluster, service

Path_ = tuple[str | int, ...]

_json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70_000), st.floats(-1e6, 1e6), st.text(max_size=4)
)
# Values the core may meet in any field (JSON, wrong type): it must plan on, or skip them.
JSON_WRONG = st.recursive(
    _json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=2), st.dictionaries(st.text(max_size=3), inner, max_size=2)
    ),
    max_leaves=4,
)
# Values that are no JSON (or no sane JSON): the edge refuses them in one line.
NOT_JSON = st.one_of(
    st.dates(),
    st.datetimes(timezones=st.just(dt.UTC)),
    st.binary(max_size=4),
    st.sets(st.integers(0, 3), max_size=2),
    st.dictionaries(st.integers(0, 2), _json_scalars, min_size=1, max_size=2),
    st.sampled_from([2**63, -(2**63) - 1, 10**40, float("nan"), float("inf")]),
    st.integers(95, 110).map(lambda n: json.loads("[" * n + "]" * n)),
)
HOSTILE = st.one_of(JSON_WRONG, JSON_WRONG, NOT_JSON)


def _paths(value: Any, at: Path_ = ()) -> Iterator[Path_]:
    yield at
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*at, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*at, index))


def _replace(obj: Any, path: Path_, new: Any) -> Any:
    if not path:
        return new
    parent = obj
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = new
    return obj


_RELABELINGS: Path_ = ("spec", "dcgmExporter", "serviceMonitor", "relabelings")


def _conflicting_crs() -> list[Any]:
    """Two CRs whose relabelings conflict: the values the core copies into its output."""
    return [
        cluster_policy(
            spec=gc_spec(monitor={"enabled": True, "relabelings": [{"action": "drop"}]})
        ),
        gpu_cluster(
            spec=gc_spec(
                monitor={"enabled": True, "relabelings": [{"action": "keep", "regex": "x"}]}
            )
        ),
    ]


@st.composite
def hostile_manifests(draw: st.DrawFn) -> tuple[list[Any], Path_, Any]:
    # A world where the planner has work: a CR and live objects it compares with.
    w: World = draw(
        worlds().filter(lambda w: w.services and (w.cluster_policies or w.gpu_clusters))
    )
    objects: list[Any] = [copy.deepcopy(o) for f in WORLD_KINDS.values() for o in getattr(w, f)]
    # Uniform over objects and paths (integers() would favour the first ones).
    rnd = draw(st.randoms(use_true_random=True))
    if draw(st.booleans()):
        index = rnd.randrange(len(objects))
        path = rnd.choice(list(_paths(objects[index])))
    else:
        objects = _conflicting_crs() + [o for o in objects if o["kind"] == "Service"]
        index = 1
        inside = rnd.choice(
            list(_paths(objects[1]["spec"]["dcgmExporter"]["serviceMonitor"]["relabelings"]))
        )
        path = (*_RELABELINGS, *inside)
    old: Any = objects[index]
    for part in path:
        old = old[part]
    new = draw(HOSTILE.filter(lambda v: type(v) is not type(old)))
    objects[index] = _replace(objects[index], path, new)
    return objects, path, new


def _run(text: str, suffix: str, output: str) -> tuple[int, str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"input{suffix}"
        path.write_text(text, encoding="utf-8")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["plan", "-f", str(path), "-o", output])
    return code, out.getvalue(), err.getvalue()


def _check(code: int, out: str, err: str, output: str) -> None:
    if code == 0:  # stderr: only what plan did not read (a kind that is a date, ...)
        assert all(line.startswith("shared-svc plan: warning: ") for line in err.splitlines())
        assert isinstance(json.loads(out) if output == "json" else yaml.safe_load(out), dict)
    else:
        assert code == 2, (code, err)
        assert out == ""
        assert err.startswith("shared-svc: error: ") and err.count("\n") == 1, err


def _as_json(objects: list[K8sObject]) -> str | None:
    try:
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    except (TypeError, ValueError):
        return None  # bytes, sets, dates, mixed keys: YAML only


def _port_case() -> tuple[list[Any], Path_, Any]:
    """The case the adversarial runs found (``ports: [{port: [a]}]``), always checked."""
    live = service("nvidia-dcgm", managed=True)
    live["spec"]["ports"][0]["port"] = ["a"]
    return [cluster_policy(), live], ("spec", "ports", 0, "port"), ["a"]


@given(hostile_manifests(), st.sampled_from(["yaml", "json"]))
@example(_port_case(), "json")
def test_a_wrong_type_anywhere_is_a_plan_or_one_line_and_exit_2(
    case: tuple[list[Any], Path_, Any], output: str
) -> None:
    objects, _, _ = case
    code, out, err = _run(yaml.safe_dump_all(objects), ".yaml", output)
    _check(code, out, err, output)
    # As `kubectl get -o yaml` writes it: one List, read member by member.
    listing = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects})
    _check(*_run(listing, ".yaml", output), output)
    text = _as_json(objects)
    if text is not None:
        _check(*_run(text, ".json", output), output)
