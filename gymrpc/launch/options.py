"""Stack `args` turned into a server's command line, checked against that server's own options.

A role module that offers `build_parser()` (every built-in role does) has each key matched to
one of its flags exactly (no argparse prefixes), each value parsed by that flag, and, when the
module has `check_arguments(parser, args)`, the combination checked too. So a wrong key or value
fails `gymrpc up` before anything starts, naming the server and the key, instead of a server
that exits at start-up or silently ignores an option. `false` means false: a
`BooleanOptionalAction` flag gets `--no-x`, a plain switch is left off.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

LAUNCHER_FLAGS = frozenset(
    {"name", "bind", "registry", "token_file", "endpoint_id", "lease_ttl", "grace", "ready_file"}
)
"""Set by the launcher from the server entry and the stack (`name`, `bind`, `lease_ttl`, ...), never by `args`."""


AGENT_FUNCTION_MODULE = "gymrpc.agentkit.serve"


class _Refused(Exception):
    pass


@cache
def _role_parser(module: str) -> tuple[argparse.ArgumentParser, Callable[..., None] | None] | None:
    """The role's parser and extra check, or None for a module that offers no parser."""
    try:
        main = importlib.import_module(f"{module}.__main__")
    except ModuleNotFoundError:
        try:
            main = importlib.import_module(module)
        except ModuleNotFoundError:
            return None
    build = getattr(main, "build_parser", None)
    if build is None:
        return None
    parser = build()

    def refuse(message: str) -> None:
        raise _Refused(message)

    parser.error = refuse  # type: ignore[method-assign]
    return parser, getattr(main, "check_arguments", None)


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


def _plain_argv(args: Mapping[str, Any]) -> list[str]:
    """For a module without a parser: `--key value`, `True` as a bare flag, `False`/None left off."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, str(value)]
    return out


def server_argv(name: str, module: str, args: Mapping[str, Any]) -> list[str]:
    """The command-line flags for `args`; ValueError naming server `name` and the key on any problem."""
    if "entrypoint" in args and module.endswith("gymrpc.servers.agent"):
        module = AGENT_FUNCTION_MODULE  # `python -m gymrpc.servers.agent --entrypoint` serves an agent function
    role = _role_parser(module)
    if role is None:
        return _plain_argv(args)
    parser, check = role
    flags = _flags(parser)
    out: list[str] = []
    for key, value in args.items():
        where = f"server {name}: args.{key}"
        flag = "--" + str(key).replace("_", "-")
        action = flags.get(flag)
        if key in LAUNCHER_FLAGS:
            raise ValueError(f"{where}: set by the launcher (use the server entry's own keys or the stack's)")
        if action is None:
            known = sorted(f.removeprefix("--").replace("-", "_") for f in flags if f.startswith("--"))
            known = [k for k in known if k not in LAUNCHER_FLAGS and k != "help"]
            raise ValueError(f"{where}: {module} has no option --{flag[2:]} (its options: {', '.join(known)})")
        out += arg_flags(where, flag, action, value)
    try:
        parsed = parser.parse_args(out)
        if check is not None:
            check(parser, parsed)
    except _Refused as exc:
        raise ValueError(f"server {name}: {exc} (from its args {dict(args)})") from None
    return out


def arg_flags(where: str, flag: str, action: argparse.Action, value: Any) -> list[str]:
    """The flags for one stack arg (ValueError prefixed with `where`): YAML types map to argparse's."""
    switch = action.nargs == 0
    if value is None:
        return []
    if isinstance(value, bool):
        if not switch:
            raise ValueError(f"{where}: {flag} takes a value, not {str(value).lower()}")
        if isinstance(action, argparse.BooleanOptionalAction):
            positive = action.option_strings[0]
            on = value if flag == positive else not value
            return [positive if on else "--no-" + positive[2:]]
        return [flag] if value else []  # the key names the flag itself (`no_x: true` is `--no-x`)
    if switch:
        raise ValueError(f"{where}: {flag} is a switch: give true or false, not {value!r}")
    if isinstance(value, list | tuple):
        if isinstance(action, argparse._AppendAction):
            return [part for item in value for part in (flag, str(item))]
        if action.nargs in ("*", "+") or isinstance(action.nargs, int):
            return [flag, *map(str, value)]
        raise ValueError(f"{where}: {flag} takes one value, not a list")
    if isinstance(value, Mapping):
        raise ValueError(f"{where}: {flag} takes a value, not a mapping")
    return [flag, str(value)]


def check_stack_args(servers: Any) -> None:
    """Every server's args against its options (ValueError naming the first bad one): `gymrpc up` runs it first."""
    for server in servers:
        server.argv()
