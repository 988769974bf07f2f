"""The guard probe's pure rules (shared_svc/admission/verdicts.py): a verdict of "served"
only where the API server applied the guard's answer, "fails open" only where it let the
request through untouched; the probe's update is gpu-operator's shape, and the guard's
own answer to it (rules.decide_update applied) is judged served."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from shared_svc.admission.rules import PROBE_ALLOWED, decide_update
from shared_svc.admission.verdicts import (
    ANSWERED_WRONGLY,
    FAILS_OPEN,
    PROBE_FAILED,
    SERVED,
    delete_verdict,
    probe_target,
    update_patch,
    update_verdict,
)
from tests.worlds import json_patch

NS = "gpu-operator"
HOOK = "delete-guard.shared-svc.nvidia.com"
DENIED = f'admission webhook "{HOOK}" denied the request: services "nvidia-dcgm" not found'

statuses = st.sampled_from([200, 201, 400, 403, 404, 409, 422, 500, 503])
messages = st.sampled_from(["", DENIED, 'services "nvidia-dcgm" not found', "forbidden"])
warnings = st.lists(st.sampled_from([PROBE_ALLOWED, "299 - other", "deprecated"]), max_size=2)


@given(statuses, messages, warnings)
def test_served_only_when_the_guard_denied_with_404_fails_open_only_on_a_silent_2xx(
    status: int, message: str, warned: list[str]
) -> None:
    verdict = delete_verdict(status, message, warned, webhooks=[HOOK], target="nvidia-dcgm")
    assert (verdict.reason == SERVED) == (status == 404 and message == DENIED)
    silent = 200 <= status <= 299 and PROBE_ALLOWED not in warned
    assert (verdict.reason == FAILS_OPEN) == (silent and message != DENIED)
    if status == 404 and message != DENIED:
        assert verdict.reason == PROBE_FAILED  # the object is gone: nothing judged


def test_an_allowed_dry_run_with_the_guards_warning_is_answered_wrongly() -> None:
    verdict = delete_verdict(200, "", [f'299 - "{PROBE_ALLOWED}"'], webhooks=[HOOK])
    assert verdict.reason == ANSWERED_WRONGLY


def service(name: str = "nvidia-dcgm", *, annotations: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "uid": "u1",
        "resourceVersion": "7",
        "labels": {"app.kubernetes.io/managed-by": "shared-svc", "x": "y"},
        "ownerReferences": [
            {
                "apiVersion": "nvidia.com/v1",
                "kind": "ClusterPolicy",
                "name": "cluster-policy",
                "uid": "c1",
                "controller": False,
                "blockOwnerDeletion": False,
            }
        ],
    }
    if annotations:
        meta["annotations"] = {"a": "b"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {"selector": {"nvidia.com/gpu-operator.dcgm": "true"}, "ports": [{"port": 5555}]},
    }


@given(st.booleans())
def test_the_guards_answer_to_the_probes_update_is_served_and_no_answer_fails_open(
    annotations: bool,
) -> None:
    live = service(annotations=annotations)
    sent = json_patch(live, update_patch(live))
    # gpu-operator's shape: its labels, a controller reference to a CR, its selector.
    assert sent["metadata"]["labels"] == {"app": "nvidia-dcgm"}
    assert [r["controller"] for r in sent["metadata"]["ownerReferences"]] == [True]
    assert update_verdict(live, sent).reason == FAILS_OPEN
    restore = decide_update(live, sent, kind="Service", namespace=NS, request_namespace=NS)
    assert restore, "the guard's rule acts on the probe's update"
    answered = json_patch(sent, restore)
    assert update_verdict(live, answered).reason == SERVED
    half = copy.deepcopy(answered)
    half["spec"] = sent["spec"]
    assert update_verdict(live, half).reason == ANSWERED_WRONGLY


def test_the_target_is_a_managed_service_a_cr_owns_and_the_plan_needs() -> None:
    ours, other = service("nvidia-dcgm"), service("nvidia-dcgm-exporter")
    foreign = copy.deepcopy(ours)
    foreign["metadata"]["labels"] = {}
    assert probe_target([other, ours]) is ours
    assert probe_target([other, ours], {("Service", "nvidia-dcgm-exporter"): ("CP",)}) is other
    assert probe_target([foreign], None) is None
    assert probe_target([ours], {}) is None
