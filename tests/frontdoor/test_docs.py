"""docs/openai.md runs as written: its stack starts, its scripts print what they promise, README agrees."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "openai.md"


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def run_script(code: str, run_dir: Path) -> str:
    env = {**os.environ, "GYMRPC_RUN_DIR": str(run_dir), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_page_runs_as_written(start_stack: Any) -> None:
    text = DOC.read_text()
    (stack_yaml,) = blocks(text, "yaml")
    stack = start_stack(yaml.safe_load(stack_yaml))
    call, agent_function, run = blocks(text, "python")
    lines = run_script(call, stack.run_dir).splitlines()
    assert lines[0] == "[('increment_counter', '{\"count\": 4}'), ('increment_counter', '{\"count\": 5}')]"
    assert re.fullmatch(r"\d+ prompt tokens, \d+ generated", lines[1])
    namespace: dict[str, Any] = {}
    exec(agent_function, namespace)  # the page's agent function is the shipped example's loop
    assert inspect.iscoroutinefunction(namespace["solve"])
    assert run_script(run, stack.run_dir).strip() == (
        "1.0 ['increment_counter', 'increment_counter', 'get_counter_value']"
    )


def test_the_readme_shows_the_same_stack() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Bring your own agent") :]
    section = section[: section.index("\n## ", 3)]
    assert blocks(section, "yaml") == blocks(DOC.read_text(), "yaml")
    assert "docs/openai.md" in section
