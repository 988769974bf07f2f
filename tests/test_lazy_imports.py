"""kubernetes_asyncio's packages imported as used (``shared_svc.lazy_imports``, issue 22:
38 MiB of an idle ``run``): the names are the real ones, only what is used is loaded, and
an ``__init__`` that does more than bind names is imported as it is."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shared_svc.lazy_imports import bindings

PROBE = """
import json, sys
{first}
import shared_svc.service  # what ``run`` imports
loaded = sum(m.startswith("kubernetes_asyncio") for m in sys.modules)
from kubernetes_asyncio import client, config
names = {{n: getattr(client, n).__module__ for n in ("ApiClient", "CoreV1Api", "V1Pod", "ApiException")}}
print(json.dumps({{"loaded": loaded, "names": names, "config": config.load_kube_config.__module__,
                  "all": len(client.__all__), "version": client.__version__}}))
"""


def probe(first: str = "") -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_run_loads_a_few_modules_of_kubernetes_asyncio_and_the_names_are_the_real_ones() -> None:
    lazy, eager = probe(), probe("import kubernetes_asyncio")  # imported before: as it is
    assert {k: v for k, v in lazy.items() if k != "loaded"} == {
        k: v for k, v in eager.items() if k != "loaded"
    }
    assert lazy["names"] == {
        "ApiClient": "kubernetes_asyncio.client.api_client",
        "CoreV1Api": "kubernetes_asyncio.client.api.core_v1_api",
        "V1Pod": "kubernetes_asyncio.client.models.v1_pod",
        "ApiException": "kubernetes_asyncio.client.exceptions",
    }
    assert isinstance(lazy["loaded"], int) and isinstance(eager["loaded"], int)
    assert lazy["loaded"] < 40 < 800 < eager["loaded"]


def test_every_name_of_the_client_package_resolves_to_the_object_an_eager_import_binds() -> None:
    code = """
import json, importlib, sys
import shared_svc
from kubernetes_asyncio import client
lazy = {n: (getattr(client, n).__module__, getattr(client, n).__qualname__) for n in client.__all__}
print(json.dumps(lazy))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lazy = json.loads(out.stdout)
    import kubernetes_asyncio.client as real

    assert lazy == {
        n: [getattr(real, n).__module__, getattr(real, n).__qualname__] for n in real.__all__
    }
    assert len(lazy) > 800


@pytest.mark.parametrize(
    "source",
    [
        "from pkg.a import A\nsetup()\n",  # a call: a side effect
        "from other.a import A\n",  # a name from elsewhere
        "import pkg.a\n",  # a module bound under its own dotted name
        "from pkg.a import A\nif True:\n    B = 1\n",
        "X = compute()\n",
    ],
)
def test_an_init_that_does_more_than_bind_names_is_imported_as_it_is(source: str) -> None:
    assert bindings(source, "pkg") is None


def test_an_init_of_imports_and_constants_is_read_as_its_bindings() -> None:
    source = '"""doc"""\nfrom __future__ import annotations\n__version__ = "1"\nfrom pkg.a import A, B as C\nimport pkg.sub as sub\n'
    assert bindings(source, "pkg") == (
        {"A": ("pkg.a", "A"), "C": ("pkg.a", "B"), "sub": ("pkg.sub", "")},
        {"__version__": "1"},
    )
