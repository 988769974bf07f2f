"""requirements.lock: the image's runtime dependencies, pinned with hashes.

    make lock                    # = .venv/bin/python scripts/lock.py
    make lock UPGRADE=1          # newest versions pyproject allows (else pins are kept)
    .venv/bin/python scripts/lock.py --check

Generates the lock with pip-tools (``pip-compile --generate-hashes`` on pyproject.toml's
``[project.dependencies]``, for the Python of the Dockerfile's base image) and puts a line
on top recording what it was made from: a hash of those dependencies and that Python
version. ``--check`` (and tests/test_packaging.py, without network) recomputes the hash and
checks that every dependency has a pinned, hashed entry satisfying its specifier.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "requirements.lock"
PYPROJECT = REPO / "pyproject.toml"
DOCKERFILE = REPO / "Dockerfile"
INPUTS = re.compile(r"^# inputs: sha256:([0-9a-f]{64}) python=(\d+\.\d+)$", re.M)
ENTRY = re.compile(
    r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s*\\\n\s*--hash=sha256:[0-9a-f]{64})*)", re.M
)


def dependencies(pyproject: str) -> list[str]:
    """pyproject.toml's [project.dependencies], as written."""
    return list(tomllib.loads(pyproject)["project"]["dependencies"])


def target_python(dockerfile: str) -> str:
    """The Python version of the Dockerfile's base image (ARG PYTHON_IMAGE=python:X.Y-...)."""
    found = re.search(r"^ARG PYTHON_IMAGE=python:(\d+\.\d+)[-@:]", dockerfile, re.M)
    if not found:
        raise ValueError("Dockerfile: no `ARG PYTHON_IMAGE=python:X.Y-...` line")
    return found.group(1)


def inputs_hash(deps: list[str], python: str) -> str:
    canonical = json.dumps({"dependencies": sorted(deps), "python": python}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def inputs_line(deps: list[str], python: str) -> str:
    return f"# inputs: sha256:{inputs_hash(deps, python)} python={python}"


def entries(lock: str) -> dict[str, tuple[str, int]]:
    """Locked package (canonical name) -> (version, number of hashes)."""
    return {
        canonicalize_name(m.group(1)): (m.group(2), m.group(3).count("--hash=sha256:"))
        for m in ENTRY.finditer(lock)
    }


def problems(pyproject: str, dockerfile: str, lock: str) -> list[str]:
    """Why the lock does not match pyproject and the Dockerfile (empty: it does)."""
    deps, python = dependencies(pyproject), target_python(dockerfile)
    out = []
    recorded = INPUTS.search(lock)
    if not recorded:
        out.append("no `# inputs: sha256:... python=X.Y` line")
    elif (recorded.group(1), recorded.group(2)) != (inputs_hash(deps, python), python):
        out.append(
            "made from other inputs than pyproject's [project.dependencies] and "
            f"Python {python} (the Dockerfile's base image)"
        )
    locked = entries(lock)
    requirement_lines = [
        line
        for line in lock.splitlines()
        if line and not line[0].isspace() and not line.startswith(("#", "--"))
    ]
    if len(requirement_lines) != len(locked):
        out.append("every requirement must be pinned with == and hashed (pip --require-hashes)")
    out += [f"{name}=={version} has no hash" for name, (version, n) in locked.items() if not n]
    for dep in deps:
        req = Requirement(dep)
        name = canonicalize_name(req.name)
        if name not in locked:
            out.append(f"{req.name}: not in the lock")
        elif not req.specifier.contains(locked[name][0], prereleases=True):
            out.append(f"{req.name}=={locked[name][0]} does not satisfy {dep!r}")
    return out


def check() -> int:
    if not LOCK.exists():
        print("requirements.lock is missing: run `make lock`", file=sys.stderr)
        return 1
    found = problems(PYPROJECT.read_text(), DOCKERFILE.read_text(), LOCK.read_text())
    for problem in found:
        print(f"requirements.lock is stale: {problem}; run `make lock`", file=sys.stderr)
    return 1 if found else 0


def generate(upgrade: bool) -> int:
    deps, python = dependencies(PYPROJECT.read_text()), target_python(DOCKERFILE.read_text())
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    if running != python:
        print(
            f"lock: the image runs Python {python}; run this with Python {python}, not {running}",
            file=sys.stderr,
        )
        return 2
    # PyPI only (hashes of every file of a version), and the command its header names
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_NO_INDEX")}
    env["CUSTOM_COMPILE_COMMAND"] = "make lock"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "requirements.lock"
        if LOCK.exists():
            out.write_text(LOCK.read_text())  # pip-compile keeps the pins that still fit
        args = [sys.executable, "-m", "piptools", "compile", "--quiet", "--generate-hashes"]
        args += ["--strip-extras", "--allow-unsafe", "--no-emit-index-url", "--no-emit-find-links"]
        args += ["--output-file", str(out)]
        args += ["--upgrade"] if upgrade else []
        # Relative to the repository, so its "via" lines name no path of this machine.
        proc = subprocess.run([*args, PYPROJECT.name], cwd=REPO, env=env, check=False)
        if proc.returncode != 0:
            print("lock: pip-compile failed (pip install pip-tools?)", file=sys.stderr)
            return 1
        body = out.read_text()
    header = [
        "# requirements.lock: shared-svc's runtime dependencies for the image, pinned with",
        "# hashes (Dockerfile: pip install --require-hashes). Regenerate with `make lock`.",
        inputs_line(deps, python),
    ]
    LOCK.write_text("\n".join(header) + "\n" + body)
    print(f"wrote {LOCK.relative_to(REPO)}", file=sys.stderr)
    return check()


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        return check()
    if argv in ([], ["--upgrade"]):
        return generate(upgrade=bool(argv))
    print("usage: scripts/lock.py [--check | --upgrade]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
