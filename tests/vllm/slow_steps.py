"""A vLLM logits processor that makes every engine step take at least `STEP_SECONDS`.

Loaded by the upstream OpenAI server of `test_openai_upstream.py` (`--logits-processors
tests.vllm.slow_steps:SlowSteps`). The tiny model decodes ~2 ms a token, so a long generation
ends in under 4 s: on a busy machine, before a starved API server shows its first token, and
an abort "mid-generation" came too late. At 40 ms a step, 1,800 tokens take over a minute,
so the tests can wait for the first token (an event) and abort while the engine is still at
it. Only slowness is added: the logits pass unchanged.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

STEP_SECONDS = 0.04


class SlowSteps(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        time.sleep(STEP_SECONDS)
        return logits

    def is_argmax_invariant(self) -> bool:
        return False  # vLLM skips argmax-invariant processors for greedy requests; this one must run

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass
