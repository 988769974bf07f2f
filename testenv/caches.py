"""Caches filled in this process as their lists and watches fill them, with no API
server: for the tests, the benchmarks and the example controllers (``upgrade_examples``).

A cache is the product's own (``kube.reflector.Cache``, from a
``kube.registry.CacheRegistry`` whose caches are never run); :func:`fill` hands it a
complete list (``Cache.replace``, client-go's ``Store.Replace``), :func:`deliver` one
watch event (``Cache.apply``), so its handlers hear of it as they would in production."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shared_svc.k8s.objects import K8sObject
from shared_svc.k8s.selectors import parse_selector
from shared_svc.kube.reflector import Cache
from shared_svc.kube.registry import AnyCache, CacheRegistry


def offline_registry() -> CacheRegistry:
    """A registry whose caches are made but never listed nor watched (no API client)."""
    api: Any = None
    return CacheRegistry(api)


def _parts(cache: AnyCache) -> tuple[Cache, ...]:
    return cache.parts if not isinstance(cache, Cache) else (cache,)


def selects(cache: Cache, obj: K8sObject) -> bool:
    """Whether ``obj`` is one the cache's list or watch brings (its label selector)."""
    selector = cache.resource.label_selector
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return not selector or parse_selector(selector).matches(labels)


def fill(cache: AnyCache, objects: Iterable[K8sObject], resource_version: str = "100") -> None:
    """The cache as a complete list of ``objects`` leaves it (what ``relist`` does after
    its pages): each cache (each part of a union) holds those its selector brings."""
    objects = list(objects)
    for part in _parts(cache):
        mine = [o for o in objects if selects(part, o)]
        keys = [(o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in mine]
        versions = {
            key: str(o["metadata"].get("resourceVersion", ""))
            for key, o in zip(keys, mine, strict=True)
        }
        # As a list's pages do: an object at the version cached keeps its cached object.
        items = {
            key: held
            if (held := part.get(key[1], key[0])) is not None
            and versions[key]
            and part.cached_version(key) == versions[key]
            else part.resource.kept(o)
            for key, o in zip(keys, mine, strict=True)
        }
        part.replace(items, versions, served=True, resource_version=resource_version)


def deliver(cache: AnyCache, obj: K8sObject, *, deleted: bool = False) -> None:
    """``obj`` as the cache's watch brings it: added or modified while its selector
    selects it, deleted once it no longer does (or ``deleted``)."""
    meta = obj["metadata"]
    for part in _parts(cache):
        held = part.get(meta["name"], meta.get("namespace", "")) is not None
        if not deleted and selects(part, obj):
            part.apply("MODIFIED" if held else "ADDED", obj)
        elif held:
            part.apply("DELETED", obj)
