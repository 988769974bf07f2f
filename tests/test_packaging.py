"""The container image, as far as it can be proven without a Docker engine.

The Dockerfile's lines (base image by digest, dependencies from requirements.lock with
``--require-hashes``, no pip in the final stage, OCI labels) are read statically, and the
lock is checked against pyproject.toml and the base image's Python (scripts/lock.py).

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

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import pytest

from shared_svc import __version__
from testenv import ControlPlane, free_port

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
    assert builder[0] == "FROM ${PYTHON_IMAGE} AS builder" and final[0] == "FROM ${PYTHON_IMAGE}"
    assert "USER 65532:65532" in final
    setup = next(line for line in final if line.startswith("RUN "))
    assert "--uid 65532" in setup and "--gid 65532" in setup
    assert 'ENTRYPOINT ["shared-svc"]' in final and 'CMD ["run"]' in final
    # the final stage gets the builder's venv, nothing from the build context
    assert [line for line in final if line.startswith(("COPY", "ADD"))] == [
        "COPY --from=builder /opt/venv /opt/venv"
    ]
    assert any(line.startswith("ENV ") and "PATH=/opt/venv/bin:$PATH" in line for line in final)


def test_base_image_is_pinned_by_digest() -> None:
    arg = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert arg and re.fullmatch(r"python:3\.11-slim@sha256:[0-9a-f]{64}", arg.group(1)), arg


def test_dependencies_come_from_the_lock_with_hashes() -> None:
    builder, _ = stages()
    assert "COPY requirements.lock ./" in builder
    venv = next(line for line in builder if "requirements.lock" in line and line.startswith("RUN"))
    assert "python -m venv --without-pip /opt/venv" in venv
    assert "install --no-deps --require-hashes -r requirements.lock" in venv
    # shared-svc itself: its wheel only (no resolver, no index), then the set is checked
    wheel = next(line for line in builder if line.startswith("RUN pip wheel "))
    assert "pip wheel --no-deps" in wheel
    assert "install --no-deps --no-index /wheels/shared_svc-" in wheel and " check" in wheel
    # the dependencies are installed before the sources are copied (a layer per lock)
    assert builder.index(venv) < builder.index("COPY shared_svc/ shared_svc/")
    # no install resolves anything: every one is --no-deps
    installs = [
        step
        for line in builder
        if line.startswith("RUN ")
        for step in line[4:].split("&&")
        if re.search(r"\binstall\b", step) and "pip" in step
    ]
    assert len(installs) == 2 and all("--no-deps" in step for step in installs), installs


def test_final_stage_has_no_pip() -> None:
    _, final = stages()
    runs = [line for line in final if line.startswith("RUN ")]
    (setup,) = runs
    # the base image's pip goes; the venv was made without one
    assert setup.startswith("RUN python -m pip uninstall --yes --quiet pip setuptools wheel")
    # pip's one use there is removing itself
    steps = [step.strip() for line in runs for step in line[4:].split("&&")]
    assert [s for s in steps if "pip" in s] == [
        "python -m pip uninstall --yes --quiet pip setuptools wheel"
    ]


def test_image_carries_oci_labels_from_build_args() -> None:
    _, final = stages()
    assert "ARG VERSION=0.1.0" in final and "ARG REVISION=unknown" in final
    assert f"ARG VERSION={__version__}" in final, "the default is the package's version"
    (label,) = [line for line in final if line.startswith("LABEL ")]
    labels = dict(re.findall(r'(org\.opencontainers\.image\.[a-z.]+)="([^"]*)"', label))
    assert labels["org.opencontainers.image.version"] == "${VERSION}"
    assert labels["org.opencontainers.image.revision"] == "${REVISION}"
    assert labels["org.opencontainers.image.title"] == "shared-svc"
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.base.name"] == "${PYTHON_IMAGE}"


def lock_script() -> Any:
    spec = importlib.util.spec_from_file_location("lock", REPO / "scripts" / "lock.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lock_is_fresh() -> None:
    """CI fails while requirements.lock does not match pyproject.toml and the base image."""
    lock = lock_script()
    found = lock.problems(
        (REPO / "pyproject.toml").read_text(),
        DOCKERFILE.read_text(),
        (REPO / "requirements.lock").read_text(),
    )
    assert not found, f"requirements.lock is stale ({'; '.join(found)}): run `make lock`"
    # every dependency of pyproject is pinned and hashed
    entries = lock.entries((REPO / "requirements.lock").read_text())
    for dep in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        name = re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0].lower().replace("_", "-")
        assert entries[name][1] >= 1, dep


def test_lock_check_fails_on_a_stale_lock() -> None:
    lock = lock_script()
    pyproject = (REPO / "pyproject.toml").read_text()
    dockerfile = DOCKERFILE.read_text()
    text = (REPO / "requirements.lock").read_text()
    assert lock.problems(pyproject, dockerfile, text) == []
    # a dependency added, a bound moved, or another Python: the recorded inputs differ
    added = pyproject.replace('"PyYAML>=6,<7",', '"PyYAML>=6,<7",\n    "rich>=13",')
    assert any("rich: not in the lock" in p for p in lock.problems(added, dockerfile, text))
    assert any("other inputs" in p for p in lock.problems(added, dockerfile, text))
    moved = pyproject.replace('"aiohttp>=3.9,<4"', '"aiohttp>=3.9,<3.10"')
    assert moved != pyproject
    found = lock.problems(moved, dockerfile, text)
    assert any("does not satisfy" in p for p in found) and any("other inputs" in p for p in found)
    python312 = dockerfile.replace("python:3.11-slim@", "python:3.12-slim@")
    assert any("Python 3.12" in p for p in lock.problems(pyproject, python312, text))
    # an entry without hashes, or a requirement that is not pinned
    unhashed = re.sub(
        r"^(pyyaml==\S+) \\\n(\s+--hash=\S+ \\\n)*\s+--hash=\S+", r"\1", text, flags=re.M
    )
    assert unhashed != text
    assert any("no hash" in p for p in lock.problems(pyproject, dockerfile, unhashed))
    unpinned = text + "requests>=2\n"
    assert any("pinned" in p for p in lock.problems(pyproject, dockerfile, unpinned))


def test_dockerignore_lets_in_exactly_what_the_builder_copies() -> None:
    lines = [
        x.strip()
        for x in (REPO / ".dockerignore").read_text().splitlines()
        if x.strip() and not x.startswith("#")
    ]
    assert lines[0] == "*", "everything is excluded unless named"
    allowed = {x[1:].rstrip("/") for x in lines if x.startswith("!")}
    assert allowed == set(builder_sources())
    assert allowed == {"requirements.lock", "pyproject.toml", "README.md", "shared_svc"}


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


# What only the checkout needs: the test control plane, the demo, example worlds and fakes,
# test CRDs, tests, benchmarks, scripts, the chart.
DEV_FILE = re.compile(
    r"(?:^|/)(?:testenv|tests?|proptests|benchmarks|scripts|deploy|crds)(?:/|_|\.py$)"
    r"|(?:^|/)(?:demo|examples?|fakes?)[^/]*\.py$"
)


def test_wheel_holds_the_product_only(wheel: Path) -> None:
    """``shared_svc`` and its metadata: no development module, test CRD or test file."""
    names = zipfile.ZipFile(wheel).namelist()
    code = [n for n in names if not n.split("/", 1)[0].endswith(".dist-info")]
    assert {n.split("/", 1)[0] for n in code} == {"shared_svc"}, code
    assert "shared_svc/py.typed" in names
    dev = [n for n in code if DEV_FILE.search(n)]
    assert not dev, f"development files in the wheel: {dev}"
    assert all(n.endswith(".py") for n in code if n != "shared_svc/py.typed"), code
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "shared-svc = shared_svc.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_dev_file_pattern_names_the_development_modules() -> None:
    for dev in (
        "shared_svc/testenv.py",
        "shared_svc/testenv_workloads.py",
        "shared_svc/commands/testenv.py",
        "shared_svc/commands/demo_gpu_operator.py",
        "shared_svc/upgrade/examples.py",
        "shared_svc/crds/nvidia.com_gpuclusters.yaml",
        "tests/svc.py",
        "testenv/__init__.py",
    ):
        assert DEV_FILE.search(dev), dev
    for product in ("shared_svc/kube/cache.py", "shared_svc/commands/upgrade.py"):
        assert not DEV_FILE.search(product), product


def wheel_modules(names: list[str]) -> dict[str, str]:
    """Module name -> path, for the ``.py`` files of a wheel's file list."""
    out = {}
    for n in names:
        if n.endswith(".py") and ".dist-info/" not in n:
            out[n[: -len(".py")].replace("/", ".").removesuffix(".__init__")] = n
    return out


def reached_from_the_entry_point(files: dict[str, str]) -> set[str]:
    """The modules (of ``files``: module name -> source) that ``shared_svc.cli`` can import:
    every import statement (also inside functions), and every string constant that names
    a module (``importlib.import_module`` of the command table), followed to the end."""
    import ast

    reached: set[str] = set()
    todo = ["shared_svc.cli", "shared_svc.__main__"]
    while todo:
        name = todo.pop()
        if name in reached or name not in files:
            continue
        reached.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parents run first
        is_package = any(m.startswith(f"{name}.") for m in files)
        package = name if is_package else ".".join(parts[:-1])
        for node in ast.walk(ast.parse(files[name])):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                todo += [base, *(f"{base}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                todo.append(node.value)
    return reached


def test_every_module_in_the_wheel_is_reached_from_the_command(wheel: Path) -> None:
    """A module no command can import (a fake, an example world) has no place in the wheel."""
    archive = zipfile.ZipFile(wheel)
    modules = wheel_modules(archive.namelist())
    sources = {m: archive.read(path).decode() for m, path in modules.items()}
    unreached = sorted(set(modules) - reached_from_the_entry_point(sources))
    assert not unreached, f"modules in the wheel that no shared-svc command imports: {unreached}"


def test_reachability_follows_relative_lazy_and_named_imports() -> None:
    files = {
        "shared_svc": "",
        "shared_svc.cli": "import importlib\ndef main():\n    from . import lazy\n"
        "    importlib.import_module('shared_svc.commands.run')\n",
        "shared_svc.lazy": "from .pkg.mod import thing\n",
        "shared_svc.pkg": "from . import first\n",
        "shared_svc.pkg.first": "",
        "shared_svc.pkg.mod": "from ..pkg import sibling\n",
        "shared_svc.pkg.sibling": "",
        "shared_svc.commands": "",
        "shared_svc.commands.run": "",
        "shared_svc.upgrade.examples": "from shared_svc.pkg import mod\n",
    }
    reached = reached_from_the_entry_point(files)
    assert reached == set(files) - {"shared_svc.upgrade.examples"}


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
            "import shared_svc; print(shared_svc.__file__)",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=venv,
    ).stdout.strip()
    assert where.startswith(str(venv)), where


def test_installed_command_has_no_development_commands(venv: Path) -> None:
    """``demo`` and ``testenv`` need a checkout (``python -m testenv``): not offered here."""
    command = str(venv / "bin" / "shared-svc")
    help_text = subprocess.run(
        [command, "--help"], capture_output=True, text=True, check=True, cwd=venv
    ).stdout
    assert all(re.search(rf"^\s+{c}\b", help_text, re.M) for c in ("run", "plan", "upgrade"))
    assert not re.search(r"\b(?:demo|testenv)\b", help_text), help_text
    for dev in ("demo", "testenv"):
        proc = subprocess.run([command, dev], capture_output=True, text=True, cwd=venv)
        assert proc.returncode == 2 and "invalid choice" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


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
