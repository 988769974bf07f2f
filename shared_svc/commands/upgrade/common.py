"""What the ``shared-svc upgrade`` commands share: their settings, the connection, the
consumer selector and label, and the retry of a guarded patch after a 409."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from shared_svc.config import Config, add_flags, flag_values, load, unknown_env
from shared_svc.errors import UsageError

if TYPE_CHECKING:  # kubernetes_asyncio is imported only by the commands that connect
    from kubernetes_asyncio.client import ApiClient

    from shared_svc.k8s.selectors import Selector


T = TypeVar("T")


_PROTECTED_KEY_PREFIX = "nvidia.com/gpu.deploy."


# The settings these commands read, as ``shared-svc run`` names them (shared_svc.config).
SETTINGS = ("kubeconfig", "namespace", "upgrade_driver_name", "upgrade_consumer_selector")


def _common(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SETTINGS)


def _config(args: argparse.Namespace) -> Config:
    """The service's settings: these flags over the environment over the defaults."""
    for warning in unknown_env(os.environ):
        print(f"shared-svc: warning: {warning}", file=sys.stderr)
    return load(flag_values(args, SETTINGS))


def _run(args: argparse.Namespace, body: Callable[[ApiClient, Config], Awaitable[T]]) -> T:
    """Connect, run ``body(api, config)``, close; API trouble is one line (``commands.api``)."""
    from shared_svc.commands.api import with_api

    config = _config(args)
    return with_api(config.kubeconfig, lambda api: body(api, config))


def _consumer_selector(config: Config) -> Selector:
    """The consumer selector ``Config`` parsed and checked (a bad one is a one-line error
    when the configuration is read)."""
    from shared_svc.upgrade.settings import UpgradeSettings

    return UpgradeSettings.from_config(config).consumer_selector


def _consumer_labels(config: Config) -> dict[str, str]:
    """The declared consumer label(s) of the consumer selector (one line when it has none)."""
    from shared_svc.upgrade.gate import NoConsumerLabel, consumer_labels

    try:
        return consumer_labels(_consumer_selector(config))
    except NoConsumerLabel as exc:
        raise UsageError(f"upgrade_consumer_selector: {exc}") from None


# Tries of a guarded patch when its object changed meanwhile (409): client-go's
# RetryOnConflict, five tries.
CONFLICT_TRIES = 5


async def _retrying_conflicts(once: Callable[[], Awaitable[int]], what: str) -> int:
    """``once()`` (read, plan, guarded patch) again after a 409, up to CONFLICT_TRIES times."""
    from kubernetes_asyncio.client.exceptions import ApiException

    for attempt in range(1, CONFLICT_TRIES + 1):
        try:
            return await once()
        except ApiException as exc:
            if exc.status != 409 or attempt == CONFLICT_TRIES:
                raise
            print(f"{what} changed meanwhile: planning again", file=sys.stderr)
    raise AssertionError("unreachable")
