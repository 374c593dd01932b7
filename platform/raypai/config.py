"""Plain mappings (a YAML/JSON file, `--param KEY=VALUE` strings, a step's `config={...}`) read into
typed configs, with every problem reported together in one ConfigError.

    cfg = parse_config(PretrainConfig, yaml.safe_load(text), what="pretrain config")
    params = parse_assignments(["n=20", "lr=3e-3"], flag="--param")   # {"n": "20", "lr": "3e-3"}

Each problem names the option, the value and the fix: an unknown key lists the valid ones (and
the close match, "did you mean 'steps'?"), a wrong type names the expected type. Numbers written as
text are read as numbers where the field is numeric: PyYAML follows YAML 1.1, which reads `3e-3`
(an exponent without a dot) as the string "3e-3", and `--param` values are always text.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path

from raypai.errors import ConfigError

_BOOL_TEXT = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
_NO_HINT = object()


def type_name(hint) -> str:
    """How a type is named in messages: `int`, `float`, `list[str]`, `str | None`."""
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def unknown_key(key: str, valid: Iterable[str], *, noun: str = "option", prefix: str = "") -> str:
    """The problem line for an unknown key: the close match if there is one, then every valid key."""
    valid = list(valid)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
    return f"unknown {noun} {prefix + str(key)!r}{hint}; valid {noun}s: {', '.join(valid) or '(none)'}"


def coerce(hint, value):
    """`value` as type `hint`, or ValueError. Text is read as a number or a boolean where the hint
    asks for one ("3e-3" → 0.003, "false" → False); an int is accepted where a float is wanted.
    Hints this function does not know (classes of the caller's own, Any) pass the value through."""
    if hint is _NO_HINT or hint is typing.Any or value is None and _allows_none(hint):
        return value
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        for arm in typing.get_args(hint):
            if arm is type(None):
                continue
            try:
                return coerce(arm, value)
            except ValueError:
                pass
        raise ValueError
    if origin is typing.Literal:
        if value in typing.get_args(hint):
            return value
        raise ValueError
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _BOOL_TEXT:
            return _BOOL_TEXT[value.strip().lower()]
        raise ValueError
    if hint is int:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            text = value.strip()
            if text.lstrip("+-").isdigit():
                return int(text)
            as_float = float(text)  # "1e3" → 1000; ValueError for text that is no number
            if as_float.is_integer():
                return int(as_float)
        raise ValueError
    if hint is float:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            return float(value.strip())
        raise ValueError
    if hint is str:
        if isinstance(value, str):
            return value
        raise ValueError
    if hint is Path:
        if isinstance(value, str | Path):
            return Path(value)
        raise ValueError
    container = origin or hint
    if container in (dict, list, tuple, set, frozenset) or container in (Mapping,):
        if isinstance(value, container) or container is tuple and isinstance(value, list):
            return tuple(value) if container is tuple else value
        raise ValueError
    return value


def _allows_none(hint) -> bool:
    return type(None) in typing.get_args(hint)


def parse_config(cls, mapping: Mapping | None, *, what: str, validate: bool = True):
    """An instance of dataclass `cls` from `mapping`, or one ConfigError with every problem.

    Nested dataclass fields take a nested mapping (their problems are named `model.hidden`).
    Problems a `__post_init__` raises as a ConfigError join the type problems in the same error, and
    so, with `validate=True`, do those of a `cls.validate()` that raises one (returning the instance)."""
    problems: list[str] = []
    obj = _parse(cls, mapping if mapping is not None else {}, "", problems)
    if validate and obj is not None and hasattr(obj, "validate"):
        try:
            checked = obj.validate()
            obj = checked if isinstance(checked, cls) else obj
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems, what=what)
    return obj


def _parse(cls, mapping, prefix: str, problems: list[str]):
    if not isinstance(mapping, Mapping):
        problems.append(
            f"{prefix.rstrip('.') or 'the config'} must be a mapping of options "
            f"(got {type(mapping).__name__} {mapping!r})"
        )
        return None
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in mapping.items():
        if key not in fields:
            problems.append(unknown_key(key, fields, prefix=prefix))
            continue
        hint = hints.get(key, _NO_HINT)
        if dataclasses.is_dataclass(hint) and not isinstance(value, hint):
            nested = _parse(hint, value, f"{prefix}{key}.", problems)
            if nested is not None:
                values[key] = nested
            continue
        try:
            values[key] = coerce(hint, value)
        except ValueError:
            problems.append(f"{prefix}{key} must be {type_name(hint)} (got {type(value).__name__} {value!r})")
    missing = [
        n
        for n, f in fields.items()
        if n not in mapping and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    problems += [f"{prefix}{n} is required ({type_name(hints.get(n, _NO_HINT))})" for n in missing]
    if missing:
        return None
    try:
        return cls(**values)
    except ConfigError as err:  # a __post_init__ that checks the values: its problems join the others
        problems += err.problems
        return None
    except (TypeError, ValueError) as exc:  # a __post_init__ that refuses a combination
        problems.append(f"{prefix or cls.__name__ + ': '}{exc}")
        return None


def parse_assignments(items: Iterable[str], *, flag: str = "--param") -> dict[str, str]:
    """`KEY=VALUE` strings (as `--param` takes them) as a dict of text values; the typed reader
    (`parse_config`, a pipeline's parameters) converts them. Every malformed item in one ConfigError."""
    out: dict[str, str] = {}
    problems = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"{flag} {item!r} is not KEY=VALUE; write e.g. {flag} n=20")
            continue
        if key.strip() in out:
            problems.append(f"{flag} {key.strip()!r} is given twice ({out[key.strip()]!r} and {value!r}); keep one")
            continue
        out[key.strip()] = value
    if problems:
        raise ConfigError(problems, what=f"{flag} values")
    return out


__all__ = ["parse_config", "parse_assignments", "coerce", "unknown_key", "type_name"]
