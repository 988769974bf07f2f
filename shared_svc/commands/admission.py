"""``shared-svc admission``: what the chart's hook Jobs run (docs/install.md, "Certificates"
and "Uninstall"). Each runs under a ServiceAccount of its own; shared-svc itself never
writes admission configurations.

``certs`` keeps the webhook's serving certificate in a Secret: it creates the Secret when
it is missing, keeps it when it is valid (across upgrades: nothing in the chart changes
per render), replaces it when it is expiring, broken or names other hosts, and then puts
its CA into the ``caBundle`` of the named webhook configurations that exist (the chart
runs it before install/upgrade, for the Secret the pods mount, and after, for the
configurations).

``remove`` deletes the guard's switches before Helm deletes the rest: the policy binding
first, then the webhook configurations, then (when named) the generated Secret. Objects
already gone count as removed.

``probe`` asks the API server once whether it applies the guard of a namespace, as the
leader does every check (``admission.verdicts``: dry runs that change nothing); the
chart's ``helm test`` hook. Exit 0: every installed guard served, or nothing to guard yet;
1: a guard fails open or answers wrongly; 2: the probe could not judge.
"""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from shared_svc.config import add_flags, flag_values, load
from shared_svc.errors import UsageError
from shared_svc.k8s.labels import is_object_name
from shared_svc.kube.resources import (
    MUTATING_POLICY_BINDINGS,
    MUTATING_WEBHOOKS,
    SECRETS,
    VALIDATING_WEBHOOKS,
)

T = TypeVar("T")

WEBHOOK_KINDS = {"mutating": MUTATING_WEBHOOKS, "validating": VALIDATING_WEBHOOKS}


def _object_name(text: str, what: str, *, label: bool = False) -> str:
    if not is_object_name(text, label=label):
        raise argparse.ArgumentTypeError(f"{what} {text!r} is not a Kubernetes object name")
    return text


def secret_ref(text: str) -> tuple[str, str]:
    namespace, sep, name = text.partition("/")
    if not sep or not namespace or "/" in name:
        raise argparse.ArgumentTypeError(f"expected NAMESPACE/NAME, got {text!r}")
    return _object_name(namespace, "namespace", label=True), _object_name(name, "name")


def webhook_ref(text: str) -> tuple[str, str]:
    kind, sep, name = text.partition("/")
    if not sep or kind not in WEBHOOK_KINDS:
        raise argparse.ArgumentTypeError(f"expected mutating/NAME or validating/NAME, got {text!r}")
    return kind, _object_name(name, "name")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "admission",
        help="the admission guard's certificate and uninstall steps (the chart's hook Jobs)",
        description=__doc__,
    )
    commands = parser.add_subparsers(
        dest="admission_command", metavar="SUBCOMMAND", title="subcommands", required=True
    )
    _register_certs(commands)
    _register_remove(commands)
    _register_probe(commands)


def _register_probe(commands: Any) -> None:
    probe = commands.add_parser(
        "probe",
        help="ask the API server once whether it applies the admission guard (helm test)",
        description="Dry runs through the API server, as the leader probes every check: a "
        "DELETE of a Service a CR needs, which the delete guard refuses, and an update "
        "shaped like gpu-operator's, which the update guard undoes. Nothing changes. "
        "Exit 0: served (or nothing to guard yet), 1: a guard fails open or answers "
        "wrongly, 2: no answer to judge.",
    )
    add_flags(probe, ["namespace", "kubeconfig"])
    probe.set_defaults(handler=_probe)


def _register_certs(commands: Any) -> None:
    from shared_svc.admission.certs import RENEW_BEFORE_DAYS, VALIDITY_DAYS

    certs = commands.add_parser(
        "certs",
        help="create or keep the webhook's serving certificate Secret; patch the caBundle",
        description="Create the Secret when missing, keep it when valid, replace it when "
        "expiring or wrong; then put its ca.crt into the caBundle of each named webhook "
        "configuration that exists.",
    )
    certs.add_argument(
        "--secret",
        required=True,
        type=secret_ref,
        metavar="NAMESPACE/NAME",
        help="the Secret (kubernetes.io/tls) holding the certificate",
    )
    certs.add_argument(
        "--service",
        required=True,
        type=lambda t: _object_name(t, "service", label=True),
        help="the webhook Service (names <service>.<namespace>.svc)",
    )
    certs.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="NAME_OR_IP",
        help="another name or IP address (a webhook reached by URL, e.g. 127.0.0.1)",
    )
    certs.add_argument(
        "--webhook",
        action="append",
        default=[],
        type=webhook_ref,
        metavar="KIND/NAME",
        help="a webhook configuration (mutating/NAME or validating/NAME) whose caBundle to "
        "set; repeatable",
    )
    certs.add_argument(
        "--validity-days",
        type=_positive,
        default=None,
        metavar="N",
        help=f"validity of a new certificate (default: {VALIDITY_DAYS})",
    )
    certs.add_argument(
        "--renew-before-days",
        type=_positive,
        default=None,
        metavar="N",
        help=f"replace the certificate this long before it expires (default: {RENEW_BEFORE_DAYS})",
    )
    add_flags(certs, ["kubeconfig"])
    certs.set_defaults(handler=_certs)


def _register_remove(commands: Any) -> None:
    remove = commands.add_parser(
        "remove",
        help="delete the guard's binding and webhook configurations (then the Secret)",
        description="Delete, in this order, the MutatingAdmissionPolicyBinding, the webhook "
        "configurations and the Secret named; objects already gone are fine.",
    )
    remove.add_argument(
        "--policy-binding",
        action="append",
        default=[],
        type=lambda t: _object_name(t, "binding"),
        metavar="NAME",
    )
    remove.add_argument(
        "--webhook", action="append", default=[], type=webhook_ref, metavar="KIND/NAME"
    )
    remove.add_argument("--secret", type=secret_ref, default=None, metavar="NAMESPACE/NAME")
    add_flags(remove, ["kubeconfig"])
    remove.set_defaults(handler=_remove)


def _run(args: argparse.Namespace, body: Callable[[Any], Awaitable[T]]) -> T:
    """Connect, run ``body(api)``, close; API trouble is one line (``commands.api``)."""
    from shared_svc.commands.api import with_api

    return with_api(args.kubeconfig, body)


def _status(exc: BaseException) -> int | None:
    from kubernetes_asyncio.client.exceptions import ApiException

    return int(exc.status) if isinstance(exc, ApiException) else None


def _certs(args: argparse.Namespace) -> int:
    from shared_svc.admission import certs

    namespace, name = args.secret
    try:
        spec = certs.cert_spec(
            args.service,
            namespace,
            extra_sans=args.san,
            validity_days=args.validity_days or certs.VALIDITY_DAYS,
        )
    except certs.CertError as exc:
        raise UsageError(str(exc)) from None
    renew_before = args.renew_before_days or certs.RENEW_BEFORE_DAYS
    if renew_before >= spec.validity_days:
        raise UsageError(
            f"--renew-before-days {renew_before} must be below the validity ({spec.validity_days})"
        )

    async def body(api: Any) -> int:
        data = await ensure_secret(api, namespace, name, spec, renew_before)
        for kind, webhook in args.webhook:
            await patch_ca_bundle(api, kind, webhook, data[certs.CA])
        return 0

    return _run(args, body)


async def ensure_secret(
    api: Any, namespace: str, name: str, spec: Any, renew_before: int
) -> dict[str, str]:
    """The Secret's data after creating, keeping or replacing it (one line printed)."""
    from shared_svc.admission import certs
    from shared_svc.kube.writer import raw_request

    for _ in range(3):  # another Job (or replica of this one) may write at the same time
        try:
            live = await raw_request(api, "GET", SECRETS.item(name, namespace))
        except Exception as exc:
            if _status(exc) != 404:
                raise
            live = None
        data = (live or {}).get("data")
        now = dt.datetime.now(dt.UTC)
        reason = certs.renewal_reason(data, spec, now, renew_before_days=renew_before)
        if reason is None and data is not None:
            print(f"secret {namespace}/{name}: kept (valid until {certs.not_after(data)})")
            return dict(data)
        fresh = certs.make_pair(spec, now)
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "annotations": {"shared-svc.nvidia.com/generated-by": "shared-svc admission certs"},
            },
            "data": fresh,
        }
        try:
            if live is None:
                await raw_request(api, "POST", SECRETS.collection(namespace), body=body)
                print(f"secret {namespace}/{name}: created")
            else:
                body["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
                body["metadata"]["labels"] = live["metadata"].get("labels") or {}
                body["type"] = live.get("type", "kubernetes.io/tls")  # type is immutable
                await raw_request(api, "PUT", SECRETS.item(name, namespace), body=body)
                print(f"secret {namespace}/{name}: replaced ({reason})")
        except Exception as exc:
            if _status(exc) in (409,):  # created or changed meanwhile: look again
                continue
            raise
        return fresh
    raise UsageError(f"secret {namespace}/{name} keeps changing under us; try again")


async def patch_ca_bundle(api: Any, kind: str, name: str, ca_bundle: str) -> None:
    from shared_svc.admission.certs import ca_bundle_patch
    from shared_svc.kube.writer import raw_request

    path = WEBHOOK_KINDS[kind].item(name)
    for _ in range(3):
        try:
            live = await raw_request(api, "GET", path)
        except Exception as exc:
            if _status(exc) == 404:
                print(f"{kind} webhook configuration {name}: not installed, skipped")
                return
            raise
        ops = ca_bundle_patch(live, ca_bundle)
        if not ops:
            print(f"{kind} webhook configuration {name}: caBundle current")
            return
        try:
            await raw_request(
                api, "PATCH", path, body=ops, content_type="application/json-patch+json"
            )
        except Exception as exc:
            if _status(exc) in (409, 422):  # changed between GET and PATCH: look again
                continue
            raise
        print(f"{kind} webhook configuration {name}: caBundle set")
        return
    raise UsageError(f"{kind} webhook configuration {name} keeps changing under us; try again")


def _remove(args: argparse.Namespace) -> int:
    targets = [
        (f"policy binding {b}", MUTATING_POLICY_BINDINGS.item(b)) for b in args.policy_binding
    ]
    targets += [
        (f"{kind} webhook configuration {n}", WEBHOOK_KINDS[kind].item(n))
        for kind, n in args.webhook
    ]
    if args.secret:
        namespace, name = args.secret
        targets.append((f"secret {namespace}/{name}", SECRETS.item(name, namespace)))

    async def body(api: Any) -> int:
        from shared_svc.kube.writer import raw_request

        for what, path in targets:
            try:
                await raw_request(api, "DELETE", path)
            except Exception as exc:
                if _status(exc) != 404:
                    raise
                print(f"{what}: already gone")
                continue
            print(f"{what}: deleted")
        return 0

    return _run(args, body)


def _probe(args: argparse.Namespace) -> int:
    from shared_svc.admission.guard import KINDS, list_guard, probe_listed
    from shared_svc.admission.verdicts import FAILING, PROBE_FAILED, worst
    from shared_svc.kube.resources import SERVICES
    from shared_svc.kube.writer import raw_request

    config = load(flag_values(args, ["namespace", "kubeconfig"]))
    namespace = config.namespace

    async def body(api: Any) -> int:
        listed = {kind: await list_guard(api, namespace, gvr) for kind, gvr in KINDS.items()}
        res = await raw_request(api, "GET", SERVICES.collection(namespace))
        verdicts = await probe_listed(api, namespace, listed, res.get("items") or [])
        for v in verdicts:
            where = f" (Service {namespace}/{v.target})" if v.target else ""
            print(f"{v.guard} guard: {v.reason}{where}: {v.detail}")
        reason = worst(verdicts)
        if reason in FAILING:
            return 1
        return 2 if reason == PROBE_FAILED else 0

    from shared_svc.commands.api import with_api

    return with_api(config.kubeconfig, body)
