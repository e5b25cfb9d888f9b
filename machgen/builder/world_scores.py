"""Scoring of the world model's played sessions (world_eval in process, world_served through Triton): each
chunk read back by the world-shapes detector against the action it was made under."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from machgen.datasets import world_shapes


@dataclass
class SessionRecord:
    subject: world_shapes.Subject
    seed: int
    actions: list[str] = field(default_factory=list)
    readings: list = field(default_factory=list)
    frames: list = field(default_factory=list)


def last_centre(frames):
    if frames is None:
        return None
    from machgen.datasets import shapes

    found = shapes.find(frames[-1])
    return None if found is None else found[1]


def score(records: list[SessionRecord]) -> dict:
    """Steering, subject and lag figures of played sessions (chunk ranges 1-based, as the issue counts)."""
    def shares(select) -> dict:
        steered = kept = colour = shape = total = 0
        for record in records:
            for index, (action, reading) in enumerate(zip(record.actions, record.readings)):
                if not select(index):
                    continue
                total += 1
                steered += reading is not None and reading.action == action
                kept += reading is not None and (reading.colour, reading.shape) == (record.subject.colour,
                                                                                    record.subject.shape)
                colour += reading is not None and reading.colour == record.subject.colour
                shape += reading is not None and reading.shape == record.subject.shape
        return {"steered": round(steered / max(total, 1), 4), "subject_kept": round(kept / max(total, 1), 4),
                "colour_kept": round(colour / max(total, 1), 4), "shape_kept": round(shape / max(total, 1), 4),
                "chunks": total}

    lags, missed = [], 0
    per_action = {action: [0, 0] for action in world_shapes.ACTIONS}
    for record in records:
        for index, (action, reading) in enumerate(zip(record.actions, record.readings)):
            per_action[action][0] += reading is not None and reading.action == action
            per_action[action][1] += 1
            if index and action == record.actions[index - 1]:
                continue
            run = index
            while run < len(record.actions) and record.actions[run] == action:
                reading_here = record.readings[run]
                if reading_here is not None and reading_here.action == action:
                    lags.append(run - index)
                    break
                run += 1
            else:
                missed += 1
    chunks = len(records[0].actions) if records else 0
    return {
        "sessions": len(records), "chunks_per_session": chunks,
        "all": shares(lambda i: True),
        "chunks_1_8": shares(lambda i: i < 8),
        "chunks_17_24": shares(lambda i: 16 <= i < 24),
        **({f"chunks_{chunks - 7}_{chunks}": shares(lambda i: i >= chunks - 8)} if chunks > 24 else {}),
        "keys": len(lags) + missed, "keys_missed": missed,
        "lag_chunks": {str(lag): lags.count(lag) for lag in sorted(set(lags))},
        "mean_lag_chunks": round(float(np.mean(lags)), 3) if lags else None,
        "per_action": {a: round(hit / max(n, 1), 4) for a, (hit, n) in per_action.items()},
    }
