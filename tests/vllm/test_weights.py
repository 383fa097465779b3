"""Weight updates on a real vLLM engine (CPU): KEEP, CUT, and a corrupt file, with 16 generations in flight.

On a CPU too the loaded weights are exactly the new model's (one test checks them against
transformers): the worker rebuilds the LM head's packed GEMM, which vLLM's in-place reload leaves stale.

The engine is the session's random model (seed 0, "A"); the new weights are another random
model of the same shape (seed 1, "B"). Every test drives the update the way the server does
(`WeightsServicer` over the `WeightSwitch` the model server wraps its backend in) and puts A
back afterwards, so the shared engine leaves as it came.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gymrpc.chat import ChatTemplate, default_tokenizer
from gymrpc.errors import InvalidArgument
from gymrpc.servers.model import spans as version_spans
from gymrpc.servers.model.backends.base import Finish, Sampling
from gymrpc.servers.model.weights.service import WeightsServicer
from gymrpc.servers.model.weights.switch import Mode, WeightSwitch
from tests.vllm.helpers import TEST_TIMEOUT

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT)]

TOKENIZER = default_tokenizer()
PROMPT = ChatTemplate(TOKENIZER).render([{"role": "user", "content": "Tell me a long story about the sea."}], [])
GREEDY = Sampling(max_tokens=192, temperature=0.0)
"""Long enough that every generation is still running when the (already staged) update applies."""
IN_FLIGHT = 16
SPLIT_AFTER = 8
"""Tokens every generation has before the update starts."""


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gymrpc.testing.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-random-b", seed=1)


@pytest.fixture
def switch(random_backend: Any, random_model: Path, loop_thread: Any) -> Iterator[WeightSwitch]:
    original, model_a = random_backend.weight_version, random_model.resolve()
    assert random_backend.weights_unsupported() is None
    yield WeightSwitch(random_backend)

    async def put_back() -> None:  # A again, under its own name, for the rest of the session
        if random_backend.weight_version != original:
            servicer = WeightsServicer(WeightSwitch(random_backend))
            await servicer._update(model_a, "restore:a", Mode.KEEP)
            await random_backend.set_weight_version(original)

    loop_thread.run(put_back())


class Run:
    """One generation through the switch: its tokens and (version, first, last) spans."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.spans: list[version_spans.Span] = []
        self.finish: Finish | None = None
        self.reached = asyncio.Event()

    async def drain(self, switch: WeightSwitch, request_id: str, prompt: list[int]) -> Run:
        async for delta in switch.stream(prompt, GREEDY, request_id):
            self.token_ids += delta.token_ids
            version_spans.extend(self.spans, delta.weight_version, len(delta.token_ids))
            self.finish = delta.finish or self.finish
            if len(self.token_ids) >= SPLIT_AFTER:
                self.reached.set()
        self.reached.set()
        return self


def prompts() -> list[list[int]]:
    """Sixteen different prompts: a distinct user turn each."""
    return [
        ChatTemplate(TOKENIZER).render([{"role": "user", "content": f"Story number {k} about the sea."}], []).token_ids
        for k in range(IN_FLIGHT)
    ]


async def uninterrupted(switch: WeightSwitch, tag: str) -> list[list[int]]:
    runs = [Run().drain(switch, f"{tag}-{k}", p) for k, p in enumerate(prompts())]
    return [r.token_ids for r in await asyncio.gather(*runs)]


async def update_in_flight(
    switch: WeightSwitch, tag: str, folder: Path, version: str, mode: Mode
) -> tuple[Any, list[Run], BaseException | None]:
    servicer = WeightsServicer(switch)
    error: BaseException | None = None
    staged = reply = None
    try:
        staged = await servicer.stage(folder, version)  # checked and read in before the generations start
    except InvalidArgument as exc:
        error = exc
    runs = [Run() for _ in range(IN_FLIGHT)]
    named = [(f"{tag}-{k}", r, p) for k, (r, p) in enumerate(zip(runs, prompts(), strict=True))]
    tasks = [asyncio.ensure_future(r.drain(switch, rid, p)) for rid, r, p in named]
    await asyncio.gather(*(r.reached.wait() for r in runs))
    if staged is not None:
        reply = await servicer.apply(staged, mode)
    await asyncio.gather(*tasks)
    return reply, runs, error


def test_keep_update_loses_no_generation_and_recomputes_nothing(
    switch: WeightSwitch, loop_thread: Any, other_model: Path
) -> None:
    before = switch.weight_version
    reference = loop_thread.run(uninterrupted(switch, "keep-ref"))
    reply, runs, error = loop_thread.run(
        update_in_flight(switch, "keep", other_model.resolve(), "b:1", Mode.KEEP), timeout=600
    )
    assert error is None
    assert (reply.weight_version, reply.previous_weight_version) == ("b:1", before)
    assert (reply.generations_kept, reply.generations_cut, reply.tokens_recomputed) == (IN_FLIGHT, 0, 0)
    for run, ref in zip(runs, reference, strict=True):
        assert run.finish is Finish.LENGTH
        assert len(run.token_ids) == GREEDY.max_tokens
        assert [s[0] for s in run.spans] == [before, "b:1"], run.spans  # the spans name the split
        split = run.spans[1][1]
        assert SPLIT_AFTER <= split < GREEDY.max_tokens
        assert run.token_ids[:split] == ref[:split]  # before the update: the uninterrupted run's tokens


def test_the_loaded_weights_are_the_new_models_as_transformers_computes_them(
    switch: WeightSwitch, loop_thread: Any, other_model: Path, random_model: Path
) -> None:
    """Greedy ids and their logprobs after the update are model B's (teacher-forced in transformers),
    not model A's: random tiny models agree on greedy ids, so the logprobs tell them apart."""
    import torch
    from transformers import AutoModelForCausalLM

    sampling = Sampling(max_tokens=32, temperature=0.0)
    loop_thread.run(WeightsServicer(switch)._update(other_model.resolve(), "b:2", Mode.KEEP))
    got = loop_thread.run(switch.generate(PROMPT.token_ids, sampling, "after-b"))
    assert got.weight_version == "b:2"
    assert got.logprobs is not None
    full = torch.tensor([[*PROMPT.token_ids, *got.token_ids]])
    start = len(PROMPT.token_ids)
    expected = {}
    for label, path in (("b", other_model), ("a", random_model)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            generated = model.generate(full[:, :start], max_new_tokens=sampling.max_tokens, do_sample=False)
            logits = model(full).logits[0, start - 1 : -1].float()
        ids = torch.tensor(got.token_ids).unsqueeze(-1)
        expected[label] = (generated[0, start:].tolist(), logits.log_softmax(-1).gather(-1, ids).squeeze(-1).tolist())
    assert list(got.token_ids) == expected["b"][0]
    assert list(got.logprobs) == pytest.approx(expected["b"][1], abs=2e-3)
    assert list(got.logprobs) != pytest.approx(expected["a"][1], abs=2e-3)


def test_cut_update_recomputes_at_most_one_kv_block_per_generation(
    switch: WeightSwitch, loop_thread: Any, other_model: Path
) -> None:
    before = switch.weight_version
    reply, runs, error = loop_thread.run(
        update_in_flight(switch, "cut", other_model.resolve(), "b:3", Mode.CUT), timeout=600
    )
    assert error is None
    block = switch.engine.vllm_config.cache_config.block_size
    cut = reply.generations_cut
    assert cut > 0
    assert reply.generations_kept == 0
    assert reply.tokens_recomputed <= cut * block
    for run in runs:
        assert run.finish is Finish.LENGTH
        assert len(run.token_ids) == GREEDY.max_tokens
        assert run.spans[0][0] == before
        assert run.spans[-1][0] == "b:3"


def test_a_corrupt_weights_file_leaves_the_old_weights_serving_and_every_generation_finishes(
    switch: WeightSwitch, loop_thread: Any, other_model: Path, tmp_path: Path
) -> None:
    before = switch.weight_version
    digest = loop_thread.run(switch.weights_digest())
    corrupt = tmp_path / "corrupt"
    shutil.copytree(other_model, corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated mid-tensor
    reference = loop_thread.run(uninterrupted(switch, "corrupt-ref"))
    reply, runs, error = loop_thread.run(update_in_flight(switch, "corrupt", corrupt, "bad:1", Mode.KEEP), timeout=600)
    assert reply is None
    assert isinstance(error, InvalidArgument)
    assert error.reason == "CORRUPT_WEIGHTS"
    for run, ref in zip(runs, reference, strict=True):
        assert run.finish is Finish.LENGTH
        assert run.token_ids == ref
        assert [s[0] for s in run.spans] == [before]
    assert switch.weight_version == before
    assert loop_thread.run(switch.weights_digest()) == digest
