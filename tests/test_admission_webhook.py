"""The admission guard's shell pieces without an API server: the webhook handler's
answers and refusals of bad input, the TLS settings, who ConflictingWriter names, and
how the guard mode is told."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from shared_svc.admission.guard import guard_mode
from shared_svc.admission.rules import operator_username, operator_writes
from shared_svc.admission.server import make_webhook_app, tls_context
from shared_svc.commands.admission import secret_ref
from shared_svc.commands.run import load_config
from shared_svc.errors import UsageError
from shared_svc.reconcile.fight import name_writers

NS = "gpu-operator"
OPERATOR = operator_username(NS, "gpu-operator")


def entry(manager: str, operation: str, time: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {"manager": manager, "operation": operation, "time": time, "fieldsV1": fields}


def delete_review(user: str, name: str = "nvidia-dcgm") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u1",
            "operation": "DELETE",
            "namespace": NS,
            "name": name,
            "resource": {"group": "", "version": "v1", "resource": "services"},
            "userInfo": {"username": user},
        },
    }


async def test_webhook_answers_404_to_gpu_operator_and_400_to_garbage() -> None:
    needed: dict[tuple[str, str], tuple[str, ...]] | None = None
    app = make_webhook_app(namespace=NS, operator_users=[OPERATOR], needed_by=lambda: needed)
    async with TestClient(TestServer(app)) as http:
        # no plan yet: fail open, with a warning
        res = await (await http.post("/validate-delete", json=delete_review(OPERATOR))).json()
        assert res["response"]["allowed"] is True and res["response"]["warnings"]
        needed = {("Service", "nvidia-dcgm"): ("GPUCluster/gpu-cluster",)}
        res = await (await http.post("/validate-delete", json=delete_review(OPERATOR))).json()
        assert res["response"]["allowed"] is False
        assert res["response"]["status"]["code"] == 404
        assert res["response"]["status"]["reason"] == "NotFound"
        assert "GPUCluster/gpu-cluster" in res["response"]["status"]["message"]
        res = await (await http.post("/validate-delete", json=delete_review("alice"))).json()
        assert res["response"] == {"uid": "u1", "allowed": True}
        for body in (b"{", b"[]", json.dumps({"kind": "AdmissionReview"}).encode()):
            answer = await http.post("/mutate", data=body)
            assert answer.status == 400
            text = await answer.text()
            assert text.startswith("bad AdmissionReview:") and text.count("\n") == 1


def test_webhook_tls_settings_fail_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(UsageError, match=r"webhook certificate .* cannot be used"):
        tls_context(str(tmp_path / "missing.crt"), str(tmp_path / "missing.key"))
    monkeypatch.setenv("SHARED_SVC_WEBHOOK_CERT_FILE", str(tmp_path / "tls.crt"))
    with pytest.raises(UsageError, match="go together") as err:
        load_config(argparse.Namespace())
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text", ["ns/abc\n", "ns\n/abc", "a.b/abc", "ns/Abc", "ns/" + "a" * 254])
def test_admission_names_are_whole_kubernetes_names(text: str) -> None:
    """A Secret's namespace is a DNS label and its name a DNS subdomain, matched whole (a
    trailing newline is not a name)."""
    with pytest.raises(argparse.ArgumentTypeError, match="is not a Kubernetes object name"):
        secret_ref(text)
    assert secret_ref("gpu-operator/shared-svc.webhook") == ("gpu-operator", "shared-svc.webhook")


def test_conflicting_writer_names_the_writer_and_its_operation() -> None:
    live = {
        "metadata": {
            "managedFields": [
                entry("shared-svc", "Apply", "2026-11-30T10:00:05Z", {"f:spec": {}}),
                entry("gpu-operator", "Update", "2026-11-30T10:00:09Z", {"f:spec": {}}),
                entry("kubectl-edit", "Update", "2026-11-30T09:00:00Z", {"f:spec": {}}),
            ]
        }
    }
    # the field has owners: them, with their operations
    assert name_writers(live, ["gpu-operator"]) == ["gpu-operator / Update"]
    # a whole-object PUT removed our field, so nobody owns it: the latest Update's manager
    assert name_writers(live, []) == ["gpu-operator / Update"]
    assert name_writers({"metadata": {}}, []) == ["unknown"]


def test_operator_writes_are_found_by_name_and_manager() -> None:
    def svc(name: str, *managers: str) -> dict[str, Any]:
        return {
            "kind": "Service",
            "metadata": {
                "name": name,
                "managedFields": [entry(m, "Update", "", {}) for m in managers],
            },
        }

    objects = [
        svc("nvidia-dcgm", "shared-svc", "gpu-operator"),
        svc("nvidia-dcgm-exporter", "shared-svc"),
        svc("unrelated", "gpu-operator"),
    ]
    assert operator_writes(objects, "gpu-operator") == ["Service/nvidia-dcgm"]


def test_guard_mode() -> None:
    assert guard_mode({"policy": ["p"], "webhook": [], "delete": []}) == "policy"
    assert guard_mode({"policy": [], "webhook": ["w"], "delete": ["d"]}) == "webhook"
    assert guard_mode({"policy": [], "webhook": [], "delete": ["d"]}) == "none"
    assert guard_mode({"policy": None, "webhook": [], "delete": []}) == "unknown"
    assert guard_mode({"policy": None, "webhook": ["w"], "delete": []}) == "webhook"


async def test_webhook_certificate_is_reloaded_when_rotated(tmp_path: Path) -> None:
    import shutil
    import ssl

    from aiohttp import web

    from shared_svc.admission.server import CertReloader
    from tests.admission import make_tls

    first, second = make_tls(tmp_path / "a"), make_tls(tmp_path / "b")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(first.cert_file, cert)
    shutil.copy(first.key_file, key)
    certs = CertReloader(str(cert), str(key))
    app = make_webhook_app(namespace=NS, operator_users=[OPERATOR], needed_by=lambda: None)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=certs.context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def handshake(tls: Any) -> bool:
        trust = ssl.create_default_context(cadata=base64.b64decode(tls.ca_bundle).decode())
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=trust)
        except ssl.SSLError:
            return False
        writer.close()
        return True

    try:
        assert await handshake(first) and not await handshake(second)
        assert certs.reload_if_changed() is False  # nothing changed
        key.write_text("not a key")  # a rotation caught half-way: keep the old pair
        assert certs.reload_if_changed() is False and certs.last_error
        assert await handshake(first)
        shutil.copy(second.cert_file, cert)
        shutil.copy(second.key_file, key)
        assert certs.reload_if_changed() is True and certs.reloads == 1
        assert await handshake(second) and not await handshake(first)
    finally:
        await runner.cleanup()


async def test_guard_webhook_logs_a_malformed_request_once_without_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import ssl
    from types import SimpleNamespace

    from kubernetes_asyncio.client import ApiClient, Configuration

    from shared_svc.admission.guard import AdmissionGuard
    from tests.admission import make_tls

    tls = make_tls(tmp_path)
    config = SimpleNamespace(
        namespace=NS,
        operator_field_manager="gpu-operator",
        operator_service_account="gpu-operator",
        discovery_seconds=3600.0,
        webhook_cert_file=tls.cert_file,
        webhook_key_file=tls.key_file,
        bind_address="127.0.0.1",
        webhook_port=0,
    )
    unreachable = Configuration(host="https://127.0.0.1:1")
    async with ApiClient(unreachable) as api:
        guard = AdmissionGuard(
            api,
            config,
            recorder=None,  # type: ignore[arg-type]
            objects=lambda: None,  # no Services controller: nothing known
            needed_by=lambda: None,
            is_leader=lambda: False,
        )
        await guard.start()
        try:
            trust = ssl.create_default_context(cadata=base64.b64decode(tls.ca_bundle).decode())
            caplog.set_level(logging.DEBUG)
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", guard.webhook_port, ssl=trust
            )
            writer.write(b"POST /mutate HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
        finally:
            await guard.stop()
    assert answer.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request")
    bad = [r for r in caplog.records if "bad HTTP request" in r.getMessage()]
    assert [r.levelno for r in bad] == [logging.INFO]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_a_delete_of_a_collection_is_judged_per_object_by_its_old_object() -> None:
    """The GPUCluster's clean-up deletes by its state label; the API server then asks once
    per object with an empty ``request.name`` and the object as ``oldObject``."""
    from shared_svc.admission.rules import review

    body = delete_review(OPERATOR, name="")
    body["request"]["resource"] = {
        "group": "monitoring.coreos.com",
        "version": "v1",
        "resource": "servicemonitors",
    }
    body["request"]["oldObject"] = {"metadata": {"name": "nvidia-dcgm-exporter-dra"}}
    needed = {("ServiceMonitor", "nvidia-dcgm-exporter-dra"): ("GPUCluster/gpu-cluster",)}
    answer = review(body, namespace=NS, operator_users=[OPERATOR], needed_by=needed)
    assert answer["response"]["allowed"] is False
    assert answer["response"]["status"]["code"] == 404
    assert (
        'servicemonitors "nvidia-dcgm-exporter-dra" not found'
        in (answer["response"]["status"]["message"])
    )
    body["request"]["oldObject"] = {"metadata": {"name": "someone-elses"}}
    answer = review(body, namespace=NS, operator_users=[OPERATOR], needed_by=needed)
    assert answer["response"]["allowed"] is True


def test_the_guard_is_given_the_two_functions_it_reads_not_the_controller() -> None:
    """Issue 29: what the guard reads of the Services controller is in its signature (our
    objects as cached, who needs each), not a controller object of any type."""
    import inspect

    from shared_svc.admission.guard import AdmissionGuard

    params = inspect.signature(AdmissionGuard.__init__).parameters
    assert "controller" not in params
    assert {"objects", "needed_by"} <= set(params)
    assert all(params[p].annotation != "Any" for p in ("objects", "needed_by"))
