"""Reward functions: callables or import paths, weighted, checked on every call.

    rewards = resolve(["my_pkg.rewards:accuracy=1.0", "my_pkg.rewards:brevity=0.1"])

A reward function follows TRL's convention: `fn(prompts, completions, **columns) -> list[float]`,
one float per completion. `prompts` and `completions` are in the dataset's format (strings, or
message lists for conversational prompts: then each completion is
`[{"role": "assistant", "content": text}]`; `raypai.chat.text_of` gives the text either way), and
every extra dataset column arrives as a keyword list aligned with them.
"""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

from raypai.errors import ConfigError, DataError


class RewardError(DataError):
    """A reward function returned something other than one finite float per completion."""


def parse_spec(spec: str) -> tuple[str, float]:
    """'pkg.mod:fn=0.5' → ('pkg.mod:fn', 0.5); the weight defaults to 1."""
    path, _, w = spec.partition("=")
    try:
        return path.strip(), float(w) if w else 1.0
    except ValueError:
        raise ConfigError(
            [f"reward {spec!r}: the weight after '=' must be a number (e.g. my_pkg.rewards:accuracy=0.5)"],
            what="rewards",
        ) from None


def import_path(path: str):
    """The callable at 'pkg.module:function' (or 'pkg.module.function')."""
    mod_name, sep, attr = path.partition(":")
    if not sep:
        mod_name, _, attr = path.rpartition(".")
    if not mod_name or not attr:
        raise ConfigError(
            [f"reward {path!r} is not an import path; write it as 'package.module:function'"], what="rewards"
        )
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to see, named
        raise ConfigError(
            [
                f"reward {path!r}: module {mod_name!r} does not import ({type(e).__name__}: {e}); check the "
                "name and that its folder is on PYTHONPATH or installed"
            ],
            what="rewards",
        ) from e
    fn = getattr(mod, attr, None)
    if not callable(fn):
        found = sorted(n for n in dir(mod) if not n.startswith("_") and callable(getattr(mod, n)))
        raise ConfigError(
            [f"reward {path!r}: {mod_name} has no function {attr!r}; callables there: {', '.join(found) or '(none)'}"],
            what="rewards",
        )
    _ship_by_value(mod)
    return fn


def _ship_by_value(mod) -> None:
    """A user's module outside site-packages travels to Ray workers by value, so actors on any node
    can call it without installing it (as the runner does for pipeline files)."""
    import cloudpickle
    from ray import cloudpickle as ray_cloudpickle  # Ray pickles task arguments with its own vendored copy

    f = getattr(mod, "__file__", None)
    if (
        f
        and "site-packages" not in f
        and not mod.__name__.startswith("raypai")
        and not Path(f).is_relative_to(Path(sys.base_prefix))
    ):
        cloudpickle.register_pickle_by_value(mod)
        ray_cloudpickle.register_pickle_by_value(mod)


def name_of(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def resolve(rewards) -> list[tuple[object, float]]:
    """[(callable, weight)] from callables, 'mod:fn[=w]' strings, (callable|str, weight) pairs or a
    {path: weight} dict. Import errors are raised here, before any actor starts."""
    if rewards is None:
        return []
    if isinstance(rewards, dict):
        rewards = list(rewards.items())
    if callable(rewards) or isinstance(rewards, str):
        rewards = [rewards]
    out = []
    for r in rewards:
        if isinstance(r, tuple):
            fn, w = r
        elif isinstance(r, str):
            fn, w = parse_spec(r)
        else:
            fn, w = r, 1.0
        out.append((import_path(fn) if isinstance(fn, str) else fn, float(w)))
    return out


def check_output(fn, values, prompts, completions) -> list[float]:
    """The function's output as floats, or a RewardError naming the function and the sample."""
    name = name_of(fn)
    try:
        vals = list(values)
    except TypeError:
        raise RewardError(
            f"reward {name} returned {type(values).__name__}, not a list of floats (one per completion)"
        ) from None
    if len(vals) != len(completions):
        raise RewardError(
            f"reward {name} returned {len(vals)} values for {len(completions)} completions; it must "
            "return one float per completion"
        )
    out = []
    for i, v in enumerate(vals):
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = math.nan
        if not math.isfinite(f):
            raise RewardError(
                f"reward {name} returned {v!r} for sample {i} (prompt {str(prompts[i])[:80]!r}, completion "
                f"{str(completions[i])[:80]!r}); rewards must be finite floats"
            )
        out.append(f)
    return out
