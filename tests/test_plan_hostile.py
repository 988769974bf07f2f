"""``shared-svc plan`` on hostile files: one line on stderr and exit 2, or a plan; never a traceback.

Each case found by the adversarial runs (issue 10, item 14) is here; the property in
proptests/test_plan_hostile_props.py covers a wrong type in any one field.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

import shared_svc
from shared_svc.cli import main
from shared_svc.commands.plan import manifests
from shared_svc.commands.plan.manifests import InputError, well_formed
from shared_svc.commands.plan.yaml_text import load_documents
from shared_svc.reconcile.model import Settings, World
from shared_svc.reconcile.planner import plan
from tests.worlds import cluster_policy, service


def run(capsys: pytest.CaptureFixture[str], path: Path, *args: str) -> tuple[int, str, str]:
    code = main(["plan", "-f", str(path), *args])
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys: pytest.CaptureFixture[str], path: Path, fragment: str) -> str:
    code, out, err = run(capsys, path)
    assert (code, out) == (2, ""), err
    assert err.startswith(f"shared-svc: error: {path}: ") and err.count("\n") == 1, err
    assert fragment in err, err
    return err


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def cp_yaml(name: str, created: str, relabelings: str) -> str:
    return f"""apiVersion: nvidia.com/v1
kind: ClusterPolicy
metadata: {{name: {name}, uid: u-{name}, creationTimestamp: "{created}"}}
spec:
  dcgmExporter:
    serviceMonitor:
      enabled: true
      relabelings: {relabelings}
"""


GC_YAML = """apiVersion: nvidia.com/v1alpha1
kind: GPUCluster
metadata: {{name: gpu-cluster, uid: u-gc, creationTimestamp: "2025-01-02T00:00:00Z"}}
spec:
  dcgm: {{enabled: true}}
  dcgmExporter:
    enabled: true
    serviceMonitor:
      enabled: true
      relabelings: {relabelings}
"""


def conflicting(relabelings: str) -> str:
    """A ClusterPolicy and the GPUCluster that disagree on the ServiceMonitor's relabelings."""
    return (
        cp_yaml("cluster-policy", "2025-01-01T00:00:00Z", "[{action: drop}]")
        + "---\n"
        + GC_YAML.format(relabelings=relabelings)
    )


# ---------------------------------------------------------------- depth, aliases, size


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_5000_levels_of_nesting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    deep = "[" * 5000 + "]" * 5000
    text = (
        '{"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy", "metadata": {"name": "a"}, '
        f'"spec": {{"x": {deep}}}}}'
    )
    if suffix == ".yaml":
        text = f"kind: ClusterPolicy\nmetadata: {{name: a}}\nspec:\n  x: {deep}\n"
    refused(capsys, write(tmp_path, f"deep{suffix}", text), "nested deeper than 100 levels")


def test_nesting_up_to_the_bound_is_accepted() -> None:
    ok = json.loads("[" * manifests.MAX_DEPTH + "]" * manifests.MAX_DEPTH)
    assert well_formed(ok) == ok
    with pytest.raises(InputError, match="nested deeper than 100 levels"):
        well_formed([ok])
    text = "a: " + "[" * (manifests.MAX_DEPTH - 1) + "]" * (manifests.MAX_DEPTH - 1)
    assert load_documents(text)
    with pytest.raises(InputError, match="nested deeper"):
        load_documents("a: " + "[" * manifests.MAX_DEPTH + "]" * manifests.MAX_DEPTH)


def test_the_nesting_limit_is_written_once_for_manifests_and_caches() -> None:
    """``plan -f`` and the caches bound one depth: ``k8s.limits.MAX_DEPTH``, assigned
    nowhere else (a second literal could drift from it)."""
    package = Path(shared_svc.__file__).parent
    assigned = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and any(isinstance(t, ast.Name) and t.id == "MAX_DEPTH" for t in node.targets)
    )
    assert assigned == ["k8s/limits.py"]


def test_a_recursive_alias(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = conflicting("&loop [{action: keep, regex: *loop}]")
    refused(capsys, write(tmp_path, "loop.yaml", text), "recursive YAML alias *loop at line 19")


def test_a_billion_laughs_in_relabelings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 9**10 "lol"s once expanded: refused while composing, long before anything expands it.
    laughs = "  x-laughs:\n    a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10)
    )
    text = conflicting("[{action: keep, regex: *a9}]").replace(
        "spec:\n  dcgm: {enabled: true}\n", "spec:\n" + laughs + "  dcgm: {enabled: true}\n"
    )
    assert "*a9" in text and "&a9" in text
    refused(capsys, write(tmp_path, "laughs.yaml", text), "YAML aliases expand to more than")


def test_aliases_within_the_budget_still_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = GC_YAML.format(relabelings="*r").replace(
        "spec:\n", "spec:\n  x-defaults: &r [{action: drop}]\n"
    )
    code, out, err = run(capsys, write(tmp_path, "alias.yaml", text), "-o", "json")
    assert (code, err) == (0, "")
    monitors = [o for o in json.loads(out)["objects"] if o["kind"] == "ServiceMonitor"]
    # The GPUCluster's two: the canonical one and its own -dra one (section 7).
    assert len(monitors) == 2
    for monitor in monitors:
        assert monitor["spec"]["endpoints"][0]["relabelings"] == [{"action": "drop"}]


def test_a_file_over_the_size_limit_is_not_read_past_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("shared_svc.commands.plan.manifests.MAX_BYTES", 1000)
    big = write(tmp_path, "big.yaml", "# " + "x" * 2000 + "\n")
    code, out, err = run(capsys, big)
    assert (code, out) == (2, "") and "larger than" in err and err.count("\n") == 1


# ---------------------------------------------------------------- types


def test_mixed_key_types(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "kind: ClusterPolicy\nmetadata: {name: a}\nspec: {1: a, b: c}\n"
    refused(
        capsys, write(tmp_path, "keys.yaml", text), "document 1: spec: the key 1 is not a string"
    )


def test_non_string_selector_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (
        cp_yaml("cluster-policy", "2025-01-01T00:00:00Z", "[]")
        + "---\nkind: Service\nmetadata: {name: nvidia-dcgm, namespace: gpu-operator, "
        "labels: {app.kubernetes.io/managed-by: shared-svc}}\nspec: {selector: {1: a, b: c}}\n"
    )
    refused(
        capsys, write(tmp_path, "sel.yaml", text), "document 2: spec.selector: the key 1 is not"
    )


def test_odd_owner_reference_key_types(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (
        cp_yaml("cluster-policy", "2025-01-01T00:00:00Z", "[]")
        + "---\nkind: Service\nmetadata:\n  name: nvidia-dcgm\n  namespace: gpu-operator\n"
        "  ownerReferences: [{kind: Foo, name: x, uid: u, 3.5: y, null: z}]\nspec: {}\n"
    )
    refused(
        capsys,
        write(tmp_path, "owners.yaml", text),
        "metadata.ownerReferences[0]: the key 3.5 is not a string",
    )


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_5000_digit_integer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    digits = "9" * 5000
    text = f'{{"kind": "ClusterPolicy", "metadata": {{"name": "a"}}, "spec": {{"x": {digits}}}}}'
    if suffix == ".yaml":
        text = f"kind: ClusterPolicy\nmetadata: {{name: a}}\nspec: {{x: {digits}}}\n"
    refused(capsys, write(tmp_path, f"int{suffix}", text), "an integer of 5000 digits")


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("9223372036854775808", "an integer out of range (more than 64 bits)"),
        ("NaN", "NaN is not a JSON number"),
        ("-Infinity", "-Infinity is not a JSON number"),
        ("1e999", "inf is not a JSON number"),
        ('"\\ud800"', "a string that is not valid Unicode"),
    ],
)
def test_json_numbers_and_strings_outside_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, fragment: str
) -> None:
    text = f'{{"kind": "ClusterPolicy", "metadata": {{"name": "a"}}, "spec": {{"x": {value}}}}}'
    refused(capsys, write(tmp_path, "n.json", text), fragment)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("!!binary aGVsbG8=", "!!binary is not a JSON value at line 19"),
        ("!!set {a, b}", "!!set is not a JSON value at line 19"),
        ("!!omap [{a: 1}]", "!!omap is not a JSON value at line 19"),
        (".nan", "spec.dcgmExporter.serviceMonitor.relabelings[0].regex: nan is not a JSON"),
    ],
)
def test_yaml_values_that_are_no_json_in_conflicting_relabelings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, fragment: str
) -> None:
    text = conflicting(f"[{{action: keep, regex: {value}}}]")
    refused(capsys, write(tmp_path, "tags.yaml", text), fragment)


@pytest.mark.parametrize("output", ["yaml", "json"])
def test_yaml_dates_in_conflicting_relabelings_are_their_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], output: str
) -> None:
    text = conflicting("[{action: keep, regex: 2024-01-01, replacement: 2024-01-01T10:00:00Z}]")
    code, out, err = run(capsys, write(tmp_path, "dates.yaml", text), "-o", output)
    assert (code, err) == (0, "")
    data = json.loads(out) if output == "json" else yaml.safe_load(out)
    [conflict] = data["conflicts"]
    assert conflict["losers"][0]["value"] == [
        {"action": "keep", "regex": "2024-01-01", "replacement": "2024-01-01T10:00:00Z"}
    ]


def test_an_unquoted_creation_timestamp_still_orders_the_crs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The GPUCluster is older; written unquoted, the timestamps are their text, as in kubectl.
    text = (
        conflicting("[{action: keep}]")
        .replace('"2025-01-02T00:00:00Z"', "2024-12-31T00:00:00Z")
        .replace('"2025-01-01T00:00:00Z"', "2025-01-01T00:00:00Z")
    )
    code, out, _ = run(capsys, write(tmp_path, "ts.yaml", text), "-o", "json")
    assert code == 0
    [conflict] = json.loads(out)["conflicts"]
    assert conflict["winner"]["kind"] == "GPUCluster"


# ---------------------------------------------------------------- wrong JSON types the core meets


def test_a_port_that_is_a_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (
        cp_yaml("cluster-policy", "2025-01-01T00:00:00Z", "[]")
        + "---\nkind: Service\nmetadata: {name: nvidia-dcgm, namespace: gpu-operator}\n"
        "spec: {ports: [{port: [a]}]}\n"
    )
    code, out, err = run(capsys, write(tmp_path, "port.yaml", text), "-o", "json")
    assert (code, err) == (0, "")
    [update] = [a for a in json.loads(out)["actions"] if a["action"] == "update"]
    assert (update["name"], update["reason"]) == ("nvidia-dcgm", "ServiceAdopted")
    assert "spec.ports" in update["changedFields"]


@pytest.mark.parametrize("bad", [[9400], {"a": 1}, "9400", None, True])
def test_a_live_port_or_protocol_of_the_wrong_type_is_a_changed_port(bad: Any) -> None:
    for field in ("port", "protocol"):
        live = service("nvidia-dcgm", managed=True)
        live["spec"]["ports"][0][field] = bad
        result = plan(World(cluster_policies=(cluster_policy(),), services=(live,)), Settings())
        [action] = [a for a in result.actions if a.name == "nvidia-dcgm"]
        assert action.action == "update" and "spec.ports" in action.changed_fields


def test_the_gate_returns_a_tree_of_json_values_without_shared_parts() -> None:
    [doc] = load_documents("a: &x [1, {b: 2}]\nc: *x\n")
    assert doc == {"a": [1, {"b": 2}], "c": [1, {"b": 2}]}
    assert doc["a"] is not doc["c"] and doc["a"][1] is not doc["c"][1]
    api = {"metadata": {"name": "n", "labels": {"a": "b"}}, "spec": {"n": 1.5, "x": None}}
    assert well_formed(api) == api and well_formed(api) is not api
