"""``shared-svc plan`` on realistic pods (as the API server serves them, managedFields
included): JSON streamed item by item, a YAML List member by member (rapidyaml), other
YAML through libyaml's parser, the same plan."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared_svc.cli import main
from shared_svc.commands.plan import json_stream, load_world, manifests, plan_output, yaml_text
from shared_svc.reconcile.model import Settings, World
from shared_svc.reconcile.planner import plan
from tests.realistic import pod_list


def command(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, str, str]:
    code = main(["plan", "-f", str(path), "-o", "json"])
    out, err = capsys.readouterr()
    return code, out, err


def whole_objects_plan(listing: dict[str, Any]) -> str:
    """The plan of the full objects, handed straight to the planner (no reader, no projection)."""
    by_kind: dict[str, list[Any]] = {}
    for item in listing["items"]:
        by_kind.setdefault(item["kind"], []).append(item)
    world = World(
        cluster_policies=tuple(by_kind.get("ClusterPolicy", ())),
        gpu_clusters=tuple(by_kind.get("GPUCluster", ())),
        daemonsets=tuple(by_kind.get("DaemonSet", ())),
        pods=tuple(by_kind.get("Pod", ())),
    )
    settings = Settings(namespace="gpu-operator", service_monitor_served=True)
    return json.dumps(plan_output(plan(world, settings)), indent=2, sort_keys=True) + "\n"


@pytest.fixture(scope="module")
def listing() -> dict[str, Any]:
    return pod_list(40)


def test_json_yaml_and_the_whole_objects_give_the_same_plan(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    listing: dict[str, Any],
) -> None:
    expected = whole_objects_plan(listing)
    assert "SelectorMigrationPending" in expected  # the stragglers make it a real plan
    as_json = tmp_path / "pods.json"
    as_json.write_text(json.dumps(listing, indent=4))
    as_yaml = tmp_path / "pods.yaml"
    as_yaml.write_text(yaml.safe_dump(listing))
    assert command(capsys, as_json) == (0, expected, "")
    assert command(capsys, as_yaml) == (0, expected, "")  # a List: rapidyaml, member by member
    # Read whole the bounded way (YAML that is no kubectl List, a member with an anchor):
    as_yaml.write_text("---\n" + yaml.safe_dump(listing) + "---\n")
    assert yaml_text._NoAliasLoader is not None  # libyaml is there
    assert command(capsys, as_yaml) == (0, expected, "")  # libyaml parses and composes
    monkeypatch.setattr(yaml_text, "_NoAliasLoader", None)  # as with anchors in the text:
    assert command(capsys, as_yaml) == (0, expected, "")  # libyaml parses, the bounds compose
    monkeypatch.setattr(yaml_text, "_FastLoader", None)  # PyYAML alone
    assert command(capsys, as_yaml) == (0, expected, "")


ODD = """
a: [1, 0x1f, 0o17, 1_000, 2.5, .5, -.inf0, ~, null, yes, on, "2024-01-01", 2024-01-01]
b:
  q: 'x''y'
  k: |
    two
    lines
  f: >-
    folded
    text
  "quoted key": "tab\\there \\u00e9"
m: {<<: {a: 1, b: 1}, b: 2}
e: {=: 1}
"""


@pytest.mark.parametrize("anchors", [False, True])
def test_libyaml_and_pyyaml_read_the_same_documents(listing: dict[str, Any], anchors: bool) -> None:
    text = yaml.safe_dump_all([listing, None]) + "---" + ODD
    if anchors:  # an anchor somewhere: libyaml parses, the bounded composer composes
        text += "---\nx: &a [1]\ny: *a\n"
    loaders = {"libyaml": yaml_text._NoAliasLoader, "bounded": yaml_text._FastLoader}
    assert all(loaders.values())
    results = [yaml_text.load_documents(text)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(yaml_text, "_NoAliasLoader", None)
        results.append(yaml_text.load_documents(text))
        patch.setattr(yaml_text, "_FastLoader", None)
        results.append(yaml_text.load_documents(text))
    assert results[0] == results[1] == results[2]
    assert results[0][0] == listing


@pytest.mark.parametrize(
    "text",
    ["? [a, list]\n: 1\n", "a: !!binary aGk=\n", "a: !custom 1\n", "a: 1\na: [b\n"],
)
def test_the_three_yaml_readers_refuse_alike(text: str) -> None:
    messages = []
    with pytest.MonkeyPatch.context() as patch:
        for loader in ("_NoAliasLoader", "_FastLoader", None):
            with pytest.raises(manifests.InputError) as refused:
                yaml_text.load_documents(text)
            messages.append(str(refused.value))
            if loader:
                patch.setattr(yaml_text, loader, None)
    if "[b" in text:  # a syntax error: libyaml words it its own way, at the same line
        assert all(m.startswith("invalid YAML at line 3: ") for m in messages), messages
    else:
        assert messages[0] == messages[1] == messages[2]


def test_json_split_anywhere_across_chunks_reads_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    small = pod_list(4)
    small["extra"] = [12345678901234, -1.5e-7, 'a"b\\u00e9\\n', {"x": [None, False]}]
    path = tmp_path / "pods.json"
    path.write_text(json.dumps(small, indent=1))
    expected = command(capsys, path)
    text = path.read_text()
    for chunk in (1, 2, 7, 64):
        monkeypatch.setattr(json_stream, "_CHUNK", chunk)
        assert command(capsys, path) == expected
        # Numbers, escapes and nesting cut at any point: the same values as json.loads.
        assert json_stream.load_json_stream(io.StringIO(text).read, lambda item: item) == small
    assert expected[0] == 0


def test_pods_are_held_as_the_fields_planning_reads(tmp_path: Path) -> None:
    listing = pod_list(4)
    path = tmp_path / "pods.json"
    path.write_text(json.dumps(listing))
    world = load_world([str(path)], "gpu-operator")
    [pod] = [p for p in world.pods if p["metadata"]["name"] == "nvidia-dcgm-00000"]
    assert sorted(pod["metadata"]) == ["labels", "name", "namespace"]
    assert pod["spec"] == {"nodeName": "node-00000"}
    assert {"type": "Ready", "status": "True"} in pod["status"]["conditions"]


def test_a_json_list_over_the_yaml_size_limit_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    listing = pod_list(8)
    path = tmp_path / "pods.json"
    path.write_text(json.dumps(listing))
    monkeypatch.setattr(
        "shared_svc.commands.plan.manifests.MAX_BYTES", 50_000
    )  # a pod is at most 22 KiB
    code, out, err = command(capsys, path)
    assert (code, out, err) == (0, whole_objects_plan(listing), "")
    # Not JSON and over the limit: one line, never read as YAML.
    path.write_text(json.dumps(listing)[:-1] + ",}")
    code, out, err = command(capsys, path)
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert "invalid JSON at line 1" in err and "must be one JSON object" in err


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("NaN", "NaN is not a JSON number"),
        ("1" * 200, "an integer of 200 digits"),
        ("1e999", "items[3].metadata.labels.bad: inf is not a JSON number"),
        ('"\\ud800"', "items[3].metadata.labels.bad: a string that is not valid Unicode"),
        ("[" * 5000 + "]" * 5000, "nested deeper than 100 levels"),
    ],
)
def test_a_hostile_value_in_a_streamed_pod_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str, message: str
) -> None:
    listing = pod_list(4)
    listing["items"][3]["metadata"]["labels"]["bad"] = "BAD"
    path = tmp_path / "pods.json"
    path.write_text(json.dumps(listing).replace('"BAD"', bad))
    code, out, err = command(capsys, path)
    assert (code, out) == (2, ""), err
    assert err.startswith(f"shared-svc: error: {path}: ") and err.count("\n") == 1, err
    assert message in err, err
