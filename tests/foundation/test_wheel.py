"""The wheel installs cleanly and runs outside the repository.

It ships the repository's `servers/` and `envs/` as `gymrpc.servers` and `gymrpc.envs`: nothing
but `gymrpc` lands at the top of site-packages, where names such as `servers` or `envs` would
collide with other projects. From a fresh venv in a folder outside the repository (no
PYTHONPATH), `gymrpc demo` runs, and a workplace episode runs on the data files the wheel carries.
The dependencies come from this test's own environment (a `.pth` line after the venv's own
site-packages), so the test measures the wheel, not a download of pandas and pyarrow.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_wheel_installs_without_top_level_servers_or_envs_and_runs_from_anywhere(tmp_path: Path) -> None:
    here = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GYMRPC_RUN_DIR", "GYMRPC_REGISTRY")}
    wheels = tmp_path / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(ROOT)],
        tmp_path,
        here,
    )
    (wheel,) = wheels.glob("gymrpc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    assert {n.split("/")[0] for n in names} == {"gymrpc", dist_info}
    if shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]):  # the optional C diff, where it builds
        assert any(n.startswith("gymrpc/store/_fields.") and n.endswith(".so") for n in names), names
    assert "gymrpc/servers/bootstrap.py" in names
    assert "gymrpc/envs/workplace_assistant/data/csv/emails.csv" in names
    assert "gymrpc/envs/workplace_assistant/data/NOTICE.md" in names

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, here)
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], tmp_path, here)
    own = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, here)
    purelib = Path(own.stdout.strip())
    (purelib / "zz_test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    assert not {"servers", "envs"} & {p.name for p in purelib.iterdir()}

    work = tmp_path / "elsewhere"  # outside the repository: nothing of it is importable from here
    work.mkdir()
    env = {**here, "PATH": f"{venv / 'bin'}{os.pathsep}{here['PATH']}"}
    where = _run(
        [
            str(python),
            "-c",
            "import gymrpc, gymrpc.envs.workplace_assistant as w; "
            "print(gymrpc.__file__); print(w.rollout_tasks_path())",
        ],
        work,
        env,
    )
    package, tasks = where.stdout.split()
    assert Path(package).is_relative_to(venv)
    assert Path(tasks).is_relative_to(venv)

    demo = _run(["gymrpc", "demo", "--run-dir", str(work / "demo"), "--repeats", "1"], work, env)
    assert "OK: all" in demo.stdout

    (work / "workplace.yaml").write_text(
        "servers:\n"
        "  - {name: resources/workplace, role: resources,"
        ' args: {environment: "gymrpc.envs.workplace_assistant:LiveVerifyWorkplaceEnvironment"}}\n'
        '  - {name: model/policy, role: model, args: {recorded: "env:workplace_assistant", default_max_tokens: 4096}}\n'
        "  - {name: agent/workplace, role: agent,"
        " args: {resources: resources/workplace, model: model/policy, max_steps: 6}}\n"
    )
    stack = {**env, "GYMRPC_RUN_DIR": str(work / "stack")}
    _run(["gymrpc", "up", "workplace.yaml", "--detach"], work, stack)
    try:
        _run(["gymrpc", "rollouts", tasks, "--agent", "agent/workplace", "--out", "out.jsonl", "--quiet"], work, stack)
    finally:
        subprocess.run(["gymrpc", "down"], cwd=work, env=stack, capture_output=True, timeout=120)
    lines = [json.loads(x) for x in (work / "out.jsonl").read_text().splitlines()]
    assert [x["reward"] for x in sorted(lines, key=lambda x: x["task_index"])] == [0.0, 1.0, 1.0, 1.0, 1.0]
