"""`CheckpointKeeper`: LATEST only ever names a checkpoint the controller indexed (every member committed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gymrpc.control.index import INDEX
from gymrpc.control.types import EpisodeKey
from gymrpc.controller import CheckpointResult, PrepareResult
from gymrpc.rollouts.checkpointing import LATEST, CheckpointKeeper
from gymrpc.v1 import participant_service_pb2 as pb


def result(root: Path, checkpoint_id: str, indexed: bool) -> CheckpointResult:
    """A committed checkpoint as `Controller.checkpoint` returns it, with its index or without."""
    folder = root / checkpoint_id
    folder.mkdir(parents=True)
    manifest = pb.CheckpointManifest(checkpoint_id=checkpoint_id, name="resources/counter")
    out = CheckpointResult(checkpoint_id, folder, PrepareResult(True, {}), {"resources/counter": manifest})
    out.continued = [EpisodeKey("r1", 0)]
    if indexed:
        out.index = pb.CheckpointIndex(checkpoint_id=checkpoint_id)
        (folder / INDEX).write_text("{}")
    return out


def test_latest_moves_only_to_an_indexed_checkpoint(tmp_path: Path) -> None:
    keeper = CheckpointKeeper(tmp_path)
    keeper.publish(result(tmp_path, "c1", indexed=True))
    assert (tmp_path / LATEST).read_text().strip() == "c1"

    torn = result(tmp_path, "c2", indexed=False)
    assert not torn.committed
    with pytest.raises(ValueError, match=f"c2 has no {INDEX}"):
        keeper.publish(torn)
    indexed_elsewhere = result(tmp_path, "c3", indexed=True)
    (indexed_elsewhere.checkpoint_dir / INDEX).unlink()  # the result says indexed, the folder does not
    with pytest.raises(ValueError, match="not complete"):
        keeper.publish(indexed_elsewhere)

    saved = keeper.latest()
    assert saved is not None
    assert (saved.checkpoint_id, saved.continued) == ("c1", [EpisodeKey("r1", 0)])
