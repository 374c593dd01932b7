"""Recipes: an ordered list of ops with parameters, from Python or YAML.

ops:
  - whitespace_normalize
  - word_count: {min_value: 20}
  - minhash_dedup: {num_bands: 14, rows_per_band: 8}
  - my_pkg.ops:MyFilter: {threshold: 0.3}     # a custom op by import path
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from pathlib import Path

import yaml

from raypai.config import coerce, type_name, unknown_key
from raypai.data.ops.base import Filter, Mapper
from raypai.data.ops.dedup import ExactDedup, MinHashDedup
from raypai.data.ops.filters import (
    AlnumRatio,
    CharRepetition,
    FineWebQuality,
    FlaggedWords,
    GopherQuality,
    GopherRepetition,
    MeanWordLength,
    SpecialCharRatio,
    WordCount,
    WordRepetition,
)
from raypai.data.ops.language import Language
from raypai.data.ops.mappers import BoilerplateStrip, PIIRedact, PunctuationNormalize, UnicodeNFC, WhitespaceNormalize
from raypai.errors import ConfigError

OPS = {
    "unicode_nfc": UnicodeNFC,
    "whitespace_normalize": WhitespaceNormalize,
    "punctuation_normalize": PunctuationNormalize,
    "boilerplate_strip": BoilerplateStrip,
    "pii_redact": PIIRedact,
    "word_count": WordCount,
    "mean_word_length": MeanWordLength,
    "alnum_ratio": AlnumRatio,
    "special_char_ratio": SpecialCharRatio,
    "char_repetition": CharRepetition,
    "word_repetition": WordRepetition,
    "gopher_repetition": GopherRepetition,
    "gopher_quality": GopherQuality,
    "fineweb_quality": FineWebQuality,
    "flagged_words": FlaggedWords,
    "language": Language,
    "exact_dedup": ExactDedup,
    "minhash_dedup": MinHashDedup,
}

DEFAULT_RECIPE = [
    "unicode_nfc",
    "boilerplate_strip",
    "whitespace_normalize",
    "punctuation_normalize",
    "pii_redact",
    {"word_count": {"min_value": 20}},
    "mean_word_length",
    "alnum_ratio",
    "special_char_ratio",
    "char_repetition",
    "word_repetition",
    "gopher_repetition",
    "flagged_words",
    "language",
    "exact_dedup",
    "minhash_dedup",
]


def is_dedup(op) -> bool:
    return isinstance(op, ExactDedup | MinHashDedup)


def load_recipe(recipe) -> list:
    """Ops from a list, a YAML path, or the name 'default'. Every problem is reported at once."""
    if recipe is None or recipe == "default":
        recipe = DEFAULT_RECIPE
    elif isinstance(recipe, str | Path):
        path = Path(recipe)
        if not path.exists():
            raise ConfigError([f"recipe file {recipe} not found; pass a YAML file or 'default'"], what="recipe")
        try:
            doc = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError([f"recipe file {recipe} is not valid YAML: {exc}"], what="recipe") from None
        recipe = doc.get("ops") if isinstance(doc, dict) else doc
    if not isinstance(recipe, list) or not recipe:
        raise ConfigError(["a recipe is a non-empty list of ops (or a YAML file with an `ops:` list)"], what="recipe")
    ops, problems = [], []
    for i, entry in enumerate(recipe):
        if isinstance(entry, str):
            name, params = entry, {}
        elif isinstance(entry, dict) and len(entry) == 1:
            name, params = next(iter(entry.items()))
            params = params or {}
        elif not isinstance(entry, dict | str) and hasattr(entry, "name"):
            if problem := _not_an_op(entry, i, entry.name):  # an op object built in Python
                problems.append(problem)
            else:
                ops.append(entry)
            continue
        else:
            problems.append(f"op #{i}: {entry!r} is neither a name nor a single-key mapping {{name: {{params}}}}")
            continue
        cls = _resolve(name, i, problems)
        if cls is None:
            continue
        params, errs = _check_params(cls, name, params, i)
        if errs:
            problems += errs
            continue
        try:
            op = cls(**params)
        except (TypeError, ValueError, OSError) as exc:
            problems.append(f"op #{i} {name}: {exc}")
            continue
        if problem := _not_an_op(op, i, name):
            problems.append(problem)
        else:
            ops.append(op)
    if problems:
        raise ConfigError(problems, what="recipe")
    return ops


def _resolve(name: str, i: int, problems: list):
    if name in OPS:
        return OPS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            problems.append(f"op #{i}: custom op {name!r} cannot be imported ({exc}); use 'package.module:ClassName'")
            return None
    problems.append(f"op #{i}: unknown op {name!r}; valid ops: {', '.join(OPS)} (or 'package.module:Class')")
    return None


def _not_an_op(op, i: int, name: str) -> str | None:
    """Why `op` cannot run as a recipe step (None when it can): a custom op that is neither a
    mapper, a filter nor a dedup op would fail on every Ray worker instead of here."""
    if isinstance(op, Mapper | Filter) or is_dedup(op):
        return None
    return (
        f"op #{i} {name}: {type(op).__name__} is not an op; a mapper has `name` and `map_texts(texts)`, a "
        "filter `name`, `stats(texts)` and `keep(stats)` (see raypai.data.ops.base)"
    )


def _check_params(cls, name: str, params: dict, i: int) -> tuple[dict, list[str]]:
    """(`params` read as `cls`'s field types, problems): the core's readers (raypai.config), so a
    recipe names unknown and mistyped parameters as every other config does ("0.5" reads as 0.5)."""
    if not dataclasses.is_dataclass(cls):
        return params, []
    if not isinstance(params, dict):
        return params, [f"op #{i} {name}: parameters must be a mapping (got {type(params).__name__} {params!r})"]
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_") and f.name != "name"]
    out, errs = {}, []
    for k, v in params.items():
        if k not in fields:
            errs.append(f"op #{i} {name}: {unknown_key(k, fields, noun='parameter')}")
            continue
        try:
            out[k] = coerce(hints.get(k, typing.Any), v)
        except ValueError:
            errs.append(
                f"op #{i} {name}: parameter {k!r} must be {type_name(hints.get(k))} (got {type(v).__name__} {v!r})"
            )
    return out, errs


def describe(ops: list) -> list[dict]:
    """JSON-able description of a recipe (stored in the manifest and logged to MLflow)."""
    out = []
    for op in ops:
        params = (
            {
                f.name: getattr(op, f.name)
                for f in dataclasses.fields(op)
                if not f.name.startswith("_") and f.name != "name"
            }
            if dataclasses.is_dataclass(op)
            else {}
        )
        out.append({"op": op.name, "params": {k: (list(v) if isinstance(v, tuple) else v) for k, v in params.items()}})
    return out
