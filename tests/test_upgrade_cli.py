"""``shared-svc upgrade prepare-daemonset`` and ``status`` against the real API server."""

from __future__ import annotations

import json
from typing import Any

import pytest

import testenv
from shared_svc.cli import main
from shared_svc.kube.writer import MERGE_PATCH
from shared_svc.upgrade import record
from testenv import upgrade_examples as ex
from tests.kube import unique

pytestmark = pytest.mark.apiserver

KEY = "nvidia.com/gpu-driver-upgrade.parked"
CONSUMER = "nvidia.com/gpu-driver-upgrade.consumer"
RECORD = "shared-svc.nvidia.com/gpu-driver-upgrade-freed"
T0 = 1_700_000_000.0
# The keys of a node and of the gate in the service's /status (docs/upgrade.md).
STATUS_NODE_KEYS = {
    "node",
    "state",
    "mode",
    "phase",
    "parkedLabel",
    "parkedByUs",
    "since",
    "freedAt",
    "pending",
    "refused",
    "blocked",
    "evicted",
    "stuck",
    "detected",
    "daemonsetPods",
    "unpreparedDaemonsets",
    "operatorHookPods",
    "partialDaemonsets",
    "restartRace",
    "path",
    "pathEvidence",
    "driverDaemonset",
    "unknownState",
    "recordError",
    "policy",
    "noFlow",
}
STATUS_GATE_KEYS = {"mode", "why", "state", "verdicts", "unread", "ungoverned", "ungovernedCount"}
STATUS_VERDICT_KEYS = {
    "state",
    "policy",
    "podSelector",
    "timeoutSeconds",
    "wanted",
    "message",
    "field",
    "governs",
    "nodes",
    "nodeCount",
}
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
    # the consumer label on the pod template (the gate), the expression in every ORed term
    assert added == [f"{CONSUMER}: 'true'"] + [f"- key: {KEY}", "operator: DoesNotExist"] * 2
    assert "dry run" in out
    assert all(KEY not in str(t) for t in _terms(control_plane, target))  # nothing written
    assert CONSUMER not in _template_labels(control_plane, target)
    generation = _generation(control_plane, target)

    assert main(["upgrade", "prepare-daemonset", target, *kc]) == 0
    terms = _terms(control_plane, target)
    assert len(terms) == 2
    assert all({"key": KEY, "operator": "DoesNotExist"} in t["matchExpressions"] for t in terms)  # type: ignore[operator]
    assert _template_labels(control_plane, target) == {"app": "exporter", CONSUMER: "true"}
    assert _generation(control_plane, target) == generation + 1  # one patch: one rollout
    capsys.readouterr()

    assert main(["upgrade", "prepare-daemonset", target, *kc]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert _terms(control_plane, target) == terms
    assert _generation(control_plane, target) == generation + 1


def test_prepare_daemonset_prepared_before_gets_only_the_label(
    control_plane: testenv.ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    """A DaemonSet prepared by an earlier release (affinity, no label): the label alone."""
    target = _daemonset(control_plane, _namespace(control_plane), declared=True)
    kc = ["--kubeconfig", str(control_plane.kubeconfig)]
    terms = _terms(control_plane, target)
    assert main(["upgrade", "prepare-daemonset", target, *kc]) == 0
    out = capsys.readouterr().out
    added = [line[1:].strip() for line in out.splitlines() if line.startswith("+ ")]
    assert added == [f"{CONSUMER}: 'true'"]
    assert _terms(control_plane, target) == terms
    assert _template_labels(control_plane, target)[CONSUMER] == "true"
    # Another consumer selector: its label (the one the service and the gate use).
    assert (
        main(
            ["upgrade", "prepare-daemonset", target, "--upgrade-consumer-selector", "team/gpu", *kc]
        )
        == 0
    )
    assert _template_labels(control_plane, target)["team/gpu"] == "true"
    capsys.readouterr()
    code = main(
        ["upgrade", "prepare-daemonset", target, "--upgrade-consumer-selector", "!team/gpu", *kc]
    )
    err = capsys.readouterr().err
    assert code == 2 and "names no label" in err and len(err.strip().splitlines()) == 1


def _daemonset_obj(cp: testenv.ControlPlane, target: str) -> dict[str, Any]:
    ns, name = target.split("/")
    return _ok(cp.request("GET", f"/apis/apps/v1/namespaces/{ns}/daemonsets/{name}"))  # type: ignore[return-value]


def _template_labels(cp: testenv.ControlPlane, target: str) -> dict[str, str]:
    return dict(_daemonset_obj(cp, target)["spec"]["template"]["metadata"]["labels"])


def _generation(cp: testenv.ControlPlane, target: str) -> int:
    return int(_daemonset_obj(cp, target)["metadata"]["generation"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no-slash"], "expected NAMESPACE/NAME"),
        (["Bad/Name"], "expected NAMESPACE/NAME"),
        (["default/abc\n"], "expected NAMESPACE/NAME"),  # a whole-string match, no "$\n"
        (["a.b/abc"], "expected NAMESPACE/NAME"),  # a namespace is a DNS label
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


# --- gpu-operator's client hook, nvidia.com/gpu.deploy.client (issue 28) ---

HOOK = "nvidia.com/gpu.deploy.client"


def _client_labelled_nodes(cp: testenv.ControlPlane) -> list[str]:
    listed = _ok(cp.request("GET", f"/api/v1/nodes?labelSelector={HOOK}"))
    return [n["metadata"]["name"] for n in listed["items"]]  # type: ignore[index]


def _run(cp: testenv.ControlPlane, *args: str) -> int:
    return main(["upgrade", *args, "--kubeconfig", str(cp.kubeconfig)])


def test_prepare_leaves_a_client_hook_daemonset_to_gpu_operator_or_says_it_never_schedules(
    control_plane: testenv.ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    ns = _namespace(control_plane)
    target = _daemonset(control_plane, ns, node_selector={HOOK: "true"})
    generation = _generation(control_plane, target)
    assert _client_labelled_nodes(control_plane) == []  # no gpu-operator >= v26.7.0 here
    assert _run(control_plane, "prepare-daemonset", target) == 2
    err = capsys.readouterr().err.strip()
    assert "runs nowhere" in err and "\n" not in err and "remove that nodeselector" in err.lower()
    node = _node(control_plane, "upgrade-done", labels={HOOK: "true"})
    try:
        assert _run(control_plane, "prepare-daemonset", target) == 0
        out = capsys.readouterr().out
        assert "leaves it to gpu-operator" in out and "Nothing to do" in out
        assert _generation(control_plane, target) == generation  # not touched
    finally:
        control_plane.request("DELETE", f"/api/v1/nodes/{node}")


def test_prepare_and_status_report_a_daemonset_prepared_both_ways(
    control_plane: testenv.ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    ns = _namespace(control_plane)
    both = _daemonset(control_plane, ns, declared=True, node_selector={HOOK: "true"})
    hooked = ex.daemonset("hooked", namespace=ns, node_selector={HOOK: "true"})
    for key in ("uid", "resourceVersion"):
        del hooked["metadata"][key]
    _ok(control_plane.request("POST", f"/apis/apps/v1/namespaces/{ns}/daemonsets", hooked))
    node = _node(control_plane, "upgrade-done", labels={HOOK: "paused-for-driver-upgrade"})
    try:
        generation = _generation(control_plane, both)
        assert _run(control_plane, "prepare-daemonset", both) == 0
        out = capsys.readouterr().out
        assert out.startswith("warning: ") and "prepared both ways" in out
        assert _generation(control_plane, both) == generation
        assert _run(control_plane, "status") == 0
        out = capsys.readouterr().out
        assert "client hook (nvidia.com/gpu.deploy.client)" in out
        assert f"WARNING: DaemonSet {both} is prepared both ways" in out
        assert f"DaemonSet {ns}/hooked selects" in out and "leaves it to gpu-operator" in out
        assert _run(control_plane, "status", "-o", "json") == 0
        mine = {
            h["daemonSet"]: h["finding"]
            for h in json.loads(capsys.readouterr().out)["clientHook"]
            if h["daemonSet"].startswith(f"{ns}/")
        }
        assert mine == {both: "both", f"{ns}/hooked": "left-to-operator"}
    finally:
        control_plane.request("DELETE", f"/api/v1/nodes/{node}")
    # No node carries the label any more (gpu-operator before v26.7.0, or GPUCluster mode).
    assert _run(control_plane, "status", "-o", "json") == 0
    mine = {
        h["daemonSet"]: h["finding"]
        for h in json.loads(capsys.readouterr().out)["clientHook"]
        if h["daemonSet"].startswith(f"{ns}/")
    }
    assert mine == {both: "never-schedules", f"{ns}/hooked": "never-schedules"}


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
        printed = json.loads(capsys.readouterr().out)
        listed = {s["node"]: s["state"] for s in printed["nodes"]}
        # The keys of /status (camelCase, docs/upgrade.md) for the same things.
        assert all(set(s) == STATUS_NODE_KEYS for s in printed["nodes"]), printed["nodes"]
        assert set(printed["gate"]) == STATUS_GATE_KEYS, printed["gate"]
        assert all(set(v) == STATUS_VERDICT_KEYS for v in printed["gate"]["verdicts"])
        assert set(shown) <= set(listed)
        assert {n: listed[n] for n in shown} == shown
        assert not set(idle) & set(listed)
        assert main(["upgrade", "status", *kc]) == 0
        out = capsys.readouterr().out
        assert all(n in out for n in shown) and not any(n in out for n in idle)
    finally:
        for name in [*shown, *idle]:
            control_plane.request("DELETE", f"/api/v1/nodes/{name}")


# --- configure-gate (issue 14) ---

CLUSTER_POLICIES = "/apis/nvidia.com/v1/clusterpolicies"
GATE = f"{CONSUMER}=true"


def _only_cluster_policy(cp: testenv.ControlPlane, **kw: Any) -> str:
    """The one ClusterPolicy of the cluster (the active one: others are deleted first)."""
    _, listed = cp.request("GET", CLUSTER_POLICIES)
    for item in listed.get("items") or []:  # type: ignore[union-attr]
        cp.request("DELETE", f"{CLUSTER_POLICIES}/{item['metadata']['name']}")
    body = ex.cluster_policy(unique("cluster-policy"), **kw)
    for key in ("uid", "resourceVersion", "creationTimestamp"):
        del body["metadata"][key]
    _ok(cp.request("POST", CLUSTER_POLICIES, body))
    return str(body["metadata"]["name"])


def _wait_spec(cp: testenv.ControlPlane, name: str) -> dict[str, Any]:
    policy = _ok(cp.request("GET", f"{CLUSTER_POLICIES}/{name}"))
    return dict(policy["spec"]["driver"].get("upgradePolicy", {}).get("waitForCompletion") or {})  # type: ignore[index]


def test_configure_gate_prints_then_applies_the_merge_patch(
    control_plane: testenv.ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    name = _only_cluster_policy(control_plane, auto_upgrade=True)
    kc = ["--kubeconfig", str(control_plane.kubeconfig)]
    try:
        assert main(["upgrade", "status", *kc]) == 0
        out = capsys.readouterr().out
        assert out.startswith("gate: ") and "races the driver restart" in out
        assert f"  WARNING: missing: ClusterPolicy/{name} has no" in out, out

        assert main(["upgrade", "configure-gate", *kc]) == 0
        out = capsys.readouterr().out
        patch = {
            "spec": {
                "driver": {
                    "upgradePolicy": {
                        "waitForCompletion": {"podSelector": GATE, "timeoutSeconds": 600}
                    }
                }
            }
        }
        compact = json.dumps(patch, separators=(",", ":"))
        assert f"merge patch: {compact}" in out
        assert f"kubectl patch clusterpolicy {name} --type merge -p '{compact}'" in out
        assert "not applied" in out
        assert _wait_spec(control_plane, name) == {}  # printed only, nothing written

        assert main(["upgrade", "configure-gate", "--apply", *kc]) == 0
        assert f"applied to ClusterPolicy/{name}" in capsys.readouterr().out
        assert _wait_spec(control_plane, name) == {"podSelector": GATE, "timeoutSeconds": 600}

        assert main(["upgrade", "configure-gate", "--apply", *kc]) == 0
        assert "nothing to do" in capsys.readouterr().out
        assert main(["upgrade", "status", "-o", "json", *kc]) == 0
        assert json.loads(capsys.readouterr().out)["gate"]["state"] == "ok"
    finally:
        control_plane.request("DELETE", f"{CLUSTER_POLICIES}/{name}")


@pytest.mark.parametrize("writes", [1, 5])
def test_configure_gate_plans_again_when_the_cluster_policy_changed_meanwhile(
    control_plane: testenv.ControlPlane,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    writes: int,
) -> None:
    """gpu-operator writes its ClusterPolicy too: a write between configure-gate's read and
    its resourceVersion-guarded patch is a 409 on the real API server, planned again from a
    fresh read (five tries, as client-go's RetryOnConflict); a policy that changes on every
    try is one line and exit 2, nothing written."""
    from shared_svc.commands.upgrade import configure_gate as command
    from shared_svc.commands.upgrade.common import CONFLICT_TRIES

    name = _only_cluster_policy(control_plane, auto_upgrade=True)
    kc = ["--kubeconfig", str(control_plane.kubeconfig)]
    listed = command._list_cluster_policies
    reads = 0

    async def read_then_someone_writes(api: Any) -> list[dict[str, Any]]:
        nonlocal reads
        reads += 1
        items = await listed(api)
        if reads <= writes:  # another writer, after our read
            _ok(
                control_plane.request(
                    "PATCH",
                    f"{CLUSTER_POLICIES}/{name}",
                    {"metadata": {"labels": {"written-by": f"operator-{reads}"}}},
                    content_type=MERGE_PATCH,
                )
            )
        return items

    monkeypatch.setattr(command, "_list_cluster_policies", read_then_someone_writes)
    try:
        code = main(["upgrade", "configure-gate", "--apply", *kc])
        captured = capsys.readouterr()
        if writes < CONFLICT_TRIES:
            assert code == 0 and reads == writes + 1
            assert captured.err.count("changed meanwhile: planning again") == writes
            assert f"applied to ClusterPolicy/{name}" in captured.out
            assert _wait_spec(control_plane, name) == {"podSelector": GATE, "timeoutSeconds": 600}
        else:
            assert code == 2 and reads == CONFLICT_TRIES
            last = captured.err.strip().splitlines()[-1]
            assert "409" in last and "Traceback" not in captured.err
            assert _wait_spec(control_plane, name) == {}
    finally:
        control_plane.request("DELETE", f"{CLUSTER_POLICIES}/{name}")


def test_configure_gate_never_replaces_a_jobs_selector_silently(
    control_plane: testenv.ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    name = _only_cluster_policy(
        control_plane, auto_upgrade=True, pod_selector="app=batch", timeout_seconds=300
    )
    kc = ["--kubeconfig", str(control_plane.kubeconfig)]
    try:
        assert main(["upgrade", "configure-gate", "--apply", *kc]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert "AND-only" in err and f"add the label {GATE}" in err and "--replace" in err
        assert _wait_spec(control_plane, name) == {
            "podSelector": "app=batch",
            "timeoutSeconds": 300,
        }

        assert main(["upgrade", "configure-gate", "--apply", "--replace", *kc]) == 0
        assert _wait_spec(control_plane, name) == {"podSelector": GATE, "timeoutSeconds": 300}
    finally:
        control_plane.request("DELETE", f"{CLUSTER_POLICIES}/{name}")


def test_configure_gate_without_a_cluster_policy_is_one_line(
    control_plane: testenv.ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    name = _only_cluster_policy(control_plane)
    control_plane.request("DELETE", f"{CLUSTER_POLICIES}/{name}")
    code = main(["upgrade", "configure-gate", "--kubeconfig", str(control_plane.kubeconfig)])
    err = capsys.readouterr().err
    assert (
        code == 2
        and "no upgrade policy gpu-operator reads" in err
        and len(err.strip().splitlines()) == 1
    )
    code = main(["upgrade", "configure-gate", "--timeout-seconds", "0"])
    assert code == 2 and "--timeout-seconds must be > 0" in capsys.readouterr().err
