"""The Finding type shared by detectors (producers) and viewers / reports (consumers)."""

from __future__ import annotations

import dataclasses
from typing import Any

SEVERITY_ERROR = "error"  # data was corrupted / wrong value used
SEVERITY_WARNING = "warning"  # latent: the bug's precondition holds, the damage did not (yet) happen
SEVERITY_INCONCLUSIVE = "inconclusive"  # the trace lacks what would decide it (not a claim of a bug)

# Detector kinds (names are part of the CLI: `pdtrace check --only KIND`, sidecar files).
LOOKAHEAD_MISALIGNMENT = "lookahead-block-misalignment"
METADATA_CLEARED_BEFORE_DRAFTER = "connector-metadata-cleared-before-drafter"
DRAFTER_WINDOW_OUTSIDE_ALLOCATION = "drafter-window-outside-allocation"
STALE_ACCEPTED_COUNT_READ = "stale-accepted-count-read"
KV_LOAD_FAILURE_RECOVERY = "kv-load-failure-recovery"
KV_NEVER_CROSSED = "kv-never-crossed"
KV_INVARIANT = "kv-invariant"
ALL_KINDS = (
    LOOKAHEAD_MISALIGNMENT,
    METADATA_CLEARED_BEFORE_DRAFTER,
    DRAFTER_WINDOW_OUTSIDE_ALLOCATION,
    STALE_ACCEPTED_COUNT_READ,
    KV_LOAD_FAILURE_RECOVERY,
    KV_NEVER_CROSSED,
    KV_INVARIANT,
)


@dataclasses.dataclass
class Finding:
    kind: str  # one of ALL_KINDS
    severity: str  # error | warning | inconclusive
    req: str | None  # request id
    step: int | None  # engine step
    inst: str | None  # P | D | ...
    event_ids: list[int]  # the trace events (``id``) the finding rests on
    title: str  # one line
    explanation: str  # one paragraph for a human
    data: dict[str, Any] = dataclasses.field(default_factory=dict)  # detector-specific detail (block ids, rows, values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
