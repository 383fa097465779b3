"""Read one episode's record from a store folder without opening the store (inspection, tests).

Works on a folder in use: every log is read as it is (an incomplete tail frame is simply
not read yet), and the highest-version write of the episode wins, as in `LogEpisodeStore`.
Records written by `FilesystemEpisodeStore` are read too.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from gymrpc.store import codec
from gymrpc.store.base import EpisodeCheckpoint
from gymrpc.store.log import LogView, _corrupt, _record_from


def read_record(root: str | Path, rollout_id: str) -> EpisodeCheckpoint | None:
    """The episode's current record in the store folder `root`, or None; DATA_LOSS if it was damaged."""
    root = Path(root)
    best_version, best = 0, None
    logs = root / "logs"
    names = sorted(n for n in os.listdir(logs) if not n.startswith((".", "!"))) if logs.is_dir() else []
    for name in names:
        view = LogView(logs / name)
        view.refresh()
        chains, damaged = view.index.settled()
        chain = chains.get(rollout_id)
        if chain is not None and chain.version > best_version:
            best_version, best = chain.version, (view, chain)
        if damaged.get(rollout_id, 0) > best_version:
            best_version, best = damaged[rollout_id], (view, None)
    key = hashlib.sha256(rollout_id.encode()).hexdigest()
    legacy = root / "episodes" / key[:2] / f"{key}.ckpt"
    if legacy.exists():
        data = legacy.read_bytes()
        header = codec.decode_header(data, legacy)
        if header.revision > best_version:
            return codec.decode(data, legacy, rollout_id)
    if best is None:
        return None
    view, chain = best
    if chain is None:
        raise _corrupt(str(view.folder), rollout_id, f"write {best_version} was lost to a damaged log region")
    if chain.deleted:
        return None
    return _record_from(chain, view.read, str(view.folder), rollout_id)[0]
