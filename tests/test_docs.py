"""The documentation runs as written: every Python block of the README and of the guides
(``docs/guide/*.md``) runs, a page's blocks in order in one namespace (a page is one
session), in a fresh directory.  A block that is deliberately partial starts with a
``# partial: <why>`` line and is only compiled.  The API reference is what
``docs/gen_api.py`` writes, and every ``docs/...`` path the README names exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
PARTIAL = "# partial:"


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(line, code) of every fenced Python block of ``page``."""
    text = page.read_text(encoding="utf-8")
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_python_block_runs(page, tmp_path, monkeypatch, capsys):
    blocks = python_blocks(page)
    assert blocks, f"{page.name} has no Python block"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for line, code in blocks:
        compiled = compile(code, f"{page.name}:{line}", "exec")
        if code.lstrip().startswith(PARTIAL):
            continue
        exec(compiled, namespace)
    out = capsys.readouterr().out
    if page.name == "README.md":  # what the README's examples say they print
        assert "loss after 20 steps" in out and "1 graph for 3 steps" in out


def test_the_partial_marker_is_the_exception():
    partial = [(p.name, line) for p in PAGES for line, code in python_blocks(p) if code.lstrip().startswith(PARTIAL)]
    assert len(partial) <= 2, partial  # a page of fragments is not documentation


def test_the_api_reference_is_what_the_docstrings_say():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    gen_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_api)
    committed = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert committed == gen_api.render(), "docs/api.md is stale: run python3 docs/gen_api.py"


def test_every_docs_path_the_readme_names_exists():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(docs/[\w./-]+\.(?:md|py))`", text))
    assert named, "the README points into docs/"
    assert sorted(p for p in named if not (ROOT / p).exists()) == []
