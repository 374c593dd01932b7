"""Inputs and rewards by content (raypai.filedigests, raypai.cachekey's `files` and `refs`): a
step's path parameters enter its cache key by the digest of what they name, import-path parameters
('mod:fn') by their module's source. The runs use the real runner (local Ray) and embedded stores,
as tests/test_runner.py does; the fast path and the key of the built-in grpo step need neither."""

import json
import re
import sys
import time
import uuid

import pytest

from raypai import Artifact, Runner, StepContext, pipeline, step
from raypai.artifacts import digest_dir
from raypai.cachekey import KeyBuilder, cache_key, explain_miss
from raypai.filedigests import FileDigests


def _show_reasons(run_id: str) -> dict[str, str]:
    """`raypai show RUN`'s line per step saying why it was or was not a cache hit."""
    from typer.testing import CliRunner

    from raypai.cli.main import app

    out = CliRunner().invoke(app, ["show", run_id], env={"COLUMNS": "300"})
    assert out.exit_code == 0, out.output
    return dict(re.findall(r"^  (\w+): (cache .*)$", out.output, flags=re.M))


def _rows(n: int) -> str:
    return "".join(
        json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}) + "\n"
        for i in range(n)
    )


# ---- the fast path -----------------------------------------------------------------------------------


def test_a_file_is_hashed_once_while_its_size_and_mtime_hold_and_again_when_either_changes(tmp_path):
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "a.txt").write_text("alpha\n")
    (data / "b.txt").write_text("beta\n")
    table = tmp_path / "home" / "file_digests.json"
    first = FileDigests(table)
    got = first.of(data)
    assert got["sha256"] == digest_dir(data)[0] and got["bytes"] == 11  # the source artifact's digest
    first.save()

    # a new process (a later run) trusts the table for unchanged files: prove it by planting a
    # wrong sha for a.txt under its current size and mtime
    saved = json.loads(table.read_text())
    key = str((data / "a.txt").resolve())
    saved[key][2] = "0" * 64
    table.write_text(json.dumps(saved))
    assert FileDigests(table).of(data)["sha256"] != got["sha256"], "the fast path re-read an unchanged file"

    # any change of size or mtime is verified by reading the file again
    (data / "a.txt").write_text("alpha\n")  # same bytes, new mtime: re-hashed, digest as before
    assert FileDigests(table).of(data)["sha256"] == got["sha256"]
    (data / "b.txt").write_text("BETA\n")  # same size, new content
    assert FileDigests(table).of(data)["sha256"] == digest_dir(data)[0] != got["sha256"]
    assert FileDigests(table).of(tmp_path / "nope") == {"path": str(tmp_path / "nope"), "missing": True}


# ---- the key of a built-in step that names rewards -----------------------------------------------------


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A user's reward module `rw_<id>` on sys.path (scores every completion 1)."""
    name = f"rw_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.py"
    path.write_text("def right(prompts, completions, **kw):\n    return [1.0 for _ in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, path
    sys.modules.pop(name, None)


def _rescore_zero(path):
    time.sleep(0.01)  # a new mtime_ns even on coarse clocks
    path.write_text(path.read_text().replace("1.0", "0.0"))


def test_grpo_keys_the_source_of_the_rewards_it_names(reward_module):
    from raypai.alignment.steps import grpo

    name, path = reward_module
    view = {"sft_model": {"artifact": "model", "digest": "m"}, "prompts": {"artifact": "dataset", "digest": "p"}}
    view["rewards"] = [f"{name}:right=0.5"]
    before = KeyBuilder().components(grpo, view)
    assert cache_key(KeyBuilder().components(grpo, view)) == cache_key(before)  # unchanged: the same key
    _rescore_zero(path)
    now = KeyBuilder().components(grpo, view)
    assert cache_key(now) != cache_key(before), "an edited reward function left grpo's key unchanged"
    assert explain_miss(now, before) == [f"{name}.right changed (code of {name})"]


# ---- end to end: the runner re-runs what an edited input or reward reaches ----------------------------


@step(cpus=0.25)
def count_rows(ctx: StepContext, data: Artifact) -> dict:
    return {"rows": sum(1 for _ in open(data.local_path() / "rows.jsonl"))}


@pipeline(name="chats-count")
def chats_count(data_file: str):
    from raypai.alignment.steps import alignment_data

    return count_rows(alignment_data(path=data_file, kind="sft"))


def test_an_edited_data_file_reruns_its_step_and_what_depends_on_it(raypai_home, tmp_path):
    from raypai.store import MetadataStore

    chats = tmp_path / "chats.jsonl"
    chats.write_text(_rows(10))
    first = Runner(raypai_home).run(chats_count.build(data_file=str(chats)))
    assert first.ok and first.result == {"rows": 10}

    same = Runner(raypai_home).run(chats_count.build(data_file=str(chats)))  # negative: nothing changed
    assert {n: s.state for n, s in same.steps.items()} == {"alignment_data": "cached", "count_rows": "cached"}

    chats.write_text(_rows(4))  # the user deletes 6 of the 10 rows
    edited = Runner(raypai_home).run(chats_count.build(data_file=str(chats)))
    assert {n: s.state for n, s in edited.steps.items()} == {
        "alignment_data": "succeeded",
        "count_rows": "succeeded",
    }, "an edited data file was served from the cache"
    assert edited.result == {"rows": 4}
    sha = digest_dir(chats)[0]
    reasons = _show_reasons(edited.run_id)
    assert reasons["alignment_data"].startswith("cache miss: chats.jsonl changed: sha256 "), reasons
    assert f"→ {sha[:12]}…" in reasons["alignment_data"], reasons
    assert reasons["count_rows"].startswith("cache miss: input data changed"), reasons

    # lineage records the digest read: in the step run's key and as the source artifact's digest
    store = MetadataStore(raypai_home.database_url)
    run = store.get_step_run(edited["alignment_data"].step_run_id)
    assert run["cache_components"]["files"]["path"]["sha256"] == sha
    assert sha in {a.digest for a in store.inputs_of(edited["alignment_data"].step_run_id).values()}


@step(cpus=0.25, import_paths=("rewards",))
def score(ctx: StepContext, rewards: list[str]) -> dict:
    return {"rewards": rewards}  # the reward module is not on this Ray's workers' path: named, not run


@pipeline(name="scored")
def scored(reward: str):
    return score(rewards=[reward])


def test_an_edited_reward_module_reruns_the_step_that_names_it(raypai_home, reward_module):
    name, path = reward_module
    first = Runner(raypai_home).run(scored.build(reward=f"{name}:right"))
    same = Runner(raypai_home).run(scored.build(reward=f"{name}:right"))
    assert first.ok and same["score"].state == "cached"  # negative: an unchanged reward is a hit
    _rescore_zero(path)
    edited = Runner(raypai_home).run(scored.build(reward=f"{name}:right"))
    assert edited["score"].state == "succeeded", "an edited reward was served from the cache"
    assert _show_reasons(edited.run_id)["score"].startswith(f"cache miss: {name}.right changed (code of {name})")


def _hf_folder(folder, weights: bytes):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)


@pipeline(name="import-base")
def import_base(model_dir: str):
    from raypai.alignment.steps import import_model

    return import_model(path=model_dir, name="base", register_as="base-model")


def test_reexported_weights_in_the_same_folder_make_a_new_model_version(raypai_home, tmp_path):
    folder = tmp_path / "exported"
    _hf_folder(folder, b"weights-1")
    first = Runner(raypai_home).run(import_base.build(model_dir=str(folder)))
    assert first.ok and first["import_model"].metrics["registered_version"] == 1
    same = Runner(raypai_home).run(import_base.build(model_dir=str(folder)))
    assert same["import_model"].state == "cached"  # negative: the same folder, unchanged
    _hf_folder(folder, b"weights-2")  # re-exported over the old files
    again = Runner(raypai_home).run(import_base.build(model_dir=str(folder)))
    assert again["import_model"].state == "succeeded", "re-exported weights were served from the cache"
    assert again["import_model"].metrics["registered_version"] == 2
    assert again.result.digest == digest_dir(folder)[0] != first.result.digest
    assert _show_reasons(again.run_id)["import_model"].startswith("cache miss: exported changed: sha256")


@step(cpus=0.25)
def read_notes(ctx: StepContext, notes: str) -> dict:
    """`notes` is a plain string to the key (not declared a path): the step registers what it reads."""
    ctx.register_source(notes)
    return {"lines": len(open(notes).read().splitlines())}


@pipeline(name="notes")
def notes_pipe(notes: str):
    return read_notes(notes=notes)


def test_a_hit_counts_only_while_the_sources_its_step_registered_hold_their_digest(raypai_home, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("a\nb\nc\n")
    first = Runner(raypai_home).run(notes_pipe.build(notes=str(notes)))
    same = Runner(raypai_home).run(notes_pipe.build(notes=str(notes)))
    assert first.result == {"lines": 3} and same["read_notes"].state == "cached"  # negative: unchanged
    notes.write_text("a\n")
    edited = Runner(raypai_home).run(notes_pipe.build(notes=str(notes)))
    assert edited["read_notes"].state == "succeeded" and edited.result == {"lines": 1}
    reason = _show_reasons(edited.run_id)["read_notes"]
    assert f"the source it read, {notes}, is gone or changed" in reason, reason
