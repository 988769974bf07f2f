"""The container image, as far as it can be proven without a Docker engine.

The Dockerfile's builder stage runs ``pip wheel`` on the files it copies; here the same
files (and only those) are copied into an empty directory and built into a wheel the
same way. The wheel is installed with ``--no-deps`` into a fresh venv whose only other
packages are the project venv's (reached through a ``.pth`` line, which appends that
directory to ``sys.path`` without running its ``.pth`` hooks, so the project's editable
install stays invisible and the wheel's code is what runs). Dependencies therefore come
from the project venv instead of PyPI: nothing is downloaded at test time (as long as
the project venv can build a wheel itself, see ``offline_build_flags``). Then the
installed ``shared-svc run`` entry point serves ``/livez`` against the test control plane.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from shared_svc.testenv import ControlPlane, free_port

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"


def stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuations joined), one list per stage."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or (line.startswith("ARG") and not out):
            continue
        if line.startswith("FROM "):
            out.append([])
        out[-1].append(line)
    return out


def builder_sources() -> list[str]:
    """What the builder stage copies from the build context."""
    sources = []
    for line in stages()[0]:
        if line.startswith("COPY "):
            words = line.split()[1:]
            assert not any(w.startswith("--from") for w in words)
            sources += [w.rstrip("/") for w in words[:-1]]
    return sources


def test_dockerfile_is_multi_stage_slim_non_root() -> None:
    builder, final = stages()
    arg = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert arg and arg.group(1) == "python:3.11-slim"
    assert builder[0] == "FROM ${PYTHON_IMAGE} AS builder" and final[0] == "FROM ${PYTHON_IMAGE}"
    assert any(line.startswith("RUN pip wheel ") for line in builder)
    install = next(line for line in final if line.startswith("RUN "))
    assert "--no-index --find-links /wheels shared-svc" in install and "from=builder" in install
    assert "--uid 65532" in install and "--gid 65532" in install
    assert "USER 65532:65532" in final
    assert 'ENTRYPOINT ["shared-svc"]' in final and 'CMD ["run"]' in final
    assert not [line for line in final if line.startswith(("COPY", "ADD"))], (
        "the final stage gets only the wheels"
    )


def test_dockerignore_lets_in_exactly_what_the_builder_copies() -> None:
    lines = [
        x.strip()
        for x in (REPO / ".dockerignore").read_text().splitlines()
        if x.strip() and not x.startswith("#")
    ]
    assert lines[0] == "*", "everything is excluded unless named"
    allowed = {x[1:].rstrip("/") for x in lines if x.startswith("!")}
    assert allowed == set(builder_sources()) == {"pyproject.toml", "README.md", "shared_svc"}


def offline_build_flags() -> list[str]:
    """Build with the project venv's setuptools when it can build wheels by itself (it needs
    the ``wheel`` package below setuptools 70.1): nothing downloaded. Otherwise pip builds in
    an isolated environment and fetches pyproject's build requirements from the index."""
    import importlib.metadata
    import importlib.util

    version = tuple(int(p) for p in importlib.metadata.version("setuptools").split(".")[:2])
    if version >= (70, 1) or importlib.util.find_spec("wheel") is not None:
        return ["--no-index", "--no-build-isolation"]
    return []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built as the builder stage builds it, from the files it copies."""
    context = tmp_path_factory.mktemp("context")
    for source in builder_sources():
        path = REPO / source
        if path.is_dir():
            shutil.copytree(
                path, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(path, context / source)
    out = tmp_path_factory.mktemp("wheels")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            *offline_build_flags(),
            "-q",
            "-w",
            str(out),
            str(context),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    (built,) = out.glob("shared_svc-*.whl")
    return built


def test_wheel_carries_the_crds_and_type_marker(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    crds = {n.rsplit("/", 1)[1] for n in names if n.startswith("shared_svc/crds/")}
    assert crds == {p.name for p in (REPO / "shared_svc" / "crds").glob("*.yaml")} and crds
    assert "shared_svc/py.typed" in names
    assert not [
        n for n in names if n.startswith(("tests/", "proptests/", "benchmarks/", "deploy/"))
    ]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "shared-svc = shared_svc.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # The dependencies: the project venv's packages, appended after the venv's own.
    (Path(purelib) / "project-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
    )
    return root


def test_installed_package_is_the_wheel_not_the_source_tree(venv: Path) -> None:
    where = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import shared_svc.crds, shared_svc; print(shared_svc.__file__)",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=venv,
    ).stdout.strip()
    assert where.startswith(str(venv)), where


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.apiserver
def test_installed_entrypoint_serves_livez_against_the_control_plane(
    venv: Path, control_plane: ControlPlane, tmp_path: Path
) -> None:
    control_plane.ensure_namespace("packaging")
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SHARED_SVC_") and k not in ("KUBECONFIG", "OPERATOR_NAMESPACE")
    }
    env.update(
        {
            "OPERATOR_NAMESPACE": "packaging",
            "POD_NAME": "packaging-0",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    args = [str(venv / "bin" / "shared-svc"), "run", "--kubeconfig", str(control_plane.kubeconfig)]
    args += ["--bind-address", "127.0.0.1", "--port", str(port), "--leader-election", "false"]
    log = tmp_path / "shared-svc.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        answers: dict[str, tuple[int, str]] = {}
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                answers = {
                    path: _get(f"http://127.0.0.1:{port}{path}")
                    for path in ("/livez", "/readyz", "/status")
                }
            except OSError:
                answers = {}
            if answers and all(status == 200 for status, _ in answers.values()):
                break
            time.sleep(0.2)
        assert proc.poll() is None, f"shared-svc exited with {proc.returncode}:\n{log.read_text()}"
        assert answers["/livez"] == (200, "ok\n"), log.read_text()
        assert answers["/readyz"][0] == 200, log.read_text()
        status = json.loads(answers["/status"][1])
        assert status["identity"] == "packaging-0" and status["namespace"] == "packaging"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, f"SIGTERM must end the service cleanly:\n{log.read_text()}"
    assert "stopped" in log.read_text()
