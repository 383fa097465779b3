"""`python -m gymrpc.servers.resources` with bench-only patches, to measure candidate changes A/B.

    python bench/variant_resources_server.py --patch inline-env --patch asyncio -- <gymrpc.servers.resources args>

Patches (none touch the files; they replace attributes in this process only):
  inline-env  `SessionHost.run` calls environment code on the event loop instead of its thread pool
  no-guard    `start_server` adds servicers without `gymrpc.servers.guard` (no token check, no error mapping)

Not patches but real configurations, measured against the same server without them:
  asyncio     `--event-loop asyncio`: asyncio's own loop instead of uvloop (the servers' default)
  metrics     `--metrics-port 0`
  tracing     `GYMRPC_TRACES_FILE` beside the ready file: every call a SERVER span, written as it ends
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gymrpc.tracing import TRACES_FILE_ENV

PATCHES = ("inline-env", "asyncio", "no-guard", "metrics", "tracing")


def apply(patches: list[str]) -> None:
    if "inline-env" in patches:
        from gymrpc.servers.resources.sessions import SessionHost

        async def run_inline(self: SessionHost, fn: Callable[..., Any], *args: Any) -> Any:
            return fn(*args)

        SessionHost.run = run_inline  # type: ignore[method-assign]
    if "no-guard" in patches:
        import gymrpc.servers.bootstrap

        gymrpc.servers.bootstrap.guard_servicer = lambda servicer, service, **_: servicer  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patch", action="append", choices=PATCHES, default=[])
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of python -m gymrpc.servers.resources")
    args = parser.parse_args()
    apply(args.patch)
    from gymrpc.servers.resources.__main__ import main as resources_main

    sys.argv = ["gymrpc.servers.resources", *(a for a in args.rest if a != "--")]
    if "asyncio" in args.patch:
        sys.argv += ["--event-loop", "asyncio"]
    if "metrics" in args.patch:
        sys.argv += ["--metrics-port", "0"]
    if "tracing" in args.patch:
        ready = Path(sys.argv[sys.argv.index("--ready-file") + 1])
        os.environ[TRACES_FILE_ENV] = str(ready.with_name("variant-spans.jsonl"))
    resources_main()


if __name__ == "__main__":
    main()
