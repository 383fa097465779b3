"""Incremental prompts: the previous call's tokens of a conversation are reused, not tokenised again.

`ChatTemplate.render` tokenises a conversation piece by piece (the system text, the tools
block, each turn's text, each tool response), each piece on its own. Between two calls of
one episode the conversation only grows, so every piece but the new turns was tokenised on
the previous call. `PromptTokenizer` wraps the server's tokenizer with a bounded memory of
piece text -> token ids: a piece is reused only when its text is byte-identical (an exact
dict key), otherwise it is tokenised afresh, so the rendered prompt is exactly the full
render's. Shared pieces (the system prompt and tools of every episode of a task set) are
tokenised once per process. Short pieces (role headers, tags) skip the memory: tokenising
them is cheaper than remembering them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from gymrpc.chat import ChatTokenizer

MIN_CHARS = 64
"""Pieces shorter than this are tokenised every time."""


class PromptTokenizer:
    """A `ChatTokenizer` whose `encode` / `decode` remember long pieces (LRU, bounded by characters)."""

    def __init__(self, tokenizer: ChatTokenizer, *, max_chars: int = 64 << 20) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self._encoded: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._decoded: OrderedDict[tuple[int, ...], str] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # renders run in worker threads
        self.hits = self.misses = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def encode(self, text: str) -> list[int]:
        if len(text) < MIN_CHARS:
            return self.tokenizer.encode(text)
        with self._lock:
            ids = self._encoded.get(text)
            if ids is not None:
                self._encoded.move_to_end(text)
                self.hits += 1
                return list(ids)
        fresh = self.tokenizer.encode(text)
        with self._lock:
            self.misses += 1
            if text not in self._encoded:
                self._encoded[text] = tuple(fresh)
                self._chars += len(text)
                self._evict()
        return fresh

    def decode(self, token_ids: Sequence[int]) -> str:
        if len(token_ids) < MIN_CHARS // 4:
            return self.tokenizer.decode(token_ids)
        key = tuple(token_ids)
        with self._lock:
            text = self._decoded.get(key)
            if text is not None:
                self._decoded.move_to_end(key)
                return text
        text = self.tokenizer.decode(token_ids)
        with self._lock:
            if key not in self._decoded:
                self._decoded[key] = text
                self._chars += len(text)
                self._evict()
        return text

    def _evict(self) -> None:
        while self._chars > self.max_chars and (self._encoded or self._decoded):
            if self._encoded:
                text, _ = self._encoded.popitem(last=False)
                self._chars -= len(text)
            if self._decoded and self._chars > self.max_chars:
                _, text = self._decoded.popitem(last=False)
                self._chars -= len(text)
