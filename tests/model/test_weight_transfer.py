"""WeightsService's third source, weight-transfer engines, on a real scripted model server (`gymrpc up`).

The tensors themselves move only on a GPU (vLLM's NCCL or CUDA IPC engine: tests/vllm/
test_weight_transfer.py). Here the scripted backend refuses transfers (UNIMPLEMENTED, naming what
is missing), or, started with `--simulate-weight-transfer`, acts as a test double of an engine:
`InitWeightTransfer` opens at once and a transfer's tensor list is checked exactly as vLLM's
backend checks it (against `--weights`), then only the version changes, with no tensor received.
So this file tests the protocol's plumbing (validation, refusals, idempotency, modes, the
checkpoint conflict, the token), not a transfer.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from gymrpc.client import Client
from gymrpc.errors import Aborted, FailedPrecondition, InvalidArgument, Unauthenticated, Unimplemented
from gymrpc.pbtime import timestamp
from gymrpc.v1 import participant_service_pb2 as part_pb
from gymrpc.v1 import weights_service_pb2 as pb
from gymrpc.v1 import weights_service_pb2_grpc as pb_grpc
from gymrpc.weights import get_weights, init_transfer, transfer_update
from tests.model.test_weights import MODEL, TENSORS, _stream_until, served_version, weights_folder


def metadata(tensors: dict[str, Any] | None = None) -> list[pb.TensorMetadata]:
    return [
        pb.TensorMetadata(name=name, dtype=dtype, shape=shape)
        for name, (dtype, shape, _) in (tensors or TENSORS).items()
    ]


def config(weights: Path, *, simulate: bool, token_delay: float = 0.0) -> dict[str, Any]:
    args = {"backend": "scripted", "policy": "counter", "weights": str(weights), "token_delay": token_delay}
    if simulate:
        args["simulate_weight_transfer"] = True
    return {"servers": [{"name": MODEL, "role": "model", "args": args}]}


NCCL_INIT = {"engine": "nccl", "master_address": "127.0.0.1", "master_port": 29555, "world_size": 2}


async def stub(client: Client) -> Any:
    return client.stub_at(await client.resolve(MODEL), pb_grpc.WeightsServiceStub)


def test_a_backend_without_a_transfer_engine_refuses_with_unimplemented_naming_what_is_missing(
    start_stack: Any, run_dir: Path
) -> None:
    start_stack(config(weights_folder(run_dir, "w0"), simulate=False))

    async def scenario() -> None:
        async with Client(run_dir=run_dir) as client:
            state = await client.weights(MODEL).GetWeights(pb.GetWeightsRequest())
            assert state.transfer_engine == pb.WEIGHT_TRANSFER_ENGINE_UNSPECIFIED
            assert "no weight-transfer engine" in state.transfer_unavailable
            with pytest.raises(Unimplemented) as caught:
                await init_transfer(client, MODEL, **NCCL_INIT)
            assert caught.value.reason == "WEIGHT_TRANSFER_UNSUPPORTED"
            assert caught.value.metadata["missing"] == "weight_transfer_engine"
            assert "--backend vllm on CUDA GPUs" in caught.value.message
            with pytest.raises(Unimplemented):  # what is missing comes before how the fields were filled
                await init_transfer(client, MODEL, engine="nccl")
            with pytest.raises(Unimplemented) as caught:
                await transfer_update(client, MODEL, metadata(), weight_version="it:1")
            assert caught.value.reason == "WEIGHT_TRANSFER_UNSUPPORTED"
            assert await get_weights(client, MODEL) == "scripted:0"

    asyncio.run(scenario())


def test_transfer_updates_are_checked_like_a_folder_idempotent_and_refused_before_anything_changes(
    start_stack: Any, run_dir: Path
) -> None:
    start_stack(config(weights_folder(run_dir, "w0"), simulate=True))

    async def scenario() -> None:
        async with Client(run_dir=run_dir) as client:
            state = await client.weights(MODEL).GetWeights(pb.GetWeightsRequest())
            assert (state.transfer_engine, state.transfer_workers, state.transfer_unavailable) == (
                pb.WEIGHT_TRANSFER_ENGINE_NCCL,
                1,
                "",
            )
            with pytest.raises(FailedPrecondition) as caught:  # before InitWeightTransfer
                await transfer_update(client, MODEL, metadata(), weight_version="it:1")
            assert caught.value.reason == "WEIGHT_TRANSFER_NOT_INITIALIZED"
            for bad, field in (
                ({"rank_offset": 0}, "rank_offset"),
                ({"world_size": 1}, "world_size"),
                ({"master_port": 0}, "master_port"),
                ({"master_address": ""}, "master_address"),
            ):
                kwargs: dict[str, Any] = {**NCCL_INIT, **bad}
                offset = kwargs.pop("rank_offset", 1)
                offsets = {e.endpoint_id: offset for e in await client.registry.resolve(MODEL)}
                with pytest.raises(InvalidArgument) as caught:
                    await init_transfer(client, MODEL, rank_offsets=offsets, **kwargs)
                assert caught.value.metadata["field"] == field, caught.value
            with pytest.raises(InvalidArgument, match="packed=false"):
                await init_transfer(client, MODEL, engine="ipc", packed=True)
            [opened] = await init_transfer(client, MODEL, request_id="open-1", **NCCL_INIT)
            assert (opened.engine, opened.workers, opened.already_applied) == (pb.WEIGHT_TRANSFER_ENGINE_NCCL, 1, False)
            [again] = await init_transfer(client, MODEL, request_id="open-1", **NCCL_INIT)
            assert again.already_applied
            with pytest.raises(InvalidArgument, match="already used"):
                await init_transfer(client, MODEL, request_id="open-1", **{**NCCL_INIT, "master_port": 29556})

            mismatch, invalid = (FailedPrecondition, "WEIGHTS_MISMATCH"), (InvalidArgument, "INVALID_REQUEST")
            layer = "layer.0.weight"
            refusals: list[tuple[str, list[pb.TensorMetadata], tuple[type[Exception], str]]] = [
                ("shape", metadata({**TENSORS, layer: ("F32", (4, 5), None)}), mismatch),
                ("dtype", metadata({**TENSORS, layer: ("BF16", (4, 4), None)}), mismatch),
                ("missing", metadata({"embed.weight": TENSORS["embed.weight"]}), mismatch),
                ("extra", metadata({**TENSORS, "head.weight": ("F32", (4,), None)}), mismatch),
                ("dtype name", metadata({**TENSORS, layer: ("float32", (4, 4), None)}), invalid),
                ("twice", [*metadata(), metadata()[0]], invalid),
                ("empty", [], invalid),
            ]
            for label, tensors, (error, reason) in refusals:
                for validate_only in (True, False):
                    with pytest.raises(error) as caught:
                        await transfer_update(
                            client, MODEL, tensors, weight_version="bad:1", validate_only=validate_only
                        )
                    assert caught.value.reason == reason, (label, caught.value)
            with pytest.raises(FailedPrecondition) as caught:  # the group open is NCCL's
                await transfer_update(
                    client, MODEL, metadata(), weight_version="it:1", engine="ipc", validate_only=True
                )
            assert caught.value.reason == "WEIGHT_TRANSFER_NOT_INITIALIZED"
            raw = await stub(client)
            both = pb.UpdateWeightsRequest(
                request_id="both",
                weight_version="it:1",
                path=str(run_dir / "w0"),
                transfer=pb.TransferredWeights(engine=pb.WEIGHT_TRANSFER_ENGINE_NCCL, tensors=metadata()),
            )
            with pytest.raises(grpc.RpcError) as rpc:
                await raw.UpdateWeights(both, metadata=client._metadata)
            assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not both" in rpc.value.details()
            assert await get_weights(client, MODEL) == "scripted:0"

            checked = await transfer_update(client, MODEL, metadata(), weight_version="it:1", validate_only=True)
            assert (checked.weight_version, checked.tensor_count, checked.size_bytes) == ("scripted:0", 2, 320)
            assert await get_weights(client, MODEL) == "scripted:0"  # validating changes nothing

            first = await transfer_update(client, MODEL, metadata(), weight_version="it:1", request_id="t1")
            assert (first.weight_version, first.previous_weight_version, first.already_applied) == (
                "it:1",
                "scripted:0",
                False,
            )
            assert (first.tensor_count, first.size_bytes, first.mode) == (2, 320, pb.WEIGHT_UPDATE_MODE_KEEP)
            retried = await transfer_update(client, MODEL, metadata(), weight_version="it:1", request_id="t1")
            assert retried.already_applied
            with pytest.raises(InvalidArgument, match="already used"):
                await transfer_update(client, MODEL, metadata(), weight_version="it:2", request_id="t1")
            with pytest.raises(InvalidArgument, match="already serving"):
                await transfer_update(client, MODEL, metadata(), weight_version="it:1", request_id="t-same")
            assert await served_version(client, "v/transfer") == "it:1"
            status = await client.weights(MODEL).GetWeights(pb.GetWeightsRequest())
            assert (status.weight_version, status.update_count) == ("it:1", 1)

    asyncio.run(scenario())


def test_a_transfer_needs_the_control_token_and_waits_out_a_checkpoint(start_stack: Any, run_dir: Path) -> None:
    start_stack(config(weights_folder(run_dir, "w0"), simulate=True))

    async def scenario() -> None:
        async with Client(run_dir=run_dir, token="wrong") as client:
            with pytest.raises(Unauthenticated):
                await init_transfer(client, MODEL, **NCCL_INIT)
            with pytest.raises(Unauthenticated):
                await transfer_update(client, MODEL, metadata(), weight_version="it:1")
        async with Client(run_dir=run_dir) as client:
            await init_transfer(client, MODEL, **NCCL_INIT)
            participant: Any = client.participant(MODEL)
            deadline = timestamp(time.time() + 30)
            await participant.Prepare(part_pb.PrepareRequest(checkpoint_id="ck1", deadline=deadline))
            for validate_only in (True, False):
                with pytest.raises(Aborted) as caught:
                    await transfer_update(
                        client, MODEL, metadata(), weight_version="it:1", request_id="d", validate_only=validate_only
                    )
                assert caught.value.reason == "CHECKPOINT_CONFLICT"
            await participant.Resume(part_pb.ResumeRequest(checkpoint_id="ck1"))
            reply = await transfer_update(client, MODEL, metadata(), weight_version="it:1", request_id="d")
            assert (reply.weight_version, reply.already_applied) == ("it:1", False)

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["keep", "cut", "drain"])
def test_a_transfer_update_with_generations_in_flight_follows_its_mode(
    start_stack: Any, run_dir: Path, mode: str
) -> None:
    start_stack(config(weights_folder(run_dir, "w0"), simulate=True, token_delay=0.02))
    count = 4

    async def scenario() -> None:
        async with Client(run_dir=run_dir) as client:
            await init_transfer(client, MODEL, **NCCL_INIT)
            started = [asyncio.Event() for _ in range(count)]
            streams = [asyncio.ensure_future(_stream_until(client, f"{mode}/{k}", 3, started[k])) for k in range(count)]
            await asyncio.gather(*(e.wait() for e in started))
            reply = await transfer_update(client, MODEL, metadata(), weight_version="it:1", mode=mode)
            results = await asyncio.gather(*streams)
            counts = {"keep": reply.generations_kept, "cut": reply.generations_cut, "drain": reply.generations_drained}
            assert counts[mode] == count
            for _, final in results:
                versions = [s.weight_version for s in final.weight_versions]
                assert versions == (["scripted:0"] if mode == "drain" else ["scripted:0", "it:1"])

    asyncio.run(scenario())


@pytest.mark.parametrize("weight_transfer", ["path", "stream"])
def test_the_reference_trainer_pushes_by_the_weight_transfer_it_is_given(
    start_stack: Any, run_dir: Path, weight_transfer: str
) -> None:
    """`gymrpc train run --weight-transfer path|stream` (nccl needs CUDA: tests/vllm/test_weight_transfer.py)."""
    from gymrpc.train.command import add_arguments
    from gymrpc.train.loop import TrainConfig, Trainer

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["run", "--out", "o", "--weight-transfer", weight_transfer])
    assert args.weight_transfer == weight_transfer
    assert parser.parse_args(["run", "--out", "o"]).weight_transfer == "path"  # the default is unchanged
    start_stack(config(weights_folder(run_dir, "w0"), simulate=False))
    folder = weights_folder(run_dir, "pushed")
    config_ = TrainConfig(out=run_dir / "out", model=MODEL, weight_transfer=weight_transfer)

    async def scenario() -> None:
        async with Client(run_dir=run_dir) as client:
            trainer = Trainer(config_, client, policy=None, tasks=[])
            reply = await trainer._update(folder, "grpo:1")
            assert (reply.weight_version, reply.tensor_count) == ("grpo:1", 2)
            await trainer.close()
            assert await get_weights(client, MODEL) == "grpo:1"

    asyncio.run(scenario())
