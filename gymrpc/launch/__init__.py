"""Launching a stack (registry + servers) and keeping it alive: `gymrpc up`, `status`, `down`.

`StackSpec` is what a YAML config describes; a `Launcher` places the servers. The
local launcher runs them as processes on this machine; every launcher registers
servers under the same names with the same registry protocol.
"""

from pathlib import Path

from gymrpc.launch.base import Launcher
from gymrpc.launch.spec import RestartPolicy, ServerSpec, StackSpec, load_stack_spec

__all__ = ["Launcher", "RestartPolicy", "ServerSpec", "StackSpec", "create_launcher", "load_stack_spec"]


def create_launcher(spec: StackSpec, run_dir: Path) -> Launcher:
    """The launcher the spec asks for (`launcher:` in the config)."""
    if spec.launcher == "local":
        from gymrpc.launch.local import LocalLauncher

        return LocalLauncher(spec, run_dir)
    if spec.launcher == "ray":
        from gymrpc.launch.ray import RayLauncher

        return RayLauncher(spec, run_dir)
    raise ValueError(f"launcher {spec.launcher!r} is not available (only 'local', 'ray')")
