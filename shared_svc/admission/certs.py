"""The webhook's serving certificate when the chart generates it (docs/install.md,
"Certificates"): what certificate to make, whether a stored one must be replaced, how to
put its CA into the webhook configurations. The Kubernetes reads and writes are in
``shared_svc/commands/admission.py``; everything here is pure except ``make_pair``, which
draws new keys.

The pair lives in one ``kubernetes.io/tls`` Secret: ``tls.crt``, ``tls.key`` and ``ca.crt``
(cert-manager's layout, so the server mounts either the same way). The CA's key is not
kept: a pair that needs replacing is replaced whole (new CA, new certificate), and the
``caBundle`` is patched again.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared_svc.k8s.labels import is_object_name

CERT, KEY, CA = "tls.crt", "tls.key", "ca.crt"
VALIDITY_DAYS = 3650
RENEW_BEFORE_DAYS = 30


class CertError(ValueError):
    """A request for a certificate that cannot be made (bad name, bad validity)."""


@dataclass(frozen=True)
class CertSpec:
    """The serving certificate to make: the names the API server may call it by."""

    common_name: str
    dns_names: tuple[str, ...]
    ip_addresses: tuple[str, ...]
    validity_days: int


def cert_spec(
    service: str,
    namespace: str,
    *,
    extra_sans: Sequence[str] = (),
    validity_days: int = VALIDITY_DAYS,
) -> CertSpec:
    """The API server calls a service-backed webhook as ``<service>.<namespace>.svc``;
    the shorter forms are listed too. ``extra_sans`` adds names or IP addresses (a webhook
    reached by URL out of cluster, e.g. ``127.0.0.1``)."""
    for label, value in (("service", service), ("namespace", namespace)):
        if not is_object_name(value, label=True):
            raise CertError(f"{label} {value!r} is not a DNS label")
    if not 1 <= validity_days <= 36500:
        raise CertError(f"validity {validity_days} days is not between 1 and 36500")
    dns = [service, f"{service}.{namespace}", f"{service}.{namespace}.svc"]
    ips: list[str] = []
    for san in extra_sans:
        try:
            ips.append(str(ipaddress.ip_address(san)))
        except ValueError:
            if not is_object_name(san):
                raise CertError(f"{san!r} is neither an IP address nor a DNS name") from None
            dns.append(san)
    full = f"{service}.{namespace}.svc"
    return CertSpec(
        # X.509 limits a common name to 64 characters; TLS clients check the SANs anyway
        common_name=full if len(full) <= 64 else service,
        dns_names=tuple(dict.fromkeys(dns)),
        ip_addresses=tuple(dict.fromkeys(ips)),
        validity_days=validity_days,
    )


def _decode(data: Mapping[str, str], key: str) -> bytes | None:
    value = data.get(key)
    if not value:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        return None


def renewal_reason(
    data: Mapping[str, str] | None,
    spec: CertSpec,
    now: dt.datetime,
    *,
    renew_before_days: int = RENEW_BEFORE_DAYS,
) -> str | None:
    """Why the Secret's pair (``data``: the Secret's base64 ``data``) must be replaced, or
    None to keep it. Kept only when all three entries load, the key is the certificate's,
    the CA signed it, it names every name of ``spec``, and it is valid now and for
    ``renew_before_days`` more days."""
    if data is None:
        return "missing"
    raw = {k: _decode(data, k) for k in (CERT, KEY, CA)}
    absent = [k for k, v in raw.items() if v is None]
    if absent:
        return f"no {', '.join(absent)}"
    try:
        cert = x509.load_pem_x509_certificate(raw[CERT] or b"")
        ca = x509.load_pem_x509_certificate(raw[CA] or b"")
        key = serialization.load_pem_private_key(raw[KEY] or b"", password=None)
    except (ValueError, TypeError) as exc:
        return f"unreadable ({str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__})"
    if key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) != cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ):
        return "the key is not the certificate's"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return "not signed by ca.crt"
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "names none of the webhook's names"
    dns = set(sans.get_values_for_type(x509.DNSName))
    ips = {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    missing = sorted(set(spec.dns_names) - dns) + sorted(set(spec.ip_addresses) - ips)
    if missing:
        return f"does not name {', '.join(missing)}"
    if now < cert.not_valid_before_utc:
        return f"not valid before {cert.not_valid_before_utc:%Y-%m-%dT%H:%M:%SZ}"
    ends = min(cert.not_valid_after_utc, ca.not_valid_after_utc)
    if now + dt.timedelta(days=renew_before_days) >= ends:
        return f"expires {ends:%Y-%m-%dT%H:%M:%SZ}"
    return None


def chain_expiry(pem: bytes) -> float | None:
    """When the first of a PEM chain's certificates stops being valid (Unix time); None
    when it holds none that loads."""
    try:
        chain = x509.load_pem_x509_certificates(pem)
    except ValueError:
        return None
    return min(c.not_valid_after_utc.timestamp() for c in chain) if chain else None


def not_after(data: Mapping[str, str]) -> str:
    """When the stored certificate expires (for the log line of a kept pair)."""
    cert = x509.load_pem_x509_certificate(_decode(data, CERT) or b"")
    return f"{cert.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}"


def make_pair(spec: CertSpec, now: dt.datetime) -> dict[str, str]:
    """A new CA and a serving certificate it signs (ECDSA P-256), as the Secret's base64
    ``data``. Valid from a minute before ``now`` (clock skew) for ``spec.validity_days``."""
    start = now - dt.timedelta(minutes=1)
    end = now + dt.timedelta(days=spec.validity_days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "shared-svc webhook CA"),
            x509.NameAttribute(NameOID.COMMON_NAME, spec.common_name),
        ]
    )
    ca = _make_ca(ca_key, ca_name, start, end)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _make_serving(spec, key, ca_key, ca_name, start, end)
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return {
        CERT: b64(cert.public_bytes(pem)),
        KEY: b64(key_pem),
        CA: b64(ca.public_bytes(pem)),
    }


def _make_ca(
    ca_key: ec.EllipticCurvePrivateKey, ca_name: x509.Name, start: dt.datetime, end: dt.datetime
) -> x509.Certificate:
    """The self-signed CA: signs certificates only (no path below the serving one)."""
    return (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )


def _make_serving(
    spec: CertSpec,
    key: ec.EllipticCurvePrivateKey,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_name: x509.Name,
    start: dt.datetime,
    end: dt.datetime,
) -> x509.Certificate:
    """The serving certificate of ``key`` for the spec's DNS names and IP addresses,
    signed by the CA."""
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in spec.dns_names]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in spec.ip_addresses]
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, spec.common_name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )


def ca_bundle_patch(configuration: Mapping[str, Any], ca_bundle: str) -> list[dict[str, Any]]:
    """JSON patch putting ``ca_bundle`` (base64 PEM) into every webhook of a webhook
    configuration whose caBundle differs; [] when all already carry it. Each change is
    guarded by a ``test`` of the webhook's name, so a configuration changed meanwhile makes
    the patch fail instead of landing on the wrong webhook."""
    ops: list[dict[str, Any]] = []
    for i, hook in enumerate(configuration.get("webhooks") or []):
        if (hook.get("clientConfig") or {}).get("caBundle") == ca_bundle:
            continue
        ops.append({"op": "test", "path": f"/webhooks/{i}/name", "value": hook["name"]})
        ops.append(
            {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": ca_bundle}
        )
    return ops
