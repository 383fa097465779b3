"""Model backends behind one interface (`ModelBackend`): scripted, OpenAI-compatible upstream, later vLLM."""

from __future__ import annotations

from gymrpc.servers.model.backends.base import (
    Completion,
    CompletionDelta,
    Conversation,
    Finish,
    ModelBackend,
    Sampling,
)

__all__ = ["Completion", "CompletionDelta", "Conversation", "Finish", "ModelBackend", "Sampling"]
