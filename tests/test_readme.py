"""The README's fresh-machine commands are what CI runs, and its Python example runs."""

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


def test_the_readme_python_example_runs(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    example = re.search(r"## The path, in Python.*?```python\n(.*?)```", text, re.S)
    assert example, "the README has a Python example of the path"
    monkeypatch.chdir(tmp_path)
    exec(compile(example.group(1), "README.md", "exec"), {})
