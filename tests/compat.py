"""The compatibility suite (issue 31): the tests that run on every Kubernetes version of the
test control plane (``testenv.kube_versions()``), marked ``compat`` by ``tests/conftest.py``.

``make test`` runs the whole suite on the default version (1.36) and ``pytest -m compat
--kube-version <minor>`` on each other one (docs/development.md, "Kubernetes versions").
An entry is a test file (all of its tests) or one test of it (``file::name``, every
parametrization). What is here: the API semantics the product relies on, the Services
controller end to end, the guard as ``helm install`` renders it on that server, the upgrade
controller's node flow and its DRA exclusion, the real gpu-operator next to the guard, and the version itself.
"""

from __future__ import annotations

SUITE = (
    # The version in use is the one asked for; what each version needs (warnings, the
    # fields a version adds); the chart's guard as helm install decides it on that server.
    "tests/test_compat.py",
    # The API semantics shared-svc relies on: SSA keys, owner references, conflicts,
    # preconditions, Events with series, Leases, the CRDs.
    "tests/test_apiserver_semantics.py",
    "tests/test_cache_memory.py",
    "tests/test_node_metadata_cache.py",
    # The Services controller end to end: Events, adoption keeping the clusterIP, both
    # migrations, deletes, the steady state writing nothing.
    "tests/test_controller_acceptance.py::test_cluster_policy_exposes_only_the_legacy_names",
    "tests/test_controller_acceptance.py::test_adopts_services_created_by_gpu_operator_keeping_cluster_ip",
    "tests/test_controller_acceptance.py::test_migration_between_stacks_keeps_stable_services_and_cluster_ips",
    "tests/test_controller_acceptance.py::test_deleted_cr_releases_and_deletes_but_foreign_owner_keeps",
    "tests/test_adoption_takeover.py::test_adopted_objects_release_what_the_cr_no_longer_sets",
    "tests/test_adoption_takeover.py::test_repeated_adoptions_are_one_event_with_a_series",
    "tests/test_controller_events.py::test_a_repeat_of_a_known_event_is_one_write",
    "tests/test_controller_reconcile_loop.py::test_steady_state_writes_nothing",
    "tests/test_controller_lifecycle.py::test_two_replicas_one_writer_and_handover",
    # The upgrade controller walking a node through the whole state sequence.
    "tests/test_upgrade_freeing.py::test_whole_upgrade_sequence_frees_and_restores",
    # Its DRA exclusion where the version has DRA on (1.34 on), an ordinary consumer before.
    "tests/test_upgrade_freeing.py::test_a_pod_with_dra_claims_is_left_to_gpu_operator",
    # The real gpu-operator next to the guard helm install renders on that server.
    "tests/test_compat_gpu_operator.py",
)


def entries() -> dict[str, frozenset[str] | None]:
    """File -> the test names listed of it (None: all of them)."""
    out: dict[str, set[str] | None] = {}
    for entry in SUITE:
        path, _, name = entry.partition("::")
        if not name:
            out[path] = None
        elif path not in out or out[path] is not None:
            names = out.setdefault(path, set())
            assert names is not None
            names.add(name)
    return {path: None if names is None else frozenset(names) for path, names in out.items()}


def in_suite(path: str, name: str) -> bool:
    """Whether the test ``name`` (without its parametrization) of ``path`` (relative to
    the checkout) is in the suite."""
    listed = entries()
    if path not in listed:
        return False
    names = listed[path]
    return names is None or name in names
