"""Launching a stack (registry + servers) and keeping it alive: `gymrpc up`, `status`, `down`.

`StackSpec` is what a YAML config describes; a `Launcher` places the servers. The
local launcher runs them as processes on this machine; every launcher registers
servers under the same names with the same registry protocol.
"""

from gymrpc.launch.spec import RestartPolicy, ServerSpec, StackSpec, load_stack_spec

__all__ = ["RestartPolicy", "ServerSpec", "StackSpec", "load_stack_spec"]
