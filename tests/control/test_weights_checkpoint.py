"""Checkpoints know the weights: the model's records carry the loaded version, a restore into other
weights is refused naming both (unless overridden), and the index registers the trainer's state.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import pytest

from gymrpc.client import Client
from gymrpc.control import EpisodeKey
from gymrpc.control.index import read_index
from gymrpc.control.trainer_state import FOLDER_MANIFEST, TrainerState, read_trainer_state
from gymrpc.controller import Controller
from gymrpc.errors import DataLoss, FailedPrecondition
from gymrpc.testing.safetensors_files import write_safetensors
from gymrpc.weights import update_weights
from tests.control.test_model import Episode, Model, soon


def test_a_restore_into_other_weights_is_refused_naming_both_unless_overridden(tmp_path: Path) -> None:
    async def main() -> None:
        model, episode = Model(token_delay=0.0), Episode()
        reply = await model.generate(episode.messages, "r0", 0, 0)
        assert [(s.weight_version, s.first_token) for s in reply.weight_versions] == [("scripted:0", 0)]
        await model.plane.prepare("c1", soon())
        await model.plane.commit("c1", soon(), str(tmp_path), frozenset({EpisodeKey("r0", 0)}))
        await model.close()

        fresh = Model(token_delay=0.0)
        fresh.backend.weight_version = "iteration:5"
        with pytest.raises(FailedPrecondition) as caught:
            await fresh.plane.restore("x1", soon(), str(tmp_path), [EpisodeKey("r0", 0)])
        err = caught.value
        assert err.reason == "WEIGHT_VERSION_MISMATCH"
        assert "'scripted:0'" in err.message
        assert "'iteration:5'" in err.message
        assert err.metadata == {"checkpoint_weight_version": "scripted:0", "loaded_weight_version": "iteration:5"}
        assert fresh.participant is not None
        assert len(fresh.participant.ledger) == 0
        _, restored = await fresh.plane.restore(
            "x2", soon(), str(tmp_path), [EpisodeKey("r0", 0)], allow_weight_version_mismatch=True
        )
        assert restored == [EpisodeKey("r0", 1)]
        [row] = fresh.participant.ledger.rows(EpisodeKey("r0", 1))
        assert row.weight_version == "scripted:0"
        assert [s.weight_version for s in row.weight_versions] == ["scripted:0"]
        await fresh.close()

        same = Model(token_delay=0.0)  # the same weights: restored without any override
        _, restored = await same.plane.restore("x3", soon(), str(tmp_path), [EpisodeKey("r0", 0)])
        assert restored == [EpisodeKey("r0", 1)]
        await same.close()

    asyncio.run(main())


def _stack(weights: Path) -> dict[str, Any]:
    return {
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
            {"name": "model/policy", "role": "model", "args": {"policy": "counter", "weights": str(weights)}},
            {
                "name": "agent/simple",
                "role": "agent",
                "args": {"resources": "resources/counter", "model": "model/policy"},
            },
        ]
    }


def test_the_index_registers_the_trainer_state_and_each_model_servers_weights(
    start_stack: Any, run_dir: Path, tmp_path: Path
) -> None:
    w0, w1 = tmp_path / "w0", tmp_path / "w1"
    for folder in (w0, w1):
        folder.mkdir()
        write_safetensors(folder / "model.safetensors", {"w": ("F32", (2,), None)})
    stack = start_stack(_stack(w0))
    blob = tmp_path / "trainer-40.pt"
    blob.write_bytes(b"optimizer and weights, iteration 40")
    state_dir = tmp_path / "trainer-41"
    state_dir.mkdir()
    (state_dir / "weights.safetensors").write_bytes(b"w")
    (state_dir / FOLDER_MANIFEST).write_text("weights.safetensors\n")

    async def main() -> tuple[Any, Any]:
        async with Client(run_dir=stack.run_dir) as client:
            await update_weights(client, "model/policy", weight_version="iteration:40", path=w1)
            controller = Controller(client)
            first = await controller.checkpoint(tmp_path / "ckpts", trainer_state=TrainerState(str(blob), "it40"))
            second = await controller.checkpoint(tmp_path / "ckpts", trainer_state=state_dir)
            return first, second

    first, second = asyncio.run(main())
    assert first.committed
    assert second.committed
    index = read_index(first.checkpoint_dir)
    assert dict(index.weight_versions) == {"model/policy": "iteration:40"}
    ref = read_trainer_state(index)
    assert ref is not None
    assert (ref.uri, ref.label, ref.size_bytes) == (str(blob), "it40", blob.stat().st_size)
    assert ref.sha256 == hashlib.sha256(blob.read_bytes()).hexdigest()
    folder_ref = read_trainer_state(read_index(second.checkpoint_dir))
    assert folder_ref is not None
    assert folder_ref.uri == str(state_dir)
    assert folder_ref.sha256 == hashlib.sha256((state_dir / FOLDER_MANIFEST).read_bytes()).hexdigest()
    blob.write_bytes(b"overwritten by a later iteration")
    with pytest.raises(DataLoss, match="changed since it was registered"):
        read_trainer_state(index)
