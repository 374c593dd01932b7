"""Load a pipeline from `FILE[:NAME]` or `package.module[:NAME]`."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

from raypai.dsl import PipelineDef
from raypai.errors import PipelineError


def load_pipeline(target: str) -> PipelineDef:
    path_part, _, name = target.partition(":")
    if path_part.endswith(".py") or "/" in path_part:
        path = Path(path_part)
        if not path.exists():
            raise PipelineError(
                f"pipeline file {path_part} not found; pass FILE.py[:PIPELINE] relative to {Path.cwd()}"
            )
        # Stable across processes: the module name is part of each step's identity (and cache key).
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:10]
        mod_name = f"raypai_user_{path.stem}_{digest}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        module.__raypai_by_value__ = True  # shipped to Ray workers by value (no install on the cluster)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise PipelineError(f"pipeline file {path_part} failed to import: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(path_part)
        except ImportError as exc:
            raise PipelineError(
                f"cannot import {path_part!r} ({exc}); pass a .py file or an importable module"
            ) from exc
    found = {v.name: v for v in vars(module).values() if isinstance(v, PipelineDef)}
    if not found:
        raise PipelineError(f"{path_part} defines no @pipeline function; decorate one with @raypai.pipeline")
    if name:
        if name not in found:
            raise PipelineError(f"{path_part} has no pipeline {name!r}; it has: {', '.join(sorted(found))}")
        return found[name]
    if len(found) > 1:
        raise PipelineError(
            f"{path_part} defines several pipelines ({', '.join(sorted(found))}); pick one with {path_part}:NAME"
        )
    return next(iter(found.values()))
