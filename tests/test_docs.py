"""The docs site as a reader sees it: built with ``mkdocs build --strict``, every snippet include
expanded and no code block empty (a formatter once turned ``--8<--`` into ``--8 < --``, which
renders as literal text and passes a strict build)."""

from __future__ import annotations

import html
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
UNEXPANDED = re.compile(r"--8\s*<\s*--")
CODE_BLOCK = re.compile(r"<pre[^>]*>(?:<span></span>)?<code[^>]*>(.*?)</code></pre>", flags=re.S)

pytest.importorskip("mkdocs")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def code_blocks(site: pathlib.Path) -> dict[str, list[str]]:
    """Each page's code blocks as the reader sees them (highlighting spans stripped)."""
    found = {}
    for page in sorted(site.rglob("index.html")):
        blocks = CODE_BLOCK.findall(page.read_text())
        found[str(page.parent.relative_to(site))] = [
            html.unescape(re.sub(r"<[^>]+>", "", b)) for b in blocks
        ]
    assert len(found) > 10, "the site built almost no pages"
    return found


def test_every_snippet_include_is_expanded(site) -> None:
    bad = [
        p for p, blocks in code_blocks(site).items() if any(UNEXPANDED.search(b) for b in blocks)
    ]
    assert not bad, f"unexpanded '--8<--' includes on {bad}"


def test_no_code_block_is_empty(site) -> None:
    bad = [p for p, blocks in code_blocks(site).items() if any(not b.strip() for b in blocks)]
    assert not bad, f"empty code blocks on {bad}"


def test_own_model_pages_show_their_code(site) -> None:
    """The two pages that teach the public API show the example files' code, not a marker."""
    blocks = code_blocks(site)
    for page, name in [
        ("shard_your_own_model", "ShardedModel("),
        ("verify_your_model", "compare_sharded("),
    ]:
        assert len(blocks[page]) >= 5 and any(name in b for b in blocks[page]), page
