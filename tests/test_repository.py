"""The repository stands on its own: a fresh clone anywhere runs its tests and reads its docs.

No file refers to a path of the machine it was written on, or to anything beside the
checkout (the design documents and data next to it on the development machine); every
``docs/*.md`` a file names exists.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", ".venv", "build", "dist", "__pycache__"}

# Spelt with a character class so that this file does not match itself.
ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/(?:wor[k]|roo[t]|hom[e]|User[s])/")
BESIDE_THE_CHECKOUT = re.compile(
    r"\.\./share[d]\b"
    r"|(?<![\w-])share[d]/(?:design|crds|facts)\b"
    r"""|["']share[d]["']\s*/\s*["'](?:design|crds|facts)["']"""
)
DOC_REFERENCE = re.compile(r"(?<![\w/.-])docs/[\w./-]+\.md")


def repository_files() -> list[Path]:
    """The files a clone holds: git's view (tracked and new, not ignored), else a walk."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [
            str(p.relative_to(REPO))
            for p in REPO.rglob("*")
            if p.is_file()
            and not SKIP_DIRS & set(p.relative_to(REPO).parts)
            and not any(part.endswith((".egg-info", "_cache")) for part in p.parts)
        ]
    return [REPO / n for n in names if (REPO / n).is_file()]


def text_files() -> dict[str, str]:
    out = {}
    for path in repository_files():
        try:
            out[str(path.relative_to(REPO))] = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
    return out


def hits(pattern: re.Pattern[str]) -> list[str]:
    return [
        f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for name, text in sorted(text_files().items())
        for m in pattern.finditer(text)
    ]


def test_the_scan_sees_the_repository() -> None:
    names = text_files()
    assert {"README.md", "tests/conftest.py", "shared_svc/upgrade/__init__.py"} <= names.keys()
    shared = "share" + "d"  # (not spelt out: this file must pass its own scan)
    machine = "/" + "work"
    assert ABSOLUTE_PATH.search(f"see {machine}/{shared}/design/upgrade-release.md")
    assert BESIDE_THE_CHECKOUT.search(f"read '../{shared}/crds' first")
    assert BESIDE_THE_CHECKOUT.search(f"parents[2] / '{shared}/crds'")
    assert BESIDE_THE_CHECKOUT.search(f'parents[2] / "{shared}" / "crds"')
    assert not BESIDE_THE_CHECKOUT.search("shared_svc/crds/ and shared-svc/design")


def test_no_absolute_path_of_the_machine() -> None:
    assert hits(ABSOLUTE_PATH) == []


def test_nothing_refers_to_files_beside_the_checkout() -> None:
    assert hits(BESIDE_THE_CHECKOUT) == []


def test_every_named_doc_exists() -> None:
    missing = [
        f"{name}: {ref}"
        for name, text in sorted(text_files().items())
        for ref in DOC_REFERENCE.findall(text)
        if not (REPO / ref).is_file()
    ]
    assert missing == []
