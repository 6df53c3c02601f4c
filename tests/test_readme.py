"""The README's fresh-machine commands are what CI runs (its Python blocks run in
tests/test_docs.py): the first bash block, on the training build, and the block after it,
on stock onnxruntime."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[list[str]]:
    """The commands of the README's first two bash blocks, one list a block."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)[:2]
    assert len(blocks) == 2, "the README starts with two bash blocks: the training build's, then stock onnxruntime's"
    return [[line for line in block.splitlines() if line.strip()] for block in blocks]


def test_ci_runs_the_readme_commands_verbatim():
    training, stock = _readme_commands()
    assert len(training) == 2, training
    assert any("[training-cpu," in command for command in training), training
    assert any("[cpu," in command for command in stock) and any("-m stock" in command for command in stock), stock
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    for command in training + stock:
        assert command in ci, f"{command!r} is in the README but not in .ci/run"
