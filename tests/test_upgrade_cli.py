"""``shared-svc upgrade prepare-daemonset`` and ``status`` against the real API server."""

from __future__ import annotations

import json

import pytest

from shared_svc import testenv
from shared_svc.cli import main
from shared_svc.kube.writer import MERGE_PATCH
from shared_svc.upgrade import examples as ex
from shared_svc.upgrade import record
from tests.kube import unique

pytestmark = pytest.mark.apiserver

KEY = "nvidia.com/gpu-driver-upgrade.parked"
RECORD = "shared-svc.nvidia.com/gpu-driver-upgrade-freed"
T0 = 1_700_000_000.0
ZONE = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
GPU = {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}


def _ok(result: tuple[int, object]) -> object:
    status, body = result
    assert status < 300, body
    return body


def _namespace(cp: testenv.ControlPlane) -> str:
    name = unique("upgcli")
    _ok(cp.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}}))
    return name


def _daemonset(cp: testenv.ControlPlane, ns: str, **kw: object) -> str:
    ds = ex.daemonset("exporter", namespace=ns, **kw)  # type: ignore[arg-type]
    for key in ("uid", "resourceVersion"):
        del ds["metadata"][key]
    _ok(cp.request("POST", f"/apis/apps/v1/namespaces/{ns}/daemonsets", ds))
    return f"{ns}/exporter"


def _terms(cp: testenv.ControlPlane, target: str) -> list[dict[str, object]]:
    ns, name = target.split("/")
    ds = _ok(cp.request("GET", f"/apis/apps/v1/namespaces/{ns}/daemonsets/{name}"))
    spec = ds["spec"]["template"]["spec"]  # type: ignore[index]
    return list(
        spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
    )


def test_prepare_daemonset_dry_run_then_write_then_nothing_to_do(
    control_plane: testenv.ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    target = _daemonset(control_plane, _namespace(control_plane), terms=[ZONE, GPU])
    kc = ["--kubeconfig", str(control_plane.kubeconfig)]

    assert main(["upgrade", "prepare-daemonset", target, "--dry-run", *kc]) == 0
    out = capsys.readouterr().out
    added = [line[1:].strip() for line in out.splitlines() if line.startswith("+ ")]
    assert added == [f"- key: {KEY}", "operator: DoesNotExist"] * 2  # in every ORed term
    assert "dry run" in out
    assert all(KEY not in str(t) for t in _terms(control_plane, target))  # nothing written

    assert main(["upgrade", "prepare-daemonset", target, *kc]) == 0
    terms = _terms(control_plane, target)
    assert len(terms) == 2
    assert all({"key": KEY, "operator": "DoesNotExist"} in t["matchExpressions"] for t in terms)  # type: ignore[operator]
    capsys.readouterr()

    assert main(["upgrade", "prepare-daemonset", target, *kc]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert _terms(control_plane, target) == terms


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no-slash"], "expected NAMESPACE/NAME"),
        (["Bad/Name"], "expected NAMESPACE/NAME"),
        (["default/does-not-exist"], "not found"),
        (["gpu-operator/nvidia-driver-daemonset"], "operator namespace"),
    ],
)
def test_prepare_daemonset_bad_input_is_one_line_exit_2(
    control_plane: testenv.ControlPlane,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    code = main(
        ["upgrade", "prepare-daemonset", *args, "--kubeconfig", str(control_plane.kubeconfig)]
    )
    err = capsys.readouterr().err
    assert (
        code == 2
        and message in err
        and len(err.strip().splitlines()) == 1
        and "Traceback" not in err
    )


def test_prepare_refuses_operator_operands(
    control_plane: testenv.ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    target = _daemonset(
        control_plane,
        _namespace(control_plane),
        node_selector={"nvidia.com/gpu.deploy.dcgm": "true"},
    )
    assert (
        main(
            ["upgrade", "prepare-daemonset", target, "--kubeconfig", str(control_plane.kubeconfig)]
        )
        == 2
    )
    assert "operand" in capsys.readouterr().err


def test_status_lists_upgrading_nodes(
    control_plane: testenv.ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    ns = _namespace(control_plane)
    node = unique("status-node")
    body = ex.node(node, state="cordon-required")
    for key in ("uid", "resourceVersion"):
        del body["metadata"][key]
    _ok(control_plane.request("POST", "/api/v1/nodes", body))
    pod = ex.declared_pod("triton", namespace=ns, node_name=node)
    for key in ("uid",):
        del pod["metadata"][key]
    uid = _ok(control_plane.request("POST", f"/api/v1/namespaces/{ns}/pods", pod))["metadata"][
        "uid"
    ]  # type: ignore[index]
    try:
        assert main(["upgrade", "status", "--kubeconfig", str(control_plane.kubeconfig)]) == 0
        out = capsys.readouterr().out
        assert f"{node}: cordon-required -> freeing" in out and "nothing recorded yet" in out
        # What the service records (it asked triton to leave) is what status shows.
        rec = record.Record.new(T0, parked_label=True).with_pod(
            record.FreedPod(ns, "triton", uid, first_attempt=T0)
        )
        annotations = {RECORD: record.encode(rec)}
        patch = {"metadata": {"labels": {KEY: "true"}, "annotations": annotations}}
        _ok(
            control_plane.request("PATCH", f"/api/v1/nodes/{node}", patch, content_type=MERGE_PATCH)
        )
        assert main(["upgrade", "status", "--kubeconfig", str(control_plane.kubeconfig)]) == 0
        out = capsys.readouterr().out
        assert f"{node}: cordon-required -> freeing" in out
        assert f"still on the node: {ns}/triton" in out
        assert f"eviction refused (retried until the timeout): {ns}/triton" in out
    finally:
        control_plane.request("DELETE", f"/api/v1/nodes/{node}")


def _node(cp: testenv.ControlPlane, state: str | None, **kw: object) -> str:
    name = unique("status-node")
    body = ex.node(name, state=state, **kw)  # type: ignore[arg-type]
    for key in ("uid", "resourceVersion"):
        del body["metadata"][key]
    _ok(cp.request("POST", "/api/v1/nodes", body))
    return name


def test_status_lists_only_nodes_upgrading_or_still_parked(
    control_plane: testenv.ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = record.encode(record.Record.new(T0, parked_label=True))
    shown = {
        _node(control_plane, "cordon-required"): "cordon-required",
        _node(control_plane, "validation-required"): "validation-required",
        _node(control_plane, None, parked=True): None,  # still parked: the label vanished
        _node(control_plane, "upgrade-required", annotations={RECORD: rec}): "upgrade-required",
    }
    idle = [_node(control_plane, "upgrade-done"), _node(control_plane, "upgrade-required")]
    try:
        kc = ["--kubeconfig", str(control_plane.kubeconfig)]
        assert main(["upgrade", "status", "-o", "json", *kc]) == 0
        listed = {s["node"]: s["state"] for s in json.loads(capsys.readouterr().out)}
        assert set(shown) <= set(listed)
        assert {n: listed[n] for n in shown} == shown
        assert not set(idle) & set(listed)
        assert main(["upgrade", "status", *kc]) == 0
        out = capsys.readouterr().out
        assert all(n in out for n in shown) and not any(n in out for n in idle)
    finally:
        for name in [*shown, *idle]:
            control_plane.request("DELETE", f"/api/v1/nodes/{name}")
