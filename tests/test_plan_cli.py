"""``shared-svc plan``: input handling, output contract, exit codes."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared_svc.cli import main
from tests.realistic import pod_list
from tests.test_plan_scale import whole_objects_plan

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
CP = {
    "apiVersion": "nvidia.com/v1",
    "kind": "ClusterPolicy",
    "metadata": {
        "name": "cluster-policy",
        "uid": "u1",
        "creationTimestamp": "2025-01-01T00:00:00Z",
    },
    "spec": {},
}


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_json_output_has_exactly_the_contract_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "-f", write(tmp_path, "cp.json", json.dumps(CP)), "-o", "json")
    assert code == 0
    data = json.loads(out)
    assert sorted(data) == ["actions", "conflicts", "errors", "objects", "pending"]
    assert data["actions"][0] == {
        "action": "create",
        "kind": "Service",
        "name": "nvidia-dcgm",
        "reason": "ServiceCreated",
    }
    assert [o["metadata"]["name"] for o in data["objects"]] == [
        "nvidia-dcgm",
        "nvidia-dcgm-exporter",
    ]


def test_yaml_is_the_default_and_lists_are_flattened(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = {"apiVersion": "v1", "kind": "ClusterPolicyList", "items": [CP]}
    code, out, _ = run(capsys, "-f", write(tmp_path, "l.yaml", yaml.safe_dump(doc)))
    assert code == 0
    assert len(yaml.safe_load(out)["objects"]) == 2


def test_stdin_and_several_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gc = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "GPUCluster",
        "metadata": {"name": "gpu-cluster", "uid": "u2"},
        "spec": {"dcgm": {"enabled": True}},
    }
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(yaml.safe_dump(gc).encode())))
    code, out, _ = run(
        capsys, "-f", "-", "-f", write(tmp_path, "cp.yaml", yaml.safe_dump(CP)), "-o", "json"
    )
    assert code == 0
    names = [o["metadata"]["name"] for o in json.loads(out)["objects"]]
    assert names == ["nvidia-dcgm", "nvidia-dcgm-dra", "nvidia-dcgm-exporter"]


def _svc(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "nvidia-dcgm-dra",
            "namespace": namespace,
            "uid": "s1",
            "resourceVersion": "3",
            "labels": {"app.kubernetes.io/managed-by": "shared-svc"},
        },
        "spec": {"selector": {"app": "nvidia-dcgm-dra"}},
    }


def test_namespace_filter_and_delete_preconditions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path,
        "s.yaml",
        yaml.safe_dump_all([_svc("other"), {"kind": "ConfigMap", "metadata": {"name": "x"}}]),
    )
    assert json.loads(run(capsys, "-f", path, "-o", "json")[1])["actions"] == []
    _, out, _ = run(capsys, "-f", path, "--namespace", "other", "-o", "json")
    assert json.loads(out)["actions"] == [
        {
            "action": "delete",
            "kind": "Service",
            "name": "nvidia-dcgm-dra",
            "reason": "ServiceDeleted",
            "preconditions": {"uid": "s1", "resourceVersion": "3"},
        }
    ]


def test_ignored_kinds_and_namespaces_are_one_warning_line_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    configmap = {"kind": "ConfigMap", "metadata": {"name": "x", "namespace": "gpu-operator"}}
    other_pod = {"kind": "Pod", "metadata": {"name": "p", "namespace": "kube-system"}}
    docs = [CP, _svc("other"), _svc("other"), _svc("gpu-operator"), configmap, configmap]
    listed = {"kind": "List", "items": [other_pod, {"kind": "Secret", "metadata": {"name": "s"}}]}
    path = write(tmp_path, "mixed.yaml", yaml.safe_dump_all([*docs, listed]))
    code, out, err = run(capsys, "-f", path, "-o", "json")
    assert code == 0 and json.loads(out)["objects"]
    assert err.splitlines() == [
        "shared-svc plan: warning: ignored 2 ConfigMap objects: plan does not read this kind",
        "shared-svc plan: warning: ignored 1 Pod object in namespace kube-system: not the "
        "operator namespace (gpu-operator; --namespace)",
        "shared-svc plan: warning: ignored 1 Secret object: plan does not read this kind",
        "shared-svc plan: warning: ignored 2 Service objects in namespace other: not the "
        "operator namespace (gpu-operator; --namespace)",
    ]
    # everything read: no warning
    assert run(capsys, "-f", write(tmp_path, "cp.yaml", yaml.safe_dump(CP)))[2] == ""


def test_an_update_lists_the_fields_it_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fresh = yaml.safe_load(run(capsys, "-f", write(tmp_path, "cp.yaml", yaml.safe_dump(CP)))[1])
    ours = next(o for o in fresh["objects"] if o["metadata"]["name"] == "nvidia-dcgm-exporter")
    drifted = json.loads(json.dumps(ours))
    drifted["metadata"]["uid"] = "s9"
    drifted["spec"]["ports"][0]["port"] = 9999
    path = write(tmp_path, "drift.yaml", yaml.safe_dump_all([CP, drifted]))
    for fmt, load in (("json", json.loads), ("yaml", yaml.safe_load)):
        actions = load(run(capsys, "-f", path, "-o", fmt)[1])["actions"]
        [update] = [a for a in actions if a["action"] == "update"]
        assert update == {
            "action": "update",
            "kind": "Service",
            "name": "nvidia-dcgm-exporter",
            "reason": "ConfigChanged",
            "changedFields": ["spec.ports"],
        }
        assert all("changedFields" not in a for a in actions if a["action"] != "update")


def test_flags_no_adopt_and_selector_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    live = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "nvidia-dcgm", "namespace": "gpu-operator"},
        "spec": {},
    }
    path = write(tmp_path, "a.yaml", yaml.safe_dump_all([CP, live]))
    data = json.loads(
        run(capsys, "-f", path, "--no-adopt", "--selector-mode", "app", "-o", "json")[1]
    )
    assert data["pending"][0]["reason"] == "ServiceNotAdopted"
    assert {
        "action": "skip",
        "kind": "Service",
        "name": "nvidia-dcgm",
        "reason": "ServiceNotAdopted",
    } in data["actions"]


def test_invalid_spec_is_an_error_entry_not_an_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "bad.yaml", yaml.safe_dump({**CP, "spec": 5}))
    code, out, _ = run(capsys, "-f", path, "-o", "json")
    assert code == 0
    [error] = json.loads(out)["errors"]
    assert (error["kind"], error["name"], error["reason"]) == (
        "ClusterPolicy",
        "cluster-policy",
        "InvalidSpec",
    )


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("a: [1, 2", "invalid YAML"),
        ("- 1\n- 2\n", "is not a mapping"),
        ("kind: Service\nmetadata: {}\n", "without metadata.name"),
        ("metadata: {name: x}\n", "without kind"),
        ("kind: List\nitems: [5]\n", "not a mapping"),
    ],
)
def test_unreadable_input_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, fragment: str
) -> None:
    code, out, err = run(capsys, "-f", write(tmp_path, "x.yaml", text))
    assert code == 2 and out == ""
    assert fragment in err and err.count("\n") == 1


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "-f", str(tmp_path / "nope.yaml"))
    assert code == 2 and "cannot read" in err


def test_output_is_deterministic_whatever_the_document_order(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    docs = yaml.safe_load((EXAMPLES / "migration-gate-closed.yaml").read_text())["items"]
    forward = write(tmp_path, "f.yaml", yaml.safe_dump_all(docs))
    backward = write(tmp_path, "b.yaml", yaml.safe_dump_all(list(reversed(docs))))
    assert run(capsys, "-f", forward)[1] == run(capsys, "-f", backward)[1]


def test_json_is_read_as_json_and_a_flow_mapping_as_yaml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Tab-indented JSON (jq --tab) is no YAML: it is read with the JSON parser.
    tabs = write(tmp_path, "tabs.json", json.dumps(CP, indent="\t"))
    flow = write(tmp_path, "flow.yaml", "{kind: ClusterPolicy, metadata: {name: cluster-policy}}\n")
    for path in (tabs, flow):
        code, out, err = run(capsys, "-f", path, "-o", "json")
        assert (code, err) == (0, "")
        assert len(json.loads(out)["objects"]) == 2


def test_stdin_is_bounded_as_a_file_is(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("shared_svc.commands.plan.manifests.MAX_BYTES", 100)
    text = yaml.safe_dump(CP) + "#" * 200
    path = write(tmp_path, "big.yaml", text)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    code, out, err = run(capsys, "-f", "-")
    assert (code, out) == (2, "")
    assert err.startswith("shared-svc: error: -: larger than 100 bytes") and err.count("\n") == 1
    assert err.replace("-: ", f"{path}: ", 1) == run(capsys, "-f", path)[2]


def plan_process(
    *args: str, stdin: bytes, max_bytes: int | None = None
) -> subprocess.CompletedProcess[bytes]:
    """``shared-svc plan ARGS`` as its own process, ``stdin`` its standard input (the
    whole-file bound ``manifests.MAX_BYTES`` lowered to ``max_bytes``)."""
    code = (
        "import sys, shared_svc.commands.plan.manifests as m\n"
        f"m.MAX_BYTES = {max_bytes or 'm.MAX_BYTES'}\n"
        "from shared_svc.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "plan", *args],
        input=stdin,
        capture_output=True,
        timeout=120,
        check=False,
    )


def test_non_utf8_bytes_on_stdin_are_one_line_as_from_a_file(tmp_path: Path) -> None:
    data = yaml.safe_dump(CP).encode() + b"# \xff\xfe not UTF-8\n"
    path = tmp_path / "bad.yaml"
    path.write_bytes(data)
    for source in ("-", str(path)):
        done = plan_process("-f", source, stdin=data)
        err = done.stderr.decode()
        assert (done.returncode, done.stdout) == (2, b""), err
        assert err.startswith(f"shared-svc: error: cannot read {source}: 'utf-8' codec can't")
        assert err.count("\n") == 1, err


def test_a_yaml_list_on_stdin_is_streamed_as_from_a_file(tmp_path: Path) -> None:
    """A ``kubectl get -o yaml`` List of realistic pods past the whole-file bound: read
    from stdin as from a file, one member at a time, the same plan."""
    listing = pod_list(12)
    data = yaml.dump(listing, Dumper=yaml.CSafeDumper).encode()
    path = tmp_path / "pods.yaml"
    path.write_bytes(data)
    for source in ("-", str(path)):
        done = plan_process("-f", source, "-o", "json", stdin=data, max_bytes=len(data) // 3)
        assert (done.returncode, done.stderr) == (0, b""), done.stderr
        assert json.loads(done.stdout) == json.loads(whole_objects_plan(listing))


@pytest.mark.parametrize("max_bytes", [None, 20])
def test_an_invalid_member_of_a_yaml_list_is_one_line_from_the_process(
    max_bytes: int | None,
) -> None:
    """rapidyaml, which parses the members, writes nothing of its own on stderr."""
    data = b"kind: List\nitems:\n- {a: 1}\n- {a: [b}\n- {b: 1}\n"
    done = plan_process("-f", "-", stdin=data, max_bytes=max_bytes)
    assert (done.returncode, done.stdout) == (2, b"")
    assert done.stderr.decode() == (
        "shared-svc: error: -: invalid YAML at line 4: did not find expected ',' or ']'\n"
    )
