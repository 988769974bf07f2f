"""Markdown as the docs tests read it: fenced code blocks, prose, links, headings and
GitHub's anchors (``tests/test_docs.py`` and the chart's and alerts' tests)."""

from __future__ import annotations

import re

FENCE = re.compile(r"^[ \t]*(```|~~~)([^\n]*)\n(.*?)^[ \t]*\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[(?:[^\]\n]|\][^(])*?\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of each fenced block."""
    return [(m.group(2).strip(), m.group(3)) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text without fenced blocks and inline code (where a link is not a link)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", text)):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out
