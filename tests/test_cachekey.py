"""Cache keys that see code changes (raypai.cachekey): the code of the project modules a step
imports, library and raypai versions, and the reasons given for a miss. The end-to-end run (edit
a library function a step calls; `raypai show` names it) is in tests/test_runner.py."""

import importlib.metadata
import sys
import textwrap
import uuid

import pytest

from raypai import step
from raypai.cachekey import BUILTIN_LIBRARIES, KeyBuilder, cache_key, explain_miss
from raypai.errors import ConfigError


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user project on sys.path: package `lib_<id>` (filters imports helpers inside a function,
    and numpy), an unrelated module nobody imports, and a step module calling filters."""
    pkg = f"lib_{uuid.uuid4().hex[:8]}"
    root = tmp_path / "proj"
    _write(root / pkg / "__init__.py", "")
    _write(
        root / pkg / "filters.py",
        f"""
        import json

        import numpy

        THRESHOLD = 3


        def keep(word):
            from {pkg}.helpers import size  # a function-level import counts too

            return size(word) > THRESHOLD
        """,
    )
    _write(root / pkg / "helpers.py", "def size(word):\n    return len(word)\n")
    _write(root / pkg / "unused.py", "X = 1\n")
    _write(
        root / f"steps_{pkg}.py",
        f"""
        from raypai import step
        from {pkg} import filters


        @step(cpus=0.25)
        def long_words(words: str) -> dict:
            return {{"kept": [w for w in words.split() if filters.keep(w)]}}
        """,
    )
    monkeypatch.syspath_prepend(str(root))
    yield root, pkg
    for name in [m for m in sys.modules if pkg in m]:
        del sys.modules[name]


def _step_of(root, pkg):
    import importlib

    return importlib.import_module(f"steps_{pkg}").long_words


def test_key_covers_the_imported_project_modules_and_only_those(project):
    root, pkg = project
    long_words = _step_of(root, pkg)
    parts = KeyBuilder().components(long_words, {"words": "a bb"})
    assert {f"steps_{pkg}", pkg, f"{pkg}.filters", f"{pkg}.helpers"} <= set(parts["code"])
    assert f"{pkg}.unused" not in parts["code"]
    assert not any(m.split(".")[0] in ("json", "numpy") for m in parts["code"])  # stdlib, site-packages
    assert parts["libraries"] == {"numpy": importlib.metadata.version("numpy")}  # what the project imports
    key = cache_key(parts)

    (root / pkg / "unused.py").write_text("X = 2\n")  # not imported: same key
    assert cache_key(KeyBuilder().components(long_words, {"words": "a bb"})) == key

    (root / pkg / "helpers.py").write_text("def size(word):\n    return len(word.strip())\n")
    changed = KeyBuilder().components(long_words, {"words": "a bb"})
    assert cache_key(changed) != key
    assert explain_miss(changed, parts) == [f"code of {pkg}.helpers changed"]

    other_input = KeyBuilder().components(long_words, {"words": "a bb ccc"})
    assert explain_miss(other_input, changed, params_now={"words": "a bb ccc"}, params_before={"words": "a bb"}) == [
        'parameter words "a bb" → "a bb ccc"'
    ]


def test_builtin_steps_key_their_libraries_and_raypai_code():
    from raypai.data.steps import clean
    from raypai.train.steps import pretrain

    parts = KeyBuilder().components(clean, {"recipe": "default"})
    assert set(parts["libraries"]) == set(BUILTIN_LIBRARIES["raypai.data.steps"])
    assert parts["libraries"]["transformers"] == importlib.metadata.version("transformers")
    # raypai runs from its source tree here (editable install): its modules and files are in the key
    assert "raypai.data.ops.filters" in parts["code"] and "raypai.data.recipe" in parts["code"]
    assert parts["raypai"].startswith("0.1.0+src.")
    train = KeyBuilder().components(pretrain, {})
    assert {"torch", "transformers", "deepspeed"} <= set(train["libraries"])


def test_declared_libraries_replace_the_defaults_and_must_exist():
    @step(libraries=("transformers", "torch"))
    def tok(text: str) -> dict:
        return {}

    parts = KeyBuilder().components(tok, {})
    assert parts["libraries"] == {
        "torch": importlib.metadata.version("torch"),
        "transformers": importlib.metadata.version("transformers"),
    }
    with pytest.raises(ConfigError, match="library 'transfomers' is not installed"):
        step(libraries=("transfomers",))(lambda: None)
    with pytest.raises(ConfigError, match="must be a tuple of distribution names"):
        step(libraries="torch")(lambda: None)


def test_explanations_name_libraries_raypai_and_the_step_itself():
    before = {
        "v": 1,
        "step": "m:f",
        "source": "s1",
        "inputs": {"x": "i1"},
        "code": {"m": "c1", "raypai.dsl": "r1"},
        "libraries": {"transformers": "4.46.0"},
        "raypai": "0.1.0+src.aaaa",
    }
    lib = {**before, "libraries": {"transformers": "4.47.1"}}
    assert explain_miss(lib, before) == ["library transformers 4.46.0 → 4.47.1"]
    fn = {**before, "source": "s2", "code": {**before["code"], "m": "c2"}}
    assert explain_miss(fn, before) == ["the step function m:f changed"]  # not also "code of m"
    outside = {**before, "raypai": "0.1.0+src.bbbb"}
    assert explain_miss(outside, before) == ["raypai's source changed outside this step's imports (editable install)"]
    inside = {**outside, "code": {**before["code"], "raypai.dsl": "r2"}}
    assert explain_miss(inside, before) == ["code of raypai.dsl changed"]
    upgraded = {**before, "raypai": "0.2.0"}
    assert explain_miss(upgraded, before) == ["raypai 0.1.0 → 0.2.0"]
    assert explain_miss(before, before) == []
    assert explain_miss(before, None) == ["no earlier run of this step recorded its key"]
