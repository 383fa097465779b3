"""The YAML and command blocks of README.md and docs/ that claim to work, checked or run.

Every YAML block that configures a stack (it has `servers:`, or is a list of server entries)
must parse and pass the same check `gymrpc up` makes, so a key a server does not have or a
value it refuses fails here. The README's workplace stack is run top to bottom as written.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from gymrpc.launch.options import check_stack_args
from gymrpc.launch.spec import parse_stack_spec

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^( *)```(\w+)\n(.*?)^\1```", re.M | re.S)


def _blocks_of(text: str, language: str) -> list[str]:
    """Fenced blocks in `language`, those indented in a list item dedented."""
    return [textwrap.dedent(body) for _, lang, body in BLOCK.findall(text) if lang == language]


def _blocks(page: Path, language: str) -> list[str]:
    return _blocks_of(page.read_text(), language)


def _stack_blocks() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for i, body in enumerate(_blocks(page, "yaml")):
            data = yaml.safe_load(body)
            if isinstance(data, list) and all(isinstance(s, dict) and "role" in s for s in data):
                body = "servers:\n" + body  # a fragment: server entries to add to a stack
            elif not (isinstance(data, dict) and "servers" in data):
                continue
            found.append((f"{page.relative_to(ROOT)}#yaml{i}", body))
    return found


STACKS = _stack_blocks()


def test_the_pages_have_stack_blocks() -> None:
    assert {where.partition("#")[0] for where, _ in STACKS} >= {"README.md", "docs/ray.md"}


@pytest.mark.parametrize(("where", "body"), STACKS, ids=[w for w, _ in STACKS])
def test_every_stack_block_passes_gymrpc_up_checks(where: str, body: str) -> None:
    spec = parse_stack_spec(yaml.safe_load(body), where)
    check_stack_args(spec.servers)


def _workplace() -> tuple[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## A workplace stack with live verify", 1)[1].split("\n## ", 1)[0]
    (stack,) = _blocks_of(section, "yaml")
    (commands,) = _blocks_of(section, "bash")
    return stack, commands


def test_readme_workplace_stack_runs_as_written_with_live_verify(run_dir: Path, tmp_path: Path) -> None:
    stack, commands = _workplace()
    assert stack.startswith("# workplace.yaml\n")
    (tmp_path / "workplace.yaml").write_text(stack)
    (tmp_path / "envs").symlink_to(ROOT / "envs")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "GYMRPC_RUN_DIR": str(run_dir),
    }
    try:
        done = subprocess.run(
            ["bash", "-e", "-c", commands], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        subprocess.run([sys.executable, "-m", "gymrpc.cli", "down"], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in (tmp_path / "workplace.jsonl").read_text().splitlines()]
    assert [line["reward"] for line in sorted(lines, key=lambda r: r["task_index"])] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert {json.loads(line["trajectory"]["verify_details_json"])["verify_mode"] for line in lines} == {"live"}


def test_the_documented_index_json_is_what_the_controller_writes() -> None:
    from google.protobuf import json_format

    from gymrpc.control.index import _index_text
    from gymrpc.v1 import participant_service_pb2 as pb

    (example,) = _blocks(ROOT / "docs" / "controllers.md", "json")
    documented = json_format.Parse(example, pb.CheckpointIndex())
    assert documented.members[0].kind == pb.PARTICIPANT_KIND_RESOURCES
    written = json.loads(_index_text(documented))
    assert written == json.loads(example)
