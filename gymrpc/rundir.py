"""The run folder: where a stack leaves what a trainer needs to find it.

`gymrpc up` writes the registry address and the control token here; `gymrpc.Client()`
with no arguments reads them, so a trainer needs no other configuration.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DEFAULT = Path(".gymrpc")
REGISTRY_FILE = "registry.addr"
TOKEN_FILE = "token"
STATE_FILE = "stack.json"
LOG_DIR = "logs"
REGISTRY_READY_FILE = "registry.ready"  # the registry's ready line: name, address, metrics URL


def default_run_dir() -> Path:
    """`$GYMRPC_RUN_DIR`, else `.gymrpc` under the current directory."""
    return Path(os.environ.get("GYMRPC_RUN_DIR", DEFAULT)).absolute()


def registry_ready(run_dir: Path) -> Path:
    """The registry's ready file: how a scraper finds the registry's own metrics page."""
    return run_dir / REGISTRY_READY_FILE


def registry_socket(run_dir: Path) -> Path:
    return run_dir / "registry.sock"


def read_registry_address(run_dir: Path) -> str:
    path = run_dir / REGISTRY_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no stack found: {path} does not exist. Start one with `gymrpc up`, or pass the registry "
            "address (Client(registry=...) or $GYMRPC_REGISTRY)"
        ) from None


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so readers never see a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
