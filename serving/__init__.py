"""raypai.serving: Ray Serve model servers, the OpenAI-compatible router, the deploy API.

The names below load on first use (PEP 562): importing the package does not import Ray Serve."""

from __future__ import annotations

import importlib

_EXPORTS = {"create_app": "raypai.serving.api", "Controller": "raypai.serving.control"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raypai.serving' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
