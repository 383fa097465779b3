"""Switching the OpenAI front door on from the model server's command line, and finding it by name.

Off unless `--openai-port` is given (0 picks a free port). Its base URL is registered as
the `openai_url` label of the model's registry endpoint, next to the gRPC address, so an
agent resolves `model/policy` and reads the label: no second name, no fixed port.
`--replay-dir` makes the replay record durable (one fsynced file per episode attempt).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gymrpc.servers.model.openai_http import OpenAIFrontDoor
    from gymrpc.servers.model.service import ModelServicer

OPENAI_LABEL = "openai_url"
"""Registry label holding the front door's base URL (`http://host:port/v1`)."""


def add_openai_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("OpenAI-compatible HTTP front door (off unless --openai-port)")
    group.add_argument("--openai-port", type=int, help="serve /v1/chat/completions, /v1/responses, /v1/models here")
    group.add_argument("--openai-host", default="127.0.0.1", help="address to bind (default %(default)s)")
    group.add_argument("--openai-model-name", help="model id reported by /v1/models (default: the server's name)")
    group.add_argument("--replay-dir", type=Path, help="keep the replay record of every episode here (durable)")


async def start_openai(
    args: argparse.Namespace, servicer: ModelServicer, name: str, token: str | None = None
) -> OpenAIFrontDoor | None:
    """Start the front door when `--openai-port` is set; with a stack `token` it checks credentials."""
    if args.openai_port is None:
        return None
    from gymrpc.servers.credentials import DataPlaneCredentials
    from gymrpc.servers.model.openai_http import OpenAIFrontDoor
    from gymrpc.servers.model.replay import ReplayRecord

    front_door = OpenAIFrontDoor(
        servicer,
        model_name=args.openai_model_name or name,
        replay=ReplayRecord(args.replay_dir),
        credentials=DataPlaneCredentials(token) if token else None,
    )
    servicer.replay = front_door.replay  # type: ignore[attr-defined]  # freed on retire/forget
    await front_door.start(args.openai_host, args.openai_port)
    return front_door
