"""``shared-svc plan``: what the reconciler would do with a set of manifests, offline.

Reads ClusterPolicies, GPUClusters, DaemonSets, Pods, Services and ServiceMonitors from
YAML or JSON files (``kubectl get -o yaml`` output included), runs the pure planner and
prints the objects, actions, conflicts, pending migrations and spec errors. No API access.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import yaml
from msgspec import UNSET, UnsetType

from shared_svc.commands.plan.json_stream import Fast, NotJSON, Text, load_json_stream
from shared_svc.commands.plan.manifests import MAX_BYTES, InputError, size_text
from shared_svc.commands.plan.yaml_stream import ALL, Shape, load_yaml_stream
from shared_svc.commands.plan.yaml_text import load_documents
from shared_svc.errors import UsageError
from shared_svc.k8s.objects import K8sObject, as_json, camel_keys
from shared_svc.reconcile.model import (
    CLUSTER_SCOPED_KINDS,
    WORLD_KINDS,
    Plan,
    Settings,
    World,
    world_of,
)
from shared_svc.reconcile.planner import plan
from shared_svc.reconcile.selection import pod_fields


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show the Services the reconciler would manage, offline, from manifests",
        description=__doc__,
    )
    parser.add_argument(
        "-f",
        "--filename",
        dest="files",
        action="append",
        required=True,
        metavar="FILE",
        help="YAML or JSON manifests (many documents, List kinds); '-' reads stdin; repeatable",
    )
    parser.add_argument(
        "--namespace",
        default="gpu-operator",
        help="operator namespace: namespaced objects of other namespaces are ignored (a warning)",
    )
    parser.add_argument(
        "--selector-mode",
        choices=("auto", "app"),
        default="auto",
        help="auto: move stable names to the common labels when the gate holds; app: never",
    )
    parser.add_argument(
        "--no-adopt", action="store_true", help="never adopt same-named unmanaged objects"
    )
    parser.add_argument(
        "-o", "--output", choices=("yaml", "json"), default="yaml", help="output format"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    ignored: Counter[tuple[str, str | None]] = Counter()
    world = load_world(args.files, args.namespace, ignored)
    for line in ignored_lines(ignored, args.namespace):
        print(f"shared-svc plan: warning: {line}", file=sys.stderr)
    settings = Settings(
        namespace=args.namespace,
        selector_mode=args.selector_mode,
        adopt=not args.no_adopt,
        service_monitor_served=True,
    )
    sys.stdout.write(render(plan_output(plan(world, settings)), args.output))
    return 0


def render(output: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(output, indent=2, sort_keys=True) + "\n"
    return yaml.safe_dump(output, sort_keys=True, default_flow_style=False)


def plan_output(result: Plan) -> dict[str, Any]:
    """The output contract of ``plan`` (docs/plan.md): field names camelCased by the
    serializer of ``/status`` (``status.as_json``); the objects are data, as they are."""
    actions = []
    for action in result.actions:
        entry: dict[str, Any] = {
            "action": action.action,
            "kind": action.kind,
            "name": action.name,
            "reason": action.reason,
        }
        if action.action == "delete" and action.preconditions is not None:
            entry["preconditions"] = dict(action.preconditions)
        if action.action == "update":
            entry["changed_fields"] = list(action.changed_fields)
        actions.append(camel_keys(entry))
    return {
        "objects": [dict(o) for o in result.objects],
        "actions": actions,
        "conflicts": as_json(result.conflicts),
        "pending": as_json(result.pending),
        "errors": as_json(result.errors),
    }


def load_world(
    files: list[str],
    namespace: str,
    ignored: Counter[tuple[str, str | None]] | None = None,
) -> World:
    """The objects plan reads; ``ignored`` counts the others by (kind, namespace): the
    namespace None for a kind plan does not read, else a namespace not the operator's."""
    buckets: dict[str, list[K8sObject]] = {kind: [] for kind in WORLD_KINDS}
    skipped: Counter[tuple[str, str | None]] = Counter() if ignored is None else ignored
    with _collector_paused():
        _read_into(buckets, skipped, files, namespace)
    return world_of(buckets)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while manifests are read: what is read is
    trees of JSON values (no cycles), so its passes over the growing store find nothing,
    and they were 15 % of reading 50,000 pods (issue 22)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _read_into(
    buckets: dict[str, list[K8sObject]],
    skipped: Counter[tuple[str, str | None]],
    files: list[str],
    namespace: str,
) -> None:
    for name in files:
        for obj in _objects(name):
            kind = obj["kind"]
            if kind not in WORLD_KINDS:
                skipped[kind, None] += 1
            elif kind in CLUSTER_SCOPED_KINDS:
                buckets[kind].append(obj)
            elif (where := obj["metadata"].get("namespace", namespace)) != namespace:
                skipped[kind, str(where)] += 1
            else:
                buckets[kind].append(pod_fields(obj) if kind == "Pod" else obj)


def ignored_lines(ignored: Counter[tuple[str, str | None]], namespace: str) -> list[str]:
    """One line per kind plan does not read and per (kind, other namespace), sorted."""
    lines = []
    for (kind, where), count in sorted(ignored.items(), key=lambda i: (i[0][0], i[0][1] or "")):
        objects = "object" if count == 1 else "objects"
        if where is None:
            lines.append(f"ignored {count} {kind} {objects}: plan does not read this kind")
        else:
            lines.append(
                f"ignored {count} {kind} {objects} in namespace {where}: "
                f"not the operator namespace ({namespace}; --namespace)"
            )
    return lines


def _cannot_read(name: str, exc: OSError | UnicodeDecodeError) -> UsageError:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return UsageError(f"cannot read {name}: {reason}")


def _keep(item: Any) -> Any:
    """What plan keeps of a List item: the fields planning reads of a Pod, else all of it."""
    return pod_fields(item) if isinstance(item, dict) and item.get("kind") == "Pod" else item


# What a streamed YAML List converts of a member of a kind (the rest is only parsed): of a
# Pod, the parts pod_fields keeps (tests/test_plan_stream.py checks they are enough).
_POD_SHAPE: Shape = {
    "apiVersion": ALL,
    "kind": ALL,
    "metadata": dict.fromkeys(("name", "namespace", "labels", "deletionTimestamp"), ALL),
    "spec": {"nodeName": ALL},
    "status": {"conditions": [{"type": ALL, "status": ALL}]},
}


# What a streamed JSON List decodes of a Pod with msgspec (the rest is only parsed): the
# same parts, as typed structs; every value is Any, so it is kept as it is, wrong types
# included (a part of another type than the struct's is read the exact way).
class _Metadata(msgspec.Struct):
    name: Any = UNSET
    namespace: Any = UNSET
    labels: Any = UNSET
    deletionTimestamp: Any = UNSET


class _Condition(msgspec.Struct):
    type: Any = UNSET
    status: Any = UNSET


class _Spec(msgspec.Struct):
    nodeName: Any = UNSET


class _Status(msgspec.Struct):
    conditions: list[_Condition] | UnsetType = UNSET


class _Pod(msgspec.Struct):
    apiVersion: Any = UNSET
    kind: Any = UNSET
    metadata: _Metadata | UnsetType = UNSET
    spec: _Spec | UnsetType = UNSET
    status: _Status | UnsetType = UNSET


_POD_DECODER = msgspec.json.Decoder(_Pod)
_POD_START = re.compile(
    r'\{[ \t\n\r]*"apiVersion"[ \t\n\r]*:[ \t\n\r]*"[^"\\]{0,200}"[ \t\n\r]*,'
    r'[ \t\n\r]*"kind"[ \t\n\r]*:[ \t\n\r]*"Pod"'
)
# Both readers refuse nesting near 1,000 levels (each its own count): text with fewer
# opening brackets nests less, so both read it. Realistic pods have 550-800.
_MAX_OPENINGS = 900
# Runs of 100 digits: the exact reader refuses integers of more than 100 characters,
# anywhere; msgspec reads them. One pass over the text finds both: digits become "0",
# opening brackets "[", the rest " ".
_MARKS = bytes(
    ord("0") if chr(c) in "0123456789" else ord("[") if chr(c) in "{[" else ord(" ")
    for c in range(256)
)
_LONG_RUN = b"0" * 100


def _fast_pod(text: str) -> Any:
    """:func:`_keep` of a Pod's JSON text, decoded with msgspec; None where the exact
    reader could read it differently: nesting or integers near its bounds, JSON msgspec
    refuses (NaN, lone surrogates, syntax, a wrong cut), a kept part of another type than
    its struct's, or not a Pod."""
    data = text.encode("utf-8")  # the Text of a stream holds no surrogates
    marks = data.translate(_MARKS)
    if marks.count(b"[") > _MAX_OPENINGS or _LONG_RUN in marks:
        return None
    try:
        pod = _POD_DECODER.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return None
    if pod.kind != "Pod":
        return None
    # Plain dicts and lists in the structs' order (pod_fields's), unset fields left out.
    return msgspec.to_builtins(pod)


_FAST_POD = Fast(_POD_START, _fast_pod)


def _shape(kind: Any) -> Shape:
    return _POD_SHAPE if kind == "Pod" else ALL


def _binary(name: str) -> AbstractContextManager[BinaryIO]:
    """The bytes of a file, or of stdin for ``-``: one way in for both."""
    if name == "-":
        return nullcontext(sys.stdin.buffer)
    return Path(name).open("rb")


def _documents(name: str) -> list[Any]:
    """The documents of a file or stdin, read as a stream: one JSON object
    (``kubectl get -o json``) its items one at a time, a YAML List (``kubectl get -o
    yaml``) its members one at a time, any other text whole (at most MAX_BYTES)."""
    with _binary(name) as stream:
        text = Text(stream.read)
        if not text.peek().lstrip().startswith("{"):
            return load_yaml_stream(text, _keep, _shape)
        try:
            return [load_json_stream(text.read, _keep, _FAST_POD)]
        except NotJSON as exc:
            if not text.restart():
                raise InputError(
                    f"{exc} (a file over {size_text(MAX_BYTES)} must be one JSON object)"
                ) from None
            return load_documents(text.whole(), keep=_keep)  # perhaps a YAML flow mapping


def _objects(name: str) -> Iterator[K8sObject]:
    # Bounded parsing and the well-formed gate: the planner sees JSON values only.
    try:
        documents = _documents(name)
    except InputError as exc:
        raise UsageError(f"{name}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _cannot_read(name, exc) from exc
    for number, document in enumerate(documents, start=1):
        if document is None:
            continue
        yield from _flatten(name, number, document)


def _flatten(name: str, number: int, document: Any) -> Iterator[K8sObject]:
    where = f"{name}: document {number}"
    if not isinstance(document, dict):
        raise UsageError(f"{where} is not a mapping")
    kind = document.get("kind")
    if isinstance(kind, str) and kind.endswith("List") and "items" in document:
        items = document["items"] or []
        if not isinstance(items, list):
            raise UsageError(f"{where}: items is not a list")
        for item in items:
            if not isinstance(item, dict):
                raise UsageError(f"{where}: an item of {kind} is not a mapping")
            yield _checked(where, item)
        return
    yield _checked(where, document)


def _checked(where: str, obj: dict[str, Any]) -> K8sObject:
    kind = obj.get("kind")
    meta = obj.get("metadata")
    if not isinstance(kind, str) or not kind:
        raise UsageError(f"{where}: object without kind")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
        raise UsageError(f"{where}: {kind} without metadata.name")
    return obj
