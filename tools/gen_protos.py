"""Regenerate the Python stubs in gymrpc/v1 from protos/, or check they are current.

The output folder holds generated code only (plus the generated `__init__.py`), so
it can be wiped and rewritten. `--check` generates into a temporary folder and fails
when anything differs, which is how CI catches stale stubs.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE = "gymrpc/v1"
OUT = ROOT / PACKAGE
BIN = Path(sys.executable).parent  # mypy-protobuf's plugins sit beside the interpreter
INIT = '"""Generated gRPC stubs for the gymrpc.v1 protocol. Do not edit: run tools/gen_protos.py."""\n'


def generate(out_root: Path) -> Path:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE).glob("*.proto"))
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        f"--plugin=protoc-gen-mypy={BIN / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={BIN / 'protoc-gen-mypy_grpc'}",
        *protos,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"protoc failed:\n{proc.stderr}")
    package = out_root / PACKAGE
    (package / "__init__.py").write_text(INIT)
    (out_root / "gymrpc" / "__init__.py").unlink(missing_ok=True)
    return package


def differences(expected: Path, actual: Path) -> list[str]:
    names = {p.name for p in expected.iterdir()} | {p.name for p in actual.iterdir() if p.is_file()}
    diffs = []
    for name in sorted(names):
        if name == "__pycache__":
            continue
        a, b = expected / name, actual / name
        if not a.exists() or not b.exists() or not filecmp.cmp(a, b, shallow=False):
            diffs.append(name)
    return diffs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if gymrpc/v1 is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        if args.check:
            diffs = differences(fresh, OUT) if OUT.exists() else ["(missing folder)"]
            if diffs:
                print(f"stale generated code in {PACKAGE}: {', '.join(diffs)}; run tools/gen_protos.py")
                return 1
            print(f"generated code in {PACKAGE} is up to date")
            return 0
        if OUT.exists():
            shutil.rmtree(OUT)
        shutil.copytree(fresh, OUT)
    print(f"regenerated {PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
