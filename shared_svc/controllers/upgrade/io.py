"""API calls of the driver-upgrade controller and its commands (what it reads from
caches is ``caches.py``'s).

Pods of one node by field selector, evictions (``policy/v1``), deletes with a uid
precondition, and node merge patches that touch only our own label and annotation keys,
guarded by resourceVersion: :class:`UpgradeIO` is what the controller calls
(:class:`KubeUpgradeIO` on the API server; tests run the controller on a fake with the
same methods). The controller's writes (node patches, evictions, deletes) go through a
``kube.writer.Writer`` of its own: each waits for a token of its bucket
(``upgrade_writes_per_second``, ``upgrade_writes_burst``) and is counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.config import Config
from shared_svc.k8s.objects import K8sObject
from shared_svc.kube.decode import Decoder
from shared_svc.kube.resources import DAEMONSETS, METADATA, METADATA_LIST, NODES, PODS
from shared_svc.kube.writer import MERGE_PATCH, Writer, raw_request, status_of
from shared_svc.upgrade.consumers import POD_READS
from shared_svc.upgrade.daemonsets import CLIENT_HOOK_KEY, parked_label_key
from shared_svc.upgrade.node_plan import NodeChanged, NodePatch, PodAction
from shared_svc.upgrade.paths import driver_pod_selector
from shared_svc.upgrade.record import record_annotation_key
from shared_svc.wait.ratelimit import BucketRateLimiter

EvictOutcome = Literal["evicted", "blocked", "gone"]

# The cause every PodDisruptionBudget refusal of an eviction carries (policy/v1
# ``DisruptionBudgetCause``; kube-apiserver's pod eviction REST: no status yet, not
# allowed now, or a conflict while it checked).
DISRUPTION_BUDGET_CAUSE = "DisruptionBudget"


def refused_by_disruption_budget(exc: ApiException) -> bool:
    """Whether a 429 on an eviction is a PodDisruptionBudget's refusal (its Status names
    the cause), rather than the API server's own throttling (no such cause)."""
    details = status_of(exc).get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    return isinstance(causes, list) and any(
        isinstance(c, dict) and c.get("type") == DISRUPTION_BUDGET_CAUSE for c in causes
    )


FIELD_MANAGER = "shared-svc-upgrade"


class ForeignKeyError(ValueError):
    """A node patch that would touch a key that is not ours (a bug: never sent)."""


def check_own_keys(patch: NodePatch, driver_name: str) -> None:
    """Defence in depth for the contract's "never writes the upgrade-state label ..."."""
    labels = {key for key, _ in patch.labels}
    annotations = {key for key, _ in patch.annotations}
    if labels - {parked_label_key(driver_name)} or annotations - {
        record_annotation_key(driver_name)
    }:
        raise ForeignKeyError(
            f"refusing to patch keys that are not ours: {sorted(labels | annotations)}"
        )


def daemonset_path(namespace: str, name: str) -> str:
    return DAEMONSETS.item(name, namespace)


async def list_nodes(api: ApiClient, label_selector: str) -> list[K8sObject]:
    data = await raw_request(
        api, "GET", NODES.collection(), query=[("labelSelector", label_selector)]
    )
    return list(data.get("items") or [])


def pods_field_selector(node: str, skip_namespace: str | None = None) -> str:
    """The pods bound to ``node``, but those of ``skip_namespace`` (``pods.pods_read``).
    The API server's watch cache of pods is indexed by ``spec.nodeName``: the other
    requirement filters the node's few pods, not the cluster's."""
    selector = f"spec.nodeName={node}"
    return selector + (f",metadata.namespace!={skip_namespace}" if skip_namespace else "")


# A pass's pod lists: of each pod, only what the planner reads (``consumers.POD_READS``).
PASS_PODS = Decoder(POD_READS)


async def pods_on_node(
    api: ApiClient, node: str, skip_namespace: str | None = None
) -> list[K8sObject]:
    """A consistent list (no ``resourceVersion``: as of now, served from the API server's
    watch cache once it has caught up; docs/decisions.md): a pod bound just before is in it.
    Of each pod, the fields the planner reads (:data:`PASS_PODS`)."""
    query = [("fieldSelector", pods_field_selector(node, skip_namespace))]
    data = await raw_request(api, "GET", PODS.collection(), query=query, fast=PASS_PODS.page)
    return list(data.get("items") or [])


async def driver_pods_on_node(api: ApiClient, node: str, namespace: str) -> list[K8sObject]:
    """The driver pods of ``namespace`` bound to ``node`` (``paths.driver_pod_selector``):
    one or two small pods, from the API server's watch cache by its ``spec.nodeName`` index."""
    query = [
        ("fieldSelector", pods_field_selector(node)),
        ("labelSelector", driver_pod_selector()),
    ]
    data = await raw_request(
        api, "GET", PODS.collection(namespace), query=query, fast=PASS_PODS.page
    )
    return list(data.get("items") or [])


async def list_daemonsets(api: ApiClient) -> list[K8sObject]:
    data = await raw_request(api, "GET", DAEMONSETS.collection())
    return list(data.get("items") or [])


async def client_label_on_nodes(api: ApiClient) -> bool:
    """Whether some node carries gpu-operator's ``nvidia.com/gpu.deploy.client`` label (one
    item asked for: the answer, not the fleet)."""
    query = [("labelSelector", CLIENT_HOOK_KEY), ("limit", "1")]
    data = await raw_request(api, "GET", NODES.collection(), query=query, accept=METADATA_LIST)
    return bool(data.get("items"))


async def read_daemonset(api: ApiClient, namespace: str, name: str) -> K8sObject | None:
    try:
        ds: K8sObject = await raw_request(api, "GET", daemonset_path(namespace, name))
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return ds


async def patch_daemonset_template(
    api: ApiClient,
    daemonset: K8sObject,
    *,
    required: dict[str, Any] | None,
    labels: dict[str, str],
    dry_run: bool,
) -> K8sObject:
    """One merge patch (one rollout), guarded by resourceVersion: replace the template's
    required node affinity (when ``required``) and add ``labels`` to the template's labels."""
    meta = daemonset["metadata"]
    template: dict[str, Any] = {}
    if required is not None:
        template["spec"] = {
            "affinity": {
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}
            }
        }
    if labels:
        template["metadata"] = {"labels": labels}
    body = {
        "metadata": {"resourceVersion": meta["resourceVersion"]},
        "spec": {"template": template},
    }
    query = [("fieldManager", FIELD_MANAGER)] + ([("dryRun", "All")] if dry_run else [])
    result: K8sObject = await raw_request(
        api,
        "PATCH",
        daemonset_path(meta["namespace"], meta["name"]),
        body=body,
        content_type=MERGE_PATCH,
        query=query,
    )
    return result


def upgrade_write_limiter(config: Config) -> BucketRateLimiter:
    """The one token bucket all writes of the upgrade controller wait for."""
    return BucketRateLimiter(
        config.upgrade_writes_per_second, config.upgrade_writes_burst, clock=time.monotonic
    )


class UpgradeIO(Protocol):
    """The API calls of the controller (:class:`KubeUpgradeIO`; tests run the controller
    on a fake with these methods)."""

    # The pods bound to the node, but those of ``skip_namespace`` (``pods.pods_read``).
    async def pods_on_node(
        self, name: str, skip_namespace: str | None = None
    ) -> list[K8sObject]: ...
    # The driver pods of ``namespace`` bound to the node (``pods.PodRead.driver_pods``).
    async def driver_pods_on_node(self, name: str, namespace: str) -> list[K8sObject]: ...
    async def patch_node(self, patch: NodePatch) -> str: ...  # the node's resourceVersion after it
    async def evict(self, action: PodAction) -> str: ...
    async def delete_pod(self, action: PodAction) -> str: ...


class KubeUpgradeIO:
    """The controller's API calls on the API server (:class:`UpgradeIO`)."""

    def __init__(
        self,
        api: ApiClient,
        driver_name: str,
        *,
        write_limiter: BucketRateLimiter,
        dry_run: bool = False,
        is_leader: Callable[[], bool] = lambda: True,
    ) -> None:
        self._api = api
        self._driver = driver_name
        # Every write waits for one of its tokens (``upgrade_write_limiter``) and is sent
        # only by the leader, never in dry-run (``kube.writer.write_mode``).
        self.writer = Writer(api, bucket=write_limiter, dry_run=dry_run, is_leader=is_leader)

    async def pods_on_node(self, name: str, skip_namespace: str | None = None) -> list[K8sObject]:
        return await pods_on_node(self._api, name, skip_namespace)

    async def driver_pods_on_node(self, name: str, namespace: str) -> list[K8sObject]:
        return await driver_pods_on_node(self._api, name, namespace)

    async def patch_node(self, patch: NodePatch) -> str:
        """Sends the patch; returns the node's resourceVersion after it."""
        check_own_keys(patch, self._driver)
        try:
            patched: K8sObject = await self.writer.send(
                "patch",
                "PATCH",
                NODES.item(patch.node),
                body=patch.body(),
                content_type=MERGE_PATCH,
                query=[("fieldManager", FIELD_MANAGER)],
                accept=METADATA,  # the answer is not read: the node's metadata is the least
            )
        except ApiException as exc:
            if exc.status == 409:
                raise NodeChanged(patch.node) from exc
            raise
        return str(patched.get("metadata", {}).get("resourceVersion", ""))

    async def evict(self, action: PodAction) -> EvictOutcome:
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": action.name, "namespace": action.namespace},
            "deleteOptions": {"preconditions": {"uid": action.uid}},
        }
        try:
            # The endpoint of CoreV1Api.create_namespaced_pod_eviction, with a raw body.
            await self.writer.send(
                "evict", "POST", PODS.item(action.name, action.namespace, "eviction"), body=body
            )
        except ApiException as exc:
            if exc.status == 429 and refused_by_disruption_budget(exc):
                return "blocked"  # a PodDisruptionBudget says no (for now)
            # Any other 429 is the API server shedding load (API Priority and Fairness,
            # max-in-flight), not a budget: the pass fails and is retried after the backoff.
            if exc.status in (404, 409):
                return "gone"  # gone, or a successor with another uid: not ours to evict
            raise
        return "evicted"

    async def delete_pod(self, action: PodAction) -> EvictOutcome:
        path = PODS.item(action.name, action.namespace)
        uid = {"uid": action.uid}  # a successor of the same name is not ours: gone too
        deleted = await self.writer.delete_at(path, uid, successor_is_gone=True)
        return "evicted" if deleted else "gone"
