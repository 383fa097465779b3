"""docs/training.md's runnable blocks run as written against a real stack (`gymrpc up`).

Blocks follow a `<!-- run: stack|shell|python -->` marker: the stack block is the stack's
config, the shell command runs in the repository root with the stack's run folder in the
environment (its `--out` file moved into a temporary folder), and the Python program runs
with a temporary work folder as its argument.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "training.md"
BLOCK = re.compile(r"<!-- run: (\w+) -->\n```\w*\n(.*?)\n```", re.DOTALL)


def blocks() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for kind, body in BLOCK.findall(DOC.read_text()):
        out.setdefault(kind, []).append(body)
    return out


def test_the_training_doc_runs_as_written(start_stack: Any, tmp_path: Path) -> None:
    found = blocks()
    assert sorted(found) == ["python", "shell", "stack"]
    stack = start_stack(yaml.safe_load(found["stack"][0]))
    env = {**os.environ, "GYMRPC_RUN_DIR": str(stack.run_dir), "PYTHONPATH": str(ROOT)}
    for command in found["shell"]:
        argv = shlex.split(command)
        assert argv[0] == "gymrpc"
        argv = [sys.executable, "-m", "gymrpc.cli", *argv[1:]]
        out = argv.index("--out") + 1
        argv[out] = str(tmp_path / argv[out])
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "staleness 0 stale (flagged), 0 restarts of stale episodes; policy lag max 0" in proc.stdout
    [program] = found["python"]
    argv = [sys.executable, "-c", program, str(tmp_path)]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loaded iteration:1 (was scripted:0)" in proc.stdout
    assert "loaded iteration:2 (was iteration:1)" in proc.stdout
    assert "trainer state step2 weights {'model/policy': 'iteration:2'}" in proc.stdout
