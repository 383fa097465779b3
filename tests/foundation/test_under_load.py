"""scripts/under-load.sh: the burners run while the command runs and never outlive it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_burners_run_beside_the_command_and_die_with_it() -> None:
    check = 'for p in $GYMRPC_BURNERS; do kill -0 "$p" || exit 9; done; echo "$GYMRPC_BURNERS"; exit 3'
    done = subprocess.run(
        ["bash", "scripts/under-load.sh", "sh", "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr  # the command's own exit code; 9 if a burner was not running
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    assert not any(_alive(p) for p in pids)
