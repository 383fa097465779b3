"""gymrpc: agentic RL rollouts over a typed gRPC protocol that continue after a crash.

The public surface is small on purpose: `Client`, `Controller` (coordinated checkpoints),
`RetryPolicy`, the error classes in `gymrpc.errors`, and `__version__`. Generated stubs live
in `gymrpc.v1`; environment plug-ins implement `gymrpc.envkit`.
"""

from gymrpc._version import __version__
from gymrpc.client import Client
from gymrpc.controller import Controller
from gymrpc.errors import GymrpcError
from gymrpc.retry import RetryPolicy

__all__ = ["Client", "Controller", "GymrpcError", "RetryPolicy", "__version__"]
