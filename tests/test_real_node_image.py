"""The image as shipped (issue 30, item 6), built from the checkout's Dockerfile and run by
the real node's containerd: it runs as 65532 (its own USER, no securityContext asked),
works on a read-only root filesystem, carries no pip, its entry point is ``shared-svc``
and says the package's version, and its size is the one docs/development.md states."""

from __future__ import annotations

import json
import re

import pytest

from shared_svc import __version__
from testenv.node import Node
from tests.real_node import REPO, pod_manifest, run_pod

pytestmark = pytest.mark.node

NS = "image"
READ_ONLY = {"securityContext": {"readOnlyRootFilesystem": True}}
# What a process of the image finds: its user, pip (module or command), a writable root.
INSPECT = """
import importlib.util, json, os, shutil
try:
    open("/probe", "w")
    root = "writable"
except OSError as exc:
    root = exc.strerror
print(json.dumps({
    "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
    "pip_module": importlib.util.find_spec("pip") is not None,
    "pip_commands": [c for c in ("pip", "pip3", "pip3.11") if shutil.which(c)],
    "root": root,
    "path": os.environ["PATH"],
}))
"""


def test_the_image_config_is_the_dockerfiles(real_node: Node) -> None:
    config = real_node.builds.image_info()["config"]
    assert config["User"] == "65532:65532"
    assert config["Entrypoint"] == ["shared-svc"] and config["Cmd"] == ["run"]
    assert config["Labels"]["org.opencontainers.image.version"] == __version__


async def test_the_entry_point_says_the_package_version_on_a_read_only_root(
    real_node: Node,
) -> None:
    log = await run_pod(
        real_node.control_plane,
        NS,
        pod_manifest("version", container={"args": ["--version"], **READ_ONLY}),
    )
    assert log == f"shared-svc {__version__}\n"


async def test_it_runs_as_65532_without_pip_and_a_read_only_root_stays_read_only(
    real_node: Node,
) -> None:
    log = await run_pod(
        real_node.control_plane,
        NS,
        pod_manifest("inspect", ["python", "-c", INSPECT], container=READ_ONLY),
    )
    seen = json.loads(log)
    assert (seen["uid"], seen["gid"]) == (65532, 65532), seen
    assert not seen["pip_module"] and seen["pip_commands"] == [], seen
    assert seen["root"] == "Read-only file system", seen
    assert seen["path"].startswith("/opt/venv/bin:"), seen


def test_its_size_is_the_one_the_docs_state(real_node: Node) -> None:
    # The archive containerd imported: the image's layers, uncompressed.
    size_mb = (real_node.builds.images / "shared-svc.tar").stat().st_size / 1e6
    docs = (REPO / "docs" / "development.md").read_text()
    stated = re.search(r"The project's image\s+built\s+here\s+is\s+about\s+(\d+)\s+MB", docs)
    assert stated, "docs/development.md states the image's size"
    assert abs(size_mb - int(stated.group(1))) <= 0.1 * int(stated.group(1)), (
        f"the image is {size_mb:.0f} MB; docs/development.md says {stated.group(1)} MB"
    )
