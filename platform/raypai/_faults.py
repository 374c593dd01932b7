"""The one reader of raypai's private fault-injection variables (`raypai.train._faults`,
`raypai.data._faults`): a JSON object of a dataclass's fields, unknown keys refused. Tests only."""

from __future__ import annotations

import json
import os
from dataclasses import fields


def from_env(cls, env: str):
    """`cls(**json of $env)`; unset or empty gives the defaults (no fault)."""
    raw = json.loads(os.environ.get(env) or "{}")
    unknown = set(raw) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"{env}: unknown keys {sorted(unknown)}; valid: {[f.name for f in fields(cls)]}")
    return cls(**raw)
