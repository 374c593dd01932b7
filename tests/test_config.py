"""raypai.config: mappings and `--param` strings into typed configs, every problem in one ConfigError."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from raypai.config import parse_assignments, parse_config
from raypai.errors import ConfigError


@dataclass(frozen=True)
class Inner:
    hidden: int = 8
    heads: int = 2


@dataclass(frozen=True)
class Outer:
    inner: Inner = field(default_factory=Inner)
    steps: int = 10
    lr: float = 1e-3
    name: str = "x"
    fast: bool = False
    tags: list = field(default_factory=list)
    note: str | None = None

    def validate(self):
        if self.steps > 1000:
            raise ConfigError([f"steps must be ≤ 1000 (got {self.steps})"])
        return self


def test_values_of_the_declared_types_and_numbers_written_as_text():
    cfg = parse_config(
        Outer,
        {"steps": "20", "lr": "3e-3", "fast": "true", "inner": {"hidden": "1e2"}, "note": None},
        what="test config",
    )
    assert cfg == Outer(inner=Inner(hidden=100), steps=20, lr=0.003, fast=True)
    assert isinstance(cfg.lr, float) and isinstance(cfg.inner.hidden, int)
    assert parse_config(Outer, None, what="t") == Outer()
    assert parse_config(Outer, {"inner": Inner(heads=4)}, what="t").inner.heads == 4


def test_every_problem_in_one_error_with_the_fix():
    with pytest.raises(ConfigError) as err:
        parse_config(
            Outer,
            {"stpes": 3, "lr": "fast", "fast": 2, "inner": {"hiden": 4, "heads": 2.5}, "tags": "a,b", "name": 3},
            what="test config",
        )
    assert err.value.problems == [
        "unknown option 'stpes' (did you mean 'steps'?); valid options: inner, steps, lr, name, fast, tags, note",
        "lr must be float (got str 'fast')",
        "fast must be bool (got int 2)",
        "unknown option 'inner.hiden' (did you mean 'inner.hidden'?); valid options: hidden, heads",
        "inner.heads must be int (got float 2.5)",
        "tags must be list (got str 'a,b')",
        "name must be str (got int 3)",
    ]
    assert str(err.value).startswith("invalid test config (7 problem(s)):")
    with pytest.raises(ConfigError, match="unknown option 'zzz'; valid options"):  # no close match: no guess
        parse_config(Outer, {"zzz": 1}, what="t")
    with pytest.raises(ConfigError, match="inner must be a mapping of options"):
        parse_config(Outer, {"inner": 3}, what="t")


def test_validate_problems_join_the_type_problems():
    with pytest.raises(ConfigError) as err:
        parse_config(Outer, {"steps": 5000, "lr": "x"}, what="t")
    assert err.value.problems == ["lr must be float (got str 'x')", "steps must be ≤ 1000 (got 5000)"]
    assert parse_config(Outer, {"steps": 5000}, what="t", validate=False).steps == 5000


def test_param_assignments_all_malformed_ones_at_once():
    assert parse_assignments(["n=20", "expr=a=b", " lr =3e-3"]) == {"n": "20", "expr": "a=b", "lr": "3e-3"}
    with pytest.raises(ConfigError) as err:
        parse_assignments(["n", "=3", "m=1", "m=2"], flag="--param")
    assert err.value.problems == [
        "--param 'n' is not KEY=VALUE; write e.g. --param n=20",
        "--param '=3' is not KEY=VALUE; write e.g. --param n=20",
        "--param 'm' is given twice ('1' and '2'); keep one",
    ]
