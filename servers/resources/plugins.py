"""Finding an environment plug-in by short name or `module:Class`."""

from __future__ import annotations

import importlib

from gymrpc.envkit import Environment

BUILTIN = {
    "counter": "gymrpc.envs.counter:CounterEnvironment",
    "blackjack": "gymrpc.envs.blackjack:BlackjackEnvironment",
    "workplace": "gymrpc.envs.workplace_assistant:WorkplaceEnvironment",
}


def load_environment(spec: str) -> type[Environment]:
    """`counter`, `blackjack`, or any `package.module:ClassName` implementing `Environment`."""
    target = BUILTIN.get(spec, spec)
    module_name, sep, class_name = target.partition(":")
    if not sep:
        raise ValueError(f"unknown environment {spec!r}: use one of {sorted(BUILTIN)} or 'module:Class'")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{target} is not a gymrpc.envkit.Environment subclass")
    return cls
