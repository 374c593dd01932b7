"""What every cleaning op is: a small object over `pyarrow.Table` batches.

Mappers return a new text column. Filters return a stat per row (written to `stats.<name>`) and a
keep mask from thresholds — "compute a stat, then threshold", as data-juicer's filters do.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import numpy as np
import pyarrow as pa


class Mapper(Protocol):
    name: str

    def map_texts(self, texts: list[str]) -> list[str]: ...


class Filter(Protocol):
    name: str

    def stats(self, texts: list[str]) -> np.ndarray: ...

    def keep(self, stats: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class Bounds:
    """min/max thresholds shared by the ratio and count filters (inclusive)."""

    min_value: float = float("-inf")
    max_value: float = float("inf")

    def mask(self, stats: np.ndarray) -> np.ndarray:
        return (stats >= self.min_value) & (stats <= self.max_value)


def texts_of(table: pa.Table) -> list[str]:
    return table.column("text").to_pylist()


def param_names(cls) -> list[str]:
    return [f.name for f in fields(cls) if not f.name.startswith("_") and f.name != "name"]
