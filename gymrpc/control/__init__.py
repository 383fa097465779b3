"""Coordinated checkpoints (docs/design.md §7): the control plane every participant shares.

- `types`: episode keys, phases, kinds, orders, readiness reports.
- `fencing`: the phase machine and checkpoint-id fencing (pure logic).
- `marks`: retired attempts, checked on every data-plane call.
- `admission`: the data-plane gate prepare closes.
- `lease`: the open checkpoint's lease, which aborts it when the controller goes silent.
- `replay`: first replies of completed control calls, for retries.
- `participant`: the hook ABC each role implements, and `Capture`, what a commit takes.
- `store`: one records file, then the manifest, last and create-only.
- `plane`: `ControlPlane`, which drives a participant through all of it.
- `index`: a checkpoint folder's index, written by the controller last.
- `gc`: removing unpublished checkpoint folders (never a published or referenced one).
"""

from gymrpc.control.participant import Capture, Participant, Scope
from gymrpc.control.plane import ControlPlane, Status
from gymrpc.control.types import PREPARE_ORDER, RESUME_ORDER, RETIRE_ORDER, EpisodeKey, Kind, Phase, Report

__all__ = [
    "PREPARE_ORDER",
    "RESUME_ORDER",
    "RETIRE_ORDER",
    "Capture",
    "ControlPlane",
    "EpisodeKey",
    "Kind",
    "Participant",
    "Phase",
    "Report",
    "Scope",
    "Status",
]
