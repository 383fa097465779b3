"""The client key a Ray job gets through discovery: written once per process, private, gone at exit.

`gymrpc.launch.ray.discover_registry` runs in the job's own process (a driver, a task, an actor)
with a stand-in for `ray` here: what is tested is the files it leaves, not Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.security.helpers import RAY_JOB_PRELUDE

ROOT = Path(__file__).resolve().parents[2]

JOB = RAY_JOB_PRELUDE + textwrap.dedent(
    """
    import json, os, stat

    found = [discover_registry() for _ in range(3)]
    files = found[0][2]
    assert all(f[2] is files for f in found), "written once, however often the process discovers"
    paths = [files.cert, files.key, files.ca]
    assert open(files.key).read() == "KEY PEM"
    modes = {stat.S_IMODE(os.stat(p).st_mode) for p in paths}
    folder = os.path.dirname(files.key)
    print(json.dumps({"paths": paths, "modes": sorted(modes), "folder": folder,
                      "folder_mode": stat.S_IMODE(os.stat(folder).st_mode)}))
    """
)


def test_the_client_key_is_private_written_once_and_removed_at_exit() -> None:
    job = subprocess.run(
        [sys.executable, "-c", JOB], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert job.returncode == 0, job.stderr[-3000:]
    seen = json.loads(job.stdout.strip().splitlines()[-1])
    assert seen["modes"] == [0o600]
    assert seen["folder_mode"] == 0o700
    assert not Path(seen["folder"]).exists(), "the folder with the private key outlived the process"
    assert not any(Path(p).exists() for p in seen["paths"])
