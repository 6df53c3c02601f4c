"""Write ``docs/api.md``: every public name of ortpass's packages with its signature and
docstring, read from the code (``__all__`` of each module below).

Run ``python3 docs/gen_api.py`` after changing a public docstring or signature;
``tests/test_docs.py`` fails while the committed file differs from what this writes.
Written with the standard library's ``inspect`` rather than a documentation generator: the
page is Markdown read on GitHub and in an editor, and needs no dependency or build step.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

#: The modules whose ``__all__`` is the public API, in the order data flows.
MODULES = [
    "ortpass",
    "ortpass.export",
    "ortpass.passes",
    "ortpass.training",
    "ortpass.analysis",
    "ortpass.runtime",
    "ortpass.runtime.parity",
    "ortpass.golden",
    "ortpass.errors",
]

HEADER = """# API reference

Generated from the docstrings by `python3 docs/gen_api.py`; do not edit by hand.
Every name below is in its module's `__all__`. The guides (`docs/guide/`) show them in use.
"""


def main() -> int:
    out = Path(__file__).resolve().parent / "api.md"
    out.write_text(render(), encoding="utf-8")
    print(f"wrote {out}")
    return 0


def render() -> str:
    parts = [HEADER]
    for name in MODULES:
        module = importlib.import_module(name)
        parts.append(f"\n## `{name}`\n")
        summary = _first_paragraph(inspect.getdoc(module))
        if summary:
            parts.append(f"\n{summary}\n")
        for public in sorted(getattr(module, "__all__", ()), key=str.lower):
            parts.append(_entry(name, public, getattr(module, public)))
    return "".join(parts)


def _entry(module: str, name: str, obj: object) -> str:
    if inspect.isclass(obj):
        kind, signature = "class", _signature(obj)
    elif callable(obj):
        kind, signature = "function", _signature(obj)
    else:
        return f"\n### `{module}.{name}`\n\n```text\n{name} = {obj!r}\n```\n"
    doc = inspect.getdoc(obj) or "(no docstring)"
    return f"\n### `{module}.{name}` ({kind})\n\n```text\n{name}{signature}\n```\n\n{doc}\n"


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _first_paragraph(doc: str | None) -> str:
    return doc.split("\n\n", 1)[0] if doc else ""


if __name__ == "__main__":
    sys.exit(main())
