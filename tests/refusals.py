"""A persistent write error on the real API server: a ValidatingAdmissionPolicy (run by the
API server itself, no webhook needed) that refuses every write of Services in a namespace."""

from __future__ import annotations

import contextlib
from typing import Any

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.kube.writer import raw_request
from tests.kube import eventually

ADMISSION = "/apis/admissionregistration.k8s.io/v1"


class ServiceWritesRefused:
    """Creates the policy and its binding; :meth:`lift` deletes them."""

    def __init__(self, api: ApiClient, namespace: str) -> None:
        self.api = api
        self.ns = namespace
        self.name = f"refuse-services-{namespace}"

    async def __aenter__(self) -> ServiceWritesRefused:
        policy = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": self.name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE", "UPDATE"],
                            "resources": ["services"],
                        }
                    ]
                },
                "validations": [{"expression": "false", "message": "refused by a test policy"}],
            },
        }
        binding = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": self.name},
            "spec": {
                "policyName": self.name,
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": self.ns}}
                },
            },
        }
        await raw_request(self.api, "POST", f"{ADMISSION}/validatingadmissionpolicies", body=policy)
        await raw_request(
            self.api, "POST", f"{ADMISSION}/validatingadmissionpolicybindings", body=binding
        )
        await eventually(self._refused, timeout=30, interval=0.2)
        return self

    async def _refused(self) -> bool:
        probe: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "probe"},
            "spec": {"ports": [{"port": 1}]},
        }
        try:
            await raw_request(
                self.api,
                "POST",
                f"/api/v1/namespaces/{self.ns}/services",
                body=probe,
                query=[("dryRun", "All")],
            )
        except ApiException as exc:
            return "refused by a test policy" in str(exc.body)
        return False

    async def lift(self) -> None:
        for kind in ("validatingadmissionpolicybindings", "validatingadmissionpolicies"):
            with contextlib.suppress(ApiException):
                await raw_request(self.api, "DELETE", f"{ADMISSION}/{kind}/{self.name}")
        await eventually(self._allowed, timeout=30, interval=0.2)

    async def _allowed(self) -> bool:
        return not await self._refused()

    async def __aexit__(self, *exc: object) -> None:
        await self.lift()
