"""Reports about failures the shell meets while carrying out a plan (not decided by it).

Pure like the rest of the core: the shell says what failed, this says what to tell whom.
"""

from __future__ import annotations

from shared_svc.k8s.events import Report, note
from shared_svc.reconcile.conflicts import cr_event_ref
from shared_svc.reconcile.model import World
from shared_svc.reconcile.needs import counting_crs


def namespace_missing_reports(world: World, namespace: str) -> list[Report]:
    """The operator namespace is gone or being deleted while CRs still need Services in it.

    One Warning regarding each counting CR (their Events live in ``default``, so they
    survive the namespace), keyed by namespace and CR: a repeat bumps the series.
    """
    text = note(
        f"the operator namespace {namespace} is gone or being deleted, so the Services this CR "
        "needs cannot be created there; shared-svc retries with backoff. Recreate the "
        "namespace, or delete the CR"
    )
    return [
        Report(
            "Warning",
            "OperatorNamespaceMissing",
            "Reconcile",
            cr_event_ref(cr),
            text,
            key=f"OperatorNamespaceMissing/{namespace}/{cr.kind}/{cr.name}/{cr.uid}",
        )
        for cr in counting_crs(world)
    ]
