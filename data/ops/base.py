"""What a row op is: the contract `raypai.data._execute.apply_row_ops` dispatches on, and that
`load_recipe` checks a custom op against before any work.

A mapper returns a new text per row. A filter returns a stat per row (written to `stats.<name>`)
and a keep mask from it — "compute a stat, then threshold", as data-juicer's filters do. A filter
that also `annotate`s writes those per-row columns too and gets them back in `stats`, so it
computes them once (`language`: `lang`, `lang_score`). Ops see the texts of the rows still alive,
in order; every array they return has one entry per text. (Dedup ops are not row ops:
`ExactDedup`/`MinHashDedup` compute keys that the driver merges.)
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Mapper(Protocol):
    name: str

    def map_texts(self, texts: list[str]) -> list[str]: ...


@runtime_checkable
class Filter(Protocol):
    name: str

    def stats(self, texts: list[str]) -> np.ndarray: ...  # (N,) float64

    def keep(self, stats: np.ndarray) -> np.ndarray: ...  # (N,) bool, from `stats`' output


@runtime_checkable
class AnnotatingFilter(Filter, Protocol):
    def annotate(self, texts: list[str]) -> dict[str, list]: ...  # column name -> N values

    # `annotations`: what `annotate` returned for these texts (None: compute them here)
    def stats(self, texts: list[str], annotations: dict[str, list] | None = None) -> np.ndarray: ...
