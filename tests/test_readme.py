"""The README's fresh-machine commands are what CI runs (its Python blocks run in
tests/test_docs.py)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "the README starts with a bash block holding the two commands"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_ci_runs_the_readme_commands_verbatim():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    for command in commands:
        assert command in ci, f"{command!r} is in the README but not in .ci/run"
