"""Folders holding a process's secrets do not outlive it, even when it is SIGKILLed.

The owner is a real process killed with SIGKILL; the next folder of the same kind (a Ray host
actor's, or a Ray job's client TLS files) removes what it left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from gymrpc.launch.private import LOCK, PrivateFolder, sweep
from tests.security.helpers import RAY_JOB_PRELUDE

ROOT = Path(__file__).resolve().parents[2]

OWNER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from gymrpc.launch.private import PrivateFolder

    folder = PrivateFolder(sys.argv[1], Path(sys.argv[2]))
    (folder.path / "key.pem").write_text("PRIVATE KEY")
    print(folder.path, flush=True)
    sys.stdin.read()  # until the test kills it
    """
)


def _owner(prefix: str, parent: Path) -> tuple[subprocess.Popen[str], Path]:
    child = subprocess.Popen(
        [sys.executable, "-c", OWNER, prefix, str(parent)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    return child, Path(child.stdout.readline().strip())


def _kill(child: subprocess.Popen[str]) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)


def test_a_killed_owners_folder_is_removed_by_the_next_folder_and_a_live_ones_is_kept(tmp_path: Path) -> None:
    dead, dead_folder = _owner("gymrpc-host-", tmp_path)
    live, live_folder = _owner("gymrpc-host-", tmp_path)
    try:
        assert (dead_folder / "key.pem").read_text() == "PRIVATE KEY"
        assert sweep("gymrpc-host-", tmp_path) == []  # both owners alive
        _kill(dead)
        assert (dead_folder / "key.pem").exists()  # nobody cleaned up after the kill...
        mine = PrivateFolder("gymrpc-host-", tmp_path)  # ...until the next host makes its folder
        assert not dead_folder.exists()
        assert (live_folder / "key.pem").exists()
        assert mine.path.is_dir()
        assert oct(mine.path.stat().st_mode & 0o777) == oct(0o700)
        mine.remove()
        mine.remove()  # twice is harmless
        assert not mine.path.exists()
    finally:
        _kill(live)
    assert sweep("gymrpc-host-", tmp_path) == [live_folder]
    assert os.listdir(tmp_path) == []


def test_folders_a_sweep_cannot_vouch_for_are_left_alone(tmp_path: Path) -> None:
    older = tmp_path / "gymrpc-host-older"  # made before folders had an owner lock
    older.mkdir()
    (older / "token").write_text("t")
    other = tmp_path / "gymrpc-client-tls-x"  # another kind of folder, its owner dead
    other.mkdir()
    (other / LOCK).touch()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / LOCK).touch()
    (tmp_path / "gymrpc-host-link").symlink_to(target)  # never followed
    assert sweep("gymrpc-host-", tmp_path) == []
    assert (older / "token").exists()
    assert (target / LOCK).exists()
    assert sweep("gymrpc-client-tls-", tmp_path) == [other]


JOB = RAY_JOB_PRELUDE + textwrap.dedent(
    """
    print(discover_registry()[2].key, flush=True)
    if sys.argv[1] == "wait":
        sys.stdin.read()
    """
)


def test_a_killed_ray_jobs_client_key_is_removed_by_the_next_job_on_the_node(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    killed = subprocess.Popen(
        [sys.executable, "-c", JOB, "wait"], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert killed.stdout is not None
    key = Path(killed.stdout.readline().strip())
    assert key.read_text() == "KEY PEM"
    _kill(killed)
    assert key.exists()
    nxt = subprocess.run(
        [sys.executable, "-c", JOB, "exit"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert nxt.returncode == 0, nxt.stderr[-3000:]
    assert not key.exists(), "the killed job's private key outlived it"
    assert os.listdir(tmp_path) == [], "the next job's own folder is gone at its exit too"
