"""The webhook certificate's pure rules (shared_svc/admission/certs.py) and the
``shared-svc admission`` command line (bad input: one line, exit 2)."""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import ssl
from pathlib import Path

import pytest
from cryptography import x509

from shared_svc.admission import certs
from shared_svc.admission.certs import CA, CERT, KEY, CertError, cert_spec, renewal_reason
from shared_svc.cli import main

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
SPEC = cert_spec("shared-svc-webhook", "gpu-operator")


@pytest.fixture(scope="module")
def pair() -> dict[str, str]:
    return certs.make_pair(SPEC, NOW)


def test_spec_names_the_service_as_the_api_server_calls_it() -> None:
    assert SPEC.dns_names == (
        "shared-svc-webhook",
        "shared-svc-webhook.gpu-operator",
        "shared-svc-webhook.gpu-operator.svc",
    )
    assert SPEC.common_name == "shared-svc-webhook.gpu-operator.svc"
    out = cert_spec("w", "ns", extra_sans=["127.0.0.1", "::1", "webhook.example.com", "127.0.0.1"])
    assert out.ip_addresses == ("127.0.0.1", "::1")
    assert out.dns_names[-1] == "webhook.example.com"


def test_longest_names_make_a_certificate() -> None:
    # 63-character service and namespace: the SAN is 131 characters, a CN may have 64
    spec = cert_spec("s" * 63, "n" * 63)
    assert spec.common_name == "s" * 63 and f"{'s' * 63}.{'n' * 63}.svc" in spec.dns_names
    assert renewal_reason(certs.make_pair(spec, NOW), spec, NOW) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"service": "Bad_Name", "namespace": "ns"}, "service"),
        ({"service": "w", "namespace": "a.b"}, "namespace"),
        ({"service": "w", "namespace": "ns", "extra_sans": ["not a name"]}, "neither"),
        ({"service": "w\n", "namespace": "ns"}, "service"),  # a whole-string match
        ({"service": "w", "namespace": "ns", "extra_sans": ["abc\n"]}, "neither"),
        ({"service": "w", "namespace": "ns", "validity_days": 0}, "validity"),
    ],
)
def test_bad_requests_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(CertError, match=message):
        cert_spec(**kwargs)  # type: ignore[arg-type]


def test_a_fresh_pair_is_kept_and_verifies_like_the_api_server(
    pair: dict[str, str], tmp_path: Path
) -> None:
    assert renewal_reason(pair, SPEC, NOW) is None
    assert renewal_reason(pair, SPEC, NOW + dt.timedelta(days=3600)) is None
    cert = x509.load_pem_x509_certificate(base64.b64decode(pair[CERT]))
    assert cert.not_valid_after_utc - NOW == dt.timedelta(days=certs.VALIDITY_DAYS)
    now = certs.make_pair(SPEC, dt.datetime.now(dt.UTC))  # a TLS stack checks the real clock
    raw = {k: base64.b64decode(v) for k, v in now.items()}
    # A TLS client trusting ca.crt accepts the certificate for <svc>.<ns>.svc.
    (tmp_path / "tls.crt").write_bytes(raw[CERT])
    (tmp_path / "tls.key").write_bytes(raw[KEY])
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    client = ssl.create_default_context(cadata=raw[CA].decode())
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(incoming, outgoing, server_hostname=SPEC.common_name)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side in (c, s):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
        s_in.write(outgoing.read())
        incoming.write(s_out.read())
    c.do_handshake()  # raises SSLCertVerificationError when the name or CA is wrong


def test_what_makes_a_pair_be_replaced(pair: dict[str, str]) -> None:
    other = certs.make_pair(SPEC, NOW)
    days = dt.timedelta(days=1)
    cases = {
        "missing": None,
        "no tls.key": {**pair, KEY: ""},
        "unreadable": {**pair, CERT: base64.b64encode(b"not a pem").decode()},
        "the key is not the certificate's": {**pair, KEY: other[KEY]},
        "not signed by ca.crt": {**pair, CA: other[CA]},
    }
    for expected, data in cases.items():
        reason = renewal_reason(data, SPEC, NOW)
        assert reason is not None and reason.startswith(expected), (expected, reason)
    renamed = cert_spec("shared-svc-webhook", "ops")
    assert renewal_reason(pair, renamed, NOW) == (
        "does not name shared-svc-webhook.ops, shared-svc-webhook.ops.svc"
    )
    with_ip = cert_spec("shared-svc-webhook", "gpu-operator", extra_sans=["127.0.0.1"])
    assert renewal_reason(pair, with_ip, NOW) == "does not name 127.0.0.1"
    end = NOW + dt.timedelta(days=certs.VALIDITY_DAYS)
    assert (renewal_reason(pair, SPEC, end - 31 * days)) is None
    assert (renewal_reason(pair, SPEC, end - 29 * days) or "").startswith("expires")
    assert (renewal_reason(pair, SPEC, end - 29 * days, renew_before_days=7)) is None
    assert (renewal_reason(pair, SPEC, NOW - days) or "").startswith("not valid before")


def test_ca_bundle_patch_touches_only_webhooks_without_it() -> None:
    config = {
        "webhooks": [
            {"name": "a.example", "clientConfig": {"service": {"name": "s"}}},
            {"name": "b.example", "clientConfig": {"caBundle": "Q0E="}},
        ]
    }
    assert certs.ca_bundle_patch(config, "Q0E=") == [
        {"op": "test", "path": "/webhooks/0/name", "value": "a.example"},
        {"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": "Q0E="},
    ]
    config["webhooks"][0]["clientConfig"]["caBundle"] = "Q0E="
    assert certs.ca_bundle_patch(config, "Q0E=") == []
    assert len(certs.ca_bundle_patch(config, "TkVX")) == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["admission", "certs", "--secret", "no-slash", "--service", "w"], "NAMESPACE/NAME"),
        (
            ["admission", "certs", "--secret", "ns/s", "--service", "w", "--webhook", "x/y"],
            "mutating/NAME",
        ),
        (["admission", "certs", "--secret", "ns/s", "--service", "W_"], "service"),
        (["admission", "certs", "--secret", "ns/s", "--service", "w", "--san", "a b"], "neither"),
        (
            [
                "admission",
                "certs",
                "--secret",
                "ns/s",
                "--service",
                "w",
                "--validity-days",
                "60",
                "--renew-before-days",
                "60",
            ],
            "below the validity",
        ),
        (["admission", "remove", "--policy-binding", "Bad"], "binding"),
    ],
)
def test_bad_arguments_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1
