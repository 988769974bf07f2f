"""The webhook server: AdmissionReview v1 over TLS on its own port (``webhook_port``).

``/mutate`` (the mutating webhook, where the policy API is not served) and
``/validate-delete`` (the delete guard) share one handler: the decision is
``rules.review``; this module only reads and writes JSON. Every replica serves, leader or
not: the decision needs only the last plan, which a standby computes too.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from aiohttp import web

from shared_svc.admission.certs import chain_expiry
from shared_svc.admission.rules import BadReview, review
from shared_svc.errors import UsageError

log = logging.getLogger(__name__)

NeededBy = Mapping[tuple[str, str], Sequence[str]]
MAX_BODY = 3 * 1024 * 1024  # the API server's own request limit is 3 MiB


def make_webhook_app(
    *,
    namespace: str,
    operator_users: Iterable[str],
    needed_by: Callable[[], NeededBy | None],
    on_answered: Callable[[str, int, float], None] | None = None,
) -> web.Application:
    """``on_answered(path, status, seconds)`` after each request (the webhook metrics)."""
    users = tuple(operator_users)

    async def handle(request: web.Request) -> web.Response:
        started = time.perf_counter()
        status = 500
        try:
            response = await respond(request)
            status = response.status
            return response
        except web.HTTPException as exc:  # a body over MAX_BODY: 413
            status = exc.status
            raise
        finally:
            if on_answered is not None:
                on_answered(request.path, status, time.perf_counter() - started)

    async def respond(request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
            answer = review(body, namespace=namespace, operator_users=users, needed_by=needed_by())
        except (ValueError, BadReview) as exc:
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return web.Response(status=400, text=f"bad AdmissionReview: {msg}\n")
        response = answer["response"]
        req = body.get("request") or {}
        if not response["allowed"] or "patch" in response:
            log.info(
                "admission",
                extra={
                    "operation": req.get("operation"),
                    "object": f"{(req.get('resource') or {}).get('resource')}/{req.get('name')}",
                    "user": (req.get("userInfo") or {}).get("username"),
                    "result": "restored" if response["allowed"] else "refused-404",
                    # a dry run: the guard probe's (admission.verdicts), nothing written
                    "dryRun": req.get("dryRun") is True,
                },
            )
        return web.json_response(answer)

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/mutate", handle)
    app.router.add_post("/validate-delete", handle)
    return app


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The server's TLS context; a missing or unreadable pair is a one-line usage error."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(
            f"webhook certificate {cert_file} / key {key_file} cannot be used: {exc}"
        ) from exc
    return context


class CertReloader:
    """The server's TLS context, reloaded when the certificate or key file changes
    (cert-manager or the chart rotates the Secret; kubelet swaps the mounted files).
    New connections get the new pair; a pair that does not load keeps the old one."""

    def __init__(
        self,
        cert_file: str,
        key_file: str,
        on_loaded: Callable[[float | None], None] | None = None,
    ) -> None:
        """``on_loaded(expiry)``: each pair loaded (the first and every reload), with when
        its certificate stops being valid."""
        self.cert_file, self.key_file = cert_file, key_file
        self._on_loaded = on_loaded
        self.context = tls_context(cert_file, key_file)
        self._stamp = self._mtimes()
        self.reloads = 0
        self.last_error: str | None = None
        self._loaded()

    def _loaded(self) -> None:
        if self._on_loaded is None:
            return
        try:
            with open(self.cert_file, "rb") as fh:
                self._on_loaded(chain_expiry(fh.read()))
        except OSError:
            self._on_loaded(None)

    def _mtimes(self) -> tuple[int, int] | None:
        try:
            return (os.stat(self.cert_file).st_mtime_ns, os.stat(self.key_file).st_mtime_ns)
        except OSError:
            return None

    def reload_if_changed(self) -> bool:
        stamp = self._mtimes()
        if stamp is None or stamp == self._stamp:
            return False
        try:
            self.context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            # half-written rotation: keep serving the old pair, try again next time
            self.last_error = f"{type(exc).__name__}: {exc}"[:200]
            log.warning("webhook certificate not reloaded", extra={"error": self.last_error})
            return False
        self._stamp = stamp
        self.reloads += 1
        self.last_error = None
        self._loaded()
        log.info("webhook certificate reloaded", extra={"certFile": self.cert_file})
        return True
