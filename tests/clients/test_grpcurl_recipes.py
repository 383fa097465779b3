"""The recipes of clients/grpcurl/README.md run against real stacks and show what they promise.

Both forms run: grpcurl (when the venv has it) and `gymrpc call`. The restore recipes need
processes that have served nothing yet, so each tool's restore runs on a stack of its own,
from the checkpoint its own commit recipe wrote into the shared run folder.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "clients" / "grpcurl" / "check_recipes.py"
SUMMARY = re.compile(r"(\d+) passed, 0 failed, (\d+) skipped")


def check_recipes(run_dir: Path, *args: str) -> tuple[int, int]:
    """Run the checker; fail with its report unless every recipe passed; return (passed, skipped)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--run-dir", str(run_dir), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = SUMMARY.fullmatch(proc.stdout.splitlines()[-1])
    assert summary, proc.stdout
    return int(summary[1]), int(summary[2])


@pytest.mark.slow  # ~40 recipes, five participants each for the control ones, and three stacks
def test_recipes_against_the_default_stack(start_stack) -> None:
    grpcurl = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) is not None
    stack = start_stack()  # the embedded default stack, which the recipes are written for
    passed, skipped = check_recipes(stack.run_dir)
    assert passed >= 20
    assert skipped == (0 if grpcurl else passed)

    for tool in ("grpcurl", "gymrpc") if grpcurl else ("gymrpc",):
        stack.stop()
        stack = start_stack()  # fresh processes, same run folder (and checkpoints)
        assert check_recipes(stack.run_dir, "--fresh-stack", "--tool", tool) == (1, 0)


TLS_RECIPES = ("services", "endpoints", "resolve", "health", "tools", "run", "invalid", "unauthenticated")


@pytest.mark.slow
def test_recipes_against_a_tls_stack(start_stack) -> None:
    """The same recipes take the TLS form (the stack's CA and client certificate) from tls.json."""
    grpcurl = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) is not None
    stack = start_stack(None, "--tls")
    passed, skipped = check_recipes(stack.run_dir, "--only", *TLS_RECIPES)
    assert passed == 2 * len(TLS_RECIPES)
    assert skipped == (0 if grpcurl else len(TLS_RECIPES))
