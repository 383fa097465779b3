"""`gymrpc demo` end to end, as `bash scripts/demo.sh` runs it: every episode survives a model SIGKILL."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_completes_every_episode_despite_the_kill(run_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gymrpc.cli", "demo", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "! SIGKILL model/policy" in out
    assert "+ the supervisor restarted model/policy" in out
    agent_kill = next(line for line in out.splitlines() if "! SIGKILL agent/counter" in line)
    checkpointed = re.search(r", (\d+) of its own checkpointed mid-episode$", agent_kill)
    assert checkpointed is not None, agent_kill
    assert int(checkpointed.group(1)) >= 1, agent_kill  # killed while one of its episodes was mid-run
    assert "+ the supervisor restarted agent/counter" in out
    assert "OK: all 40 episodes completed although model/policy and agent/counter were SIGKILLed mid-run" in out
    assert "counter    20/20 completed  mean reward +1.000" in out
    assert "blackjack  20/20 completed" in out
    model_row = next(line for line in out.splitlines() if line.strip().startswith("model/policy") and "SERVING" in line)
    assert model_row.split()[5:] == ["1", "signal", "SIGKILL"]  # RESTARTS, LAST EXIT
    assert len(out.splitlines()) <= 35
    lines = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    assert len(lines) == 40
    assert all(x["ok"] for x in lines)
    # The killed agent's episodes in flight continued from their checkpoints on its new process.
    resumed = [x for x in lines if x["resume_count"] > 0]
    assert resumed, f"no episode continued from a checkpoint:\n{out}\n{_agent_log(run_dir)}"
    assert all(x["episode_id"].startswith("counter-") for x in resumed)
    assert f"resume     {len(resumed)} episodes continued from their last checkpoint" in out
    assert {x["episode_id"] for x in lines} == {
        f"{env}-t{t}-r{r}" for env in ("counter", "blackjack") for t in range(5) for r in range(4)
    }
    state = json.loads((run_dir / "stack.json").read_text())
    assert state["state"] == "stopped"
    _readme_episodes_commands_read_the_demos_folder(run_dir)


def _readme_episodes_commands_read_the_demos_folder(run_dir: Path) -> None:
    """The README's `gymrpc episodes` block, as written, on the folder of the agent the demo SIGKILLed."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("After `bash scripts/demo.sh`:\n\n```bash\n", 1)[1].split("```", 1)[0]
    outputs = []
    for line in block.splitlines():
        argv = line.replace(".gymrpc/demo", str(run_dir)).split()
        assert argv[:2] == ["gymrpc", "episodes"], line
        done = subprocess.run(
            [sys.executable, "-m", "gymrpc.cli", *argv[1:]], capture_output=True, text=True, cwd=ROOT, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr
        outputs.append(done.stdout)
    listed, verified = outputs
    folder = run_dir / "episodes" / "agent-counter"
    assert listed.startswith(f"20 episodes in {folder}: 20 completed, 0 in progress, 0 damaged, 0 expired ")
    assert verified.splitlines()[-1].startswith("20 episodes in ")
    assert verified.splitlines()[-1].endswith(" read back and checked: OK")


def test_demo_refuses_a_folder_it_did_not_make(run_dir: Path) -> None:
    (run_dir / "precious.txt").write_text("keep me")
    proc = subprocess.run(
        [sys.executable, "-m", "gymrpc.cli", "demo", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "was not made by `gymrpc demo`" in proc.stderr
    assert (run_dir / "precious.txt").read_text() == "keep me"


def _agent_log(run_dir: Path) -> str:
    """The killed agent's log, for a failure's message (its restarts and what it resumed)."""
    logs = sorted((run_dir / "logs").glob("agent__counter*.log"))
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-6000:]}" for p in logs)
