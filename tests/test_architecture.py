"""The shape of the package: data flows one way, passes stand alone, modules stay small.

The stages, in the order data flows (docs/design/architecture.md); a module may import its own
stage and earlier ones, never a later one, and no pass imports another pass.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ortpass"

#: (stage, module prefixes), earliest first.
STAGES = [
    ("foundation", ("ortpass.conventions", "ortpass.errors", "ortpass.io", "ortpass.graph")),
    ("infra", ("ortpass.infra",)),
    ("core", ("ortpass.ops", "ortpass.analysis", "ortpass.pythonop")),
    ("export", ("ortpass.export", "ortpass.rewrite_rules")),
    ("training", ("ortpass.training",)),
    ("passes", ("ortpass.passes",)),
    ("runtime", ("ortpass.runtime",)),
    ("entry points", ("ortpass.cli", "ortpass.golden", "ortpass.testing", "ortpass.__main__")),
]
MAX_LINES = 400


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every ortpass module ``name`` imports, at top level or inside functions."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return {m for m in found if m.split(".")[0] == "ortpass"}


def _stage(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(STAGES):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def _edges() -> list[tuple[str, str]]:
    modules = _modules()
    return [(name, dep) for name, path in modules.items() for dep in sorted(_imports(name, path)) if dep in modules]


def test_every_module_belongs_to_a_stage():
    assert [m for m in _modules() if m != "ortpass" and _stage(m) is None] == []


def _against_the_flow(edges: list[tuple[str, str]]) -> list[str]:
    return [
        f"{src} ({STAGES[_stage(src)][0]}) imports {dst} ({STAGES[_stage(dst)][0]})"
        for src, dst in edges
        if src != "ortpass" and _stage(src) is not None and _stage(dst) is not None and _stage(dst) > _stage(src)
    ]


def test_no_module_imports_a_later_stage():
    assert _against_the_flow(_edges()) == []


def test_the_flow_check_finds_a_planted_violation():
    planted = [("ortpass.analysis.layers", "ortpass.passes.recompute"), ("ortpass.passes.recompute", "ortpass.graph.names")]
    assert _against_the_flow(planted) == ["ortpass.analysis.layers (core) imports ortpass.passes.recompute (passes)"]


def test_no_pass_imports_another_pass():
    crossing = [
        f"{src} imports {dst}"
        for src, dst in _edges()
        if src.startswith("ortpass.passes.") and dst.startswith("ortpass.passes.") and dst != src
    ]
    assert crossing == []


def test_no_module_is_over_the_size_limit():
    long = {name: n for name, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_import_ortpass_stays_light():
    """``import ortpass`` loads no pass, no analysis, no torch and no onnxruntime (sympy
    comes with onnx_ir itself, which ``import onnx_ir`` loads)."""
    code = (
        "import sys, ortpass\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'onnxruntime')"
        " or m.startswith('ortpass.passes') or m.startswith('ortpass.analysis')]\n"
        "print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("source", ["from ortpass.passes import recompute", "import ortpass.runtime.session"])
def test_imports_are_resolved(source, tmp_path):
    """``_imports`` reads both import forms (the test of the checker itself)."""
    path = tmp_path / "m.py"
    path.write_text(source)
    found = _imports("ortpass.analysis.m", path)
    assert found & {"ortpass.passes.recompute", "ortpass.runtime.session"}
