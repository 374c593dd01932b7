"""raypai.data: ingest, clean (filters + dedup on Ray), tokenizer training and token shards.

The names below load on first use (PEP 562), so `raypai --help` and other light commands do not
pay for pyarrow.compute, Ray Data and the ops."""

from __future__ import annotations

import importlib

_EXPORTS = {"clean": "raypai.data.clean", "ingest": "raypai.data.ingest", "IngestConfig": "raypai.data.ingest",
            "DEFAULT_RECIPE": "raypai.data.recipe", "OPS": "raypai.data.recipe", "load_recipe": "raypai.data.recipe",
            "synth": "raypai.data.synth"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raypai.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
