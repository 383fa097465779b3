"""docs/security.md: its command block runs against a real stack and its config block parses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from gymrpc.launch.spec import parse_stack_spec

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "security.md"


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_the_command_block_runs_a_tls_stack(tmp_path: Path) -> None:
    (script,) = blocks("bash")
    gymrpc = Path(sys.executable).with_name("gymrpc")
    env = {**os.environ, "GYMRPC_RUN_DIR": str(tmp_path / "run"), "PATH": f"{gymrpc.parent}:{os.environ['PATH']}"}
    try:
        proc = subprocess.run(
            ["bash", "-c", f"set -eo pipefail\n{script}"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=300,
            check=False,
        )
    finally:
        subprocess.run([str(gymrpc), "down"], env=env, capture_output=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert '"name": "increment_counter"' in proc.stdout
    assert (tmp_path / "run" / "tls.json").exists()


def test_the_config_block_is_a_valid_stack_config() -> None:
    (config,) = blocks("yaml")
    spec = parse_stack_spec(yaml.safe_load(config), "docs/security.md")
    assert spec.tls is not None
    assert spec.tls.client_cert == "/etc/gymrpc/client.crt"
    assert not spec.tls.generate
