"""The chart's admission guard (templates/admission-policy.yaml, admission-webhooks.yaml):
what each setting renders, parameterised by namespace, with the names the Python rule
guards. tests/test_admission_guard.py proves the rendered objects on the API server."""

from __future__ import annotations

import re

import pytest

from shared_svc.admission.rules import GUARD_LABEL, GUARDED
from tests.test_deploy_chart import RenderError, render_docs

pytestmark = pytest.mark.helm  # every test renders the chart (helmrender)

WEBHOOK = (
    "admission.webhook.enabled=true",
    "admission.webhook.url=https://127.0.0.1:9443",
    "admission.certificate.source=external",
    "admission.webhook.caBundle=Q0E=",
)
ADMISSION = {
    "MutatingAdmissionPolicy",
    "MutatingAdmissionPolicyBinding",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
}


def kinds(*sets: str, namespace: str = "gpu-operator") -> dict[str, dict]:  # type: ignore[type-arg]
    docs = render_docs(*sets, namespace=namespace)
    return {d["kind"]: d for d in docs if d["kind"] in ADMISSION}


def test_offline_auto_renders_the_webhooks_not_the_policy() -> None:
    # Helm knows kinds only from discovery; its offline default capabilities list
    # group/versions, so `helm template` with auto cannot tell: the mutating webhook (which
    # works on every version) and the delete guard, both on by default.
    assert set(kinds()) == {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}
    assert kinds("admission.webhook.enabled=false") == {}


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (
            ("admission.mutation=policy", "admission.webhook.enabled=false"),
            {"MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"},
        ),
        (
            ("admission.mutation=policy",),
            {
                "MutatingAdmissionPolicy",
                "MutatingAdmissionPolicyBinding",
                "ValidatingWebhookConfiguration",
            },
        ),
        (
            ("admission.mutation=policy", *WEBHOOK),
            {
                "MutatingAdmissionPolicy",
                "MutatingAdmissionPolicyBinding",
                "ValidatingWebhookConfiguration",
            },
        ),
        (
            ("admission.mutation=webhook", *WEBHOOK),
            {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"},
        ),
        # auto where the policy API is not known: the mutating webhook
        (WEBHOOK, {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}),
        (("admission.mutation=none", *WEBHOOK), {"ValidatingWebhookConfiguration"}),
        (("admission.mutation=none", "admission.deleteGuard=false", *WEBHOOK), set()),
    ],
)
def test_what_each_setting_renders(sets: tuple[str, ...], expected: set[str]) -> None:
    assert set(kinds(*sets)) == expected


def test_the_guard_is_parameterised_by_namespace_and_names_what_the_rule_guards() -> None:
    found = kinds(
        "admission.mutation=policy",
        *WEBHOOK,
        "admission.operatorServiceAccount=nvidia-operator",
        namespace="ops",
    )
    for doc in found.values():
        assert doc["metadata"]["labels"][GUARD_LABEL] == "ops"
        assert "ops" in doc["metadata"]["name"]
    policy = found["MutatingAdmissionPolicy"]["spec"]
    # The conditions are the mutation's own (no matchConditions: see admission-policy.yaml).
    assert "matchConditions" not in policy
    (mutation,) = policy["mutations"]
    condition = mutation["jsonPatch"]["expression"].split(") ? (", 1)[0]
    assert 'request.namespace == "ops"' in condition
    binding = found["MutatingAdmissionPolicyBinding"]["spec"]
    assert binding["policyName"] == found["MutatingAdmissionPolicy"]["metadata"]["name"]
    assert binding["matchResources"]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "ops"
    }
    # The Services' and the ServiceMonitors' name lists, then the CR kinds.
    assert listed_names(condition)[:2] == [
        set(GUARDED["Service"]),
        set(GUARDED["ServiceMonitor"]),
    ]
    assert '"app.kubernetes.io/managed-by"].orValue("") == "shared-svc"' in condition
    assert 'r.kind in ["ClusterPolicy", "GPUCluster"]' in condition
    mutating = kinds("admission.mutation=webhook", *WEBHOOK, namespace="ops")
    hook = mutating["MutatingWebhookConfiguration"]["webhooks"][0]
    ours = {c["name"]: c["expression"] for c in hook["matchConditions"]}["our-object"]
    assert listed_names(ours) == [set(GUARDED["Service"]), set(GUARDED["ServiceMonitor"])]
    webhook = found["ValidatingWebhookConfiguration"]["webhooks"][0]
    # By the old object's name: a delete by name and each object of a delete of a
    # collection carry it (request.name matches no object of a collection).
    deleted = {c["name"]: c["expression"] for c in webhook["matchConditions"]}["our-object"]
    assert listed_names(deleted) == [set(GUARDED["Service"]), set(GUARDED["ServiceMonitor"])]
    assert deleted.count("oldObject.metadata.name in") == 2 and "request.name" not in deleted
    assert webhook["failurePolicy"] == "Ignore" and webhook["sideEffects"] == "None"
    assert webhook["clientConfig"] == {
        "url": "https://127.0.0.1:9443/validate-delete",
        "caBundle": "Q0E=",
    }
    conditions = {c["name"]: c["expression"] for c in webhook["matchConditions"]}
    user = conditions["from-gpu-operator-or-the-probe"]
    assert '"system:serviceaccount:ops:nvidia-operator"' in user
    # shared-svc's own ServiceAccount: its dry runs only (the guard probe).
    assert 'request.userInfo.username == "system:serviceaccount:ops:shared-svc" &&' in user
    assert "request.dryRun == true" in user


def listed_names(expression: str) -> list[set[str]]:
    """The name lists of a CEL expression (``in [...]``), in order."""
    return [set(re.findall(r'"([^"]+)"', m)) for m in re.findall(r"in \[([^\]]*)\]", expression)]


def test_in_cluster_webhook_calls_the_service() -> None:
    found = kinds()
    config = found["ValidatingWebhookConfiguration"]["webhooks"][0]["clientConfig"]
    assert config["service"] == {
        "name": "shared-svc-webhook",
        "namespace": "gpu-operator",
        "port": 443,
        "path": "/validate-delete",
    }


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("admission.certificate.source=external",), "caBundle"),
        (("admission.webhook.caBundle=Q0E=",), "source=external"),
        (("admission.certificate.source=vault",), "source"),
        (("admission.mutation=maybe",), "mutation"),
        (("admission.webhook.url=http://x",), "url"),
    ],
)
def test_bad_admission_values_fail_the_render(sets: tuple[str, ...], message: str) -> None:
    with pytest.raises(RenderError, match=message):
        render_docs(*sets)
