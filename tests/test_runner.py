"""The runner on real Ray with the embedded stores: caching, partial re-runs, failure + resume,
retries, concurrency, lineage and MLflow runs. One local Ray for the module."""

import time
from pathlib import Path

import pytest

from raypai import Artifact, Runner, StepContext, pipeline, step
from raypai.dsl import DAG, Node
from raypai.errors import ConfigError, PipelineError, StoreError
from raypai.lineage import sources, upstream
from raypai.pipelines.toy import toy
from raypai.runner import tracker_for
from raypai.store import MetadataStore


def _run(settings, pipe, **params):
    return Runner(settings).run(pipe.build(**params))


def test_toy_caches_reruns_affected_steps_and_tracks_in_mlflow(raypai_home):
    first = _run(raypai_home, toy, n=6)
    assert first.ok and [s.state for s in first.steps.values()] == ["succeeded"] * 3
    counts = (first.result.local_path() / "counts.json").read_text()
    assert '"RAY"' in counts  # upper-cased by transform

    again = _run(raypai_home, toy, n=6)
    assert [s.state for s in again.steps.values()] == ["cached"] * 3
    assert again.result.digest == first.result.digest and again.seconds < 5

    changed = _run(raypai_home, toy, n=6, upper=False)
    assert {n: s.state for n, s in changed.steps.items()} == {
        "write_text": "cached",
        "transform": "succeeded",
        "count": "succeeded",
    }

    tracker = tracker_for(raypai_home)
    children = tracker.child_runs(first.mlflow_run_id)
    assert sorted(r.data.tags["mlflow.runName"] for r in children) == ["count", "transform", "write_text"]
    count_run = [r for r in children if r.data.tags["mlflow.runName"] == "count"][0]
    assert count_run.data.metrics["words"] > 0
    assert tracker.get_run(first.mlflow_run_id).info.status == "FINISHED"

    store = MetadataStore(raypai_home.database_url)
    tree = upstream(store, first.result.id)
    chain = []
    node = tree
    while node and node["produced_by"]:
        chain.append(node["produced_by"]["node"])
        inputs = node["produced_by"]["inputs"]
        node = inputs[0]["lineage"] if inputs else None
    assert chain == ["count", "transform", "write_text"]


def _show_reasons(run_id: str) -> dict[str, str]:
    """`raypai show RUN`'s line per step saying why it was or was not a cache hit."""
    import re

    from typer.testing import CliRunner

    from raypai.cli.main import app

    out = CliRunner().invoke(app, ["show", run_id], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    return dict(re.findall(r"^  (\w+): (cache .*)$", out.output, flags=re.M))


def test_editing_a_library_function_a_step_calls_is_a_cache_miss_that_show_explains(raypai_home, tmp_path, monkeypatch):
    import sys
    import uuid

    from ray import cloudpickle  # Ray's own copy serialises tasks

    from raypai.loader import load_pipeline

    pkg = f"wordlib_{uuid.uuid4().hex[:8]}"  # a user's library package, on sys.path
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / pkg / "filters.py").write_text("THRESHOLD = 3\n\n\ndef keep(word):\n    return len(word) > THRESHOLD\n")
    pipeline_file = tmp_path / "words.py"
    pipeline_file.write_text(
        f"from raypai import pipeline, step\nfrom {pkg}.filters import keep\n\n\n"
        "@step(cpus=0.25)\ndef long_words(words: str) -> dict:\n"
        "    return {'kept': [w for w in words.split() if keep(w)]}\n\n\n"
        "@pipeline\ndef words(words: str = 'a bb ccc dddd eeeee'):\n    return long_words(words=words)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def run():
        for name in [m for m in sys.modules if m.startswith(pkg)]:
            del sys.modules[name]  # import the library as it is on disk now, as a new `raypai run` would
        pipe = load_pipeline(f"{pipeline_file}:words")
        # this Ray's workers do not have tmp_path on their sys.path: ship the library with the step
        cloudpickle.register_pickle_by_value(sys.modules[f"{pkg}.filters"])
        try:
            return Runner(raypai_home).run(pipe.build(), source_file=str(pipeline_file))
        finally:
            cloudpickle.unregister_pickle_by_value(sys.modules[f"{pkg}.filters"])

    first = run()
    assert first.ok and first.result == {"kept": ["dddd", "eeeee"]}
    assert _show_reasons(first.run_id) == {"long_words": "cache miss: no earlier run of this step recorded its key"}
    same = run()  # nothing changed: still a cache hit
    assert same["long_words"].state == "cached" and same.result == first.result
    assert _show_reasons(same.run_id) == {
        "long_words": f"cache hit: same key as run {first.run_id[:8]} step long_words"
    }

    filters = tmp_path / pkg / "filters.py"
    filters.write_text(filters.read_text().replace("THRESHOLD = 3", "THRESHOLD = 4"))
    edited = run()
    assert edited["long_words"].state == "succeeded", "an edited library function was served from the cache"
    assert edited.result == {"kept": ["eeeee"]}
    assert _show_reasons(edited.run_id) == {
        "long_words": f"cache miss: code of {pkg}.filters changed (compared with run {same.run_id[:8]} step long_words)"
    }


def test_failure_is_recorded_and_resume_reruns_only_unfinished(raypai_home, tmp_path):
    marker = tmp_path / "fail-now"
    marker.write_text("x")
    failed = _run(raypai_home, toy, n=4, fail_if_exists=str(marker))
    assert failed.state == "failed"
    assert failed["transform"].state == "failed" and "RuntimeError" in failed["transform"].error
    assert failed["count"].state == "skipped"
    store = MetadataStore(raypai_home.database_url)
    sr = store.get_step_run(failed["transform"].step_run_id)
    assert sr["state"] == "failed" and "Traceback" in sr["traceback"] and "fail_if_exists" not in sr["error"]
    assert store.get_run(failed.run_id)["state"] == "failed"

    marker.unlink()
    resumed = Runner(raypai_home).run(toy.build(n=4, fail_if_exists=str(marker)), origin_run_id=failed.run_id)
    assert resumed.ok
    assert {n: s.state for n, s in resumed.steps.items()} == {
        "write_text": "cached",
        "transform": "succeeded",
        "count": "succeeded",
    }
    assert store.get_run(resumed.run_id)["origin_run_id"] == failed.run_id


_ATTEMPTS = {}


@step(cpus=0.25, retries=2, retry_delay_s=0.1, cache=False)
def flaky(ctx: StepContext, counter_file: str) -> dict:
    p = Path(counter_file)
    n = int(p.read_text()) if p.exists() else 0
    p.write_text(str(n + 1))
    if n < 1:
        raise ConnectionError("transient failure")
    return {"tries": n + 1}


@pipeline
def flaky_pipe(counter_file: str):
    return flaky(counter_file=counter_file)


def test_retries_with_backoff_then_success(raypai_home, tmp_path):
    res = _run(raypai_home, flaky_pipe, counter_file=str(tmp_path / "count"))
    assert res.ok and res["flaky"].value == {"tries": 2} and res["flaky"].attempts == 2
    events = [s for s, _ in MetadataStore(raypai_home.database_url).step_events(res["flaky"].step_run_id)]
    assert events == ["pending", "running", "failed", "running", "succeeded"]


@step(cpus=0.25, cache=False)
def meet(ctx: StepContext, folder: str, tag: str, other: str) -> dict:
    """A rendezvous: say "here", then wait for the other step to say it too. Run one after the other,
    the first would wait for a step that has not started: it gives up after two minutes, unmet."""
    (Path(folder) / tag).touch()
    deadline = time.time() + 120
    while not (Path(folder) / other).exists() and time.time() < deadline:
        time.sleep(0.05)
    return {"tag": tag, "met": (Path(folder) / other).exists()}


@step(cpus=0.25, cache=False)
def join(ctx: StepContext, a: dict, b: dict) -> dict:
    return {"tags": [a["tag"], b["tag"]], "met": [a["met"], b["met"]]}


@pipeline
def fan(folder: str):
    return join(meet(folder, "a", "b"), meet(folder, "b", "a"))


def test_independent_steps_run_concurrently(raypai_home, tmp_path):
    """Each step waits for the other to start: only concurrent steps both meet (however loaded the
    machine, unlike a check on overlapping timestamps)."""
    res = _run(raypai_home, fan, folder=str(tmp_path))
    assert res.ok and res.result == {"tags": ["a", "b"], "met": [True, True]}, res.result


@step(cpus=0.25)
def read_input(ctx: StepContext, path: str) -> Artifact:
    src = ctx.register_source(path)
    out = ctx.output_dir()
    (out / "copy.txt").write_bytes(Path(path).read_bytes())
    return ctx.save(out, kind="dataset", metadata={"source": src.id})


@pipeline
def reader(path: str):
    return read_input(path)


def test_missing_input_file_fails_clearly_and_writes_no_artifact(raypai_home, tmp_path):
    res = _run(raypai_home, reader, path=str(tmp_path / "absent.txt"))
    assert res.state == "failed"
    assert "DataError" in res["read_input"].error and "absent.txt" in res["read_input"].error
    assert MetadataStore(raypai_home.database_url).count_artifacts() == 0

    (tmp_path / "present.txt").write_text("raw words")
    ok = _run(raypai_home, reader, path=str(tmp_path / "present.txt"))
    assert ok.ok
    tree = upstream(MetadataStore(raypai_home.database_url), ok.result.id)
    assert [s["kind"] for s in sources(tree)] == ["source"]


def test_bad_pipeline_definitions_are_clear_errors(raypai_home):
    with pytest.raises(ConfigError, match="unknown parameter 'm'.*valid parameters: n, upper"):
        toy.build(m=3)
    with pytest.raises(ConfigError, match="must be int"):
        toy.build(n="three")
    assert toy.coerce_params({"n": "7", "upper": "false"})["upper"] is False

    @pipeline
    def bad_step_param():
        from raypai.pipelines.toy import write_text

        write_text(lines=3)

    with pytest.raises(PipelineError, match="its parameters are: n, seed"):
        bad_step_param.build()

    from raypai.dsl import StepOutput
    from raypai.pipelines.toy import count, transform, write_text

    dag = DAG("cyclic", {})
    dag.nodes["a"] = Node("a", transform, {"text": StepOutput("b")})
    dag.nodes["b"] = Node("b", count, {"text": StepOutput("a")})
    with pytest.raises(PipelineError, match="cycle through steps \\['a', 'b'\\]"):
        dag.order()
    with pytest.raises(PipelineError, match="outside a @pipeline"):
        write_text(n=1)


def test_parameters_and_step_arguments_are_read_like_every_config():
    """Pipeline parameters and step arguments go through raypai.config's reader: text is read as the
    annotated number or boolean, every wrong type is named with its value in one error, and an int
    where a float is wanted is kept as given (it enters the cache key)."""
    with pytest.raises(ConfigError) as err:
        toy.coerce_params({"n": 2.5, "upper": "maybe", "seed": True})
    assert err.value.problems == [
        "pipeline 'toy': parameter 'n' must be int (got float 2.5); pass e.g. --param n=3",
        "pipeline 'toy': parameter 'upper' must be bool (got str 'maybe'); pass e.g. --param upper=true",
        "pipeline 'toy': parameter 'seed' must be int (got bool True); pass e.g. --param seed=3",
    ]
    assert toy.coerce_params({"n": "1e2", "seed": 4.0}) == {"n": 100, "upper": True, "fail_if_exists": "", "seed": 4}

    @step
    def scaled(x: float = 1.0, times: int = 1, label: str = "") -> float:
        return x * times

    @pipeline
    def args_as_text():
        scaled(x=3, times="2")

    assert args_as_text.build().nodes["scaled"].args == {"x": 3, "times": 2, "label": ""}
    assert isinstance(args_as_text.build().nodes["scaled"].args["x"], int)

    @pipeline
    def wrong_args():
        scaled(x="fast", times=1.5, label=3)

    with pytest.raises(ConfigError) as err:
        wrong_args.build()
    assert err.value.problems == [
        "step 'scaled': parameter 'x' must be float (got str 'fast')",
        "step 'scaled': parameter 'times' must be int (got float 1.5)",
        "step 'scaled': parameter 'label' must be str (got int 3)",
    ]


def test_unreachable_database_fails_before_anything_runs(raypai_home, monkeypatch):
    with pytest.raises(StoreError, match="RAYPAI_DATABASE_URL"):
        Runner(raypai_home.replace(database_url="postgresql+psycopg://x@127.0.0.1:1/none"))


@step(cpus=0.25)
def resumable(ctx: StepContext, n: int, crash_once: str) -> dict:
    """Keeps its progress in ctx.work_dir(): a run after a crash continues where the crash left it."""
    progress = ctx.work_dir() / "done.txt"
    done = int(progress.read_text()) if progress.exists() else 0
    for i in range(done, n):
        if i == 2 and Path(crash_once).exists():
            Path(crash_once).unlink()
            raise RuntimeError("crashed after 2 items")
        progress.write_text(str(i + 1))
    return {"started_at": done, "work_dir": str(ctx.work_dir())}


@pipeline
def resumable_pipe(n: int = 4, crash_once: str = ""):
    return resumable(n=n, crash_once=crash_once)


def test_work_dir_is_kept_for_the_same_step_call_and_new_for_another(raypai_home, tmp_path):
    crash = tmp_path / "crash"
    crash.write_text("x")
    failed = _run(raypai_home, resumable_pipe, n=4, crash_once=str(crash))
    assert failed.state == "failed" and "crashed after 2 items" in failed["resumable"].error
    resumed = Runner(raypai_home).run(resumable_pipe.build(n=4, crash_once=str(crash)), origin_run_id=failed.run_id)
    assert resumed.ok and resumed.result["started_at"] == 2  # the failed attempt's progress, found again
    other = _run(raypai_home, resumable_pipe, n=5, crash_once=str(crash))  # another call: a fresh folder
    assert other.ok and other.result["started_at"] == 0 and other.result["work_dir"] != resumed.result["work_dir"]
    key = MetadataStore(raypai_home.database_url).get_step_run(resumed["resumable"].step_run_id)["cache_key"]
    assert resumed.result["work_dir"].endswith(f"resumable_pipe.resumable.work-{key[:16]}")


def test_a_step_reaches_the_metadata_store_only_through_narrow_methods(raypai_home, tmp_path):
    """StepContext gives a step its outputs, sources, model registration and op stats; the store's
    tokens, deployments and other runs stay out of reach."""
    from raypai.artifacts import ArtifactStore

    store = MetadataStore(raypai_home.database_url)
    run_id = store.create_run("p", {})
    srid = store.create_step_run(run_id, "clean", "m:clean", {}, None)
    ctx = StepContext(
        raypai_home,
        run_id,
        srid,
        "clean",
        "p",
        store,
        ArtifactStore(raypai_home.artifact_uri),
        tracker_for(raypai_home),
        None,
    )
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x.txt").write_text("x")
    art = ctx.save(tmp_path / "out", kind="dataset")
    ctx.record_op_stats(art, [{"op_name": "dedup", "op_index": 0, "rows_in": 3, "rows_out": 2, "seconds": 0.1}])
    assert [r["op_name"] for r in store.op_stats(step_run_id=srid)] == ["dedup"]
    assert not hasattr(ctx, "store")  # no create_token, get_deployment, list_runs, ...
    reachable = {n for n in dir(ctx) if not n.startswith("_")}
    assert {"create_token", "get_deployment", "list_runs", "create_run"} <= set(dir(store))  # the names exist there
    assert not reachable & {"create_token", "get_deployment", "list_runs", "create_run"}, reachable


def test_the_dsl_builds_dags_without_importing_the_runner():
    """dsl.py ↔ runner.py was an import cycle (PipelineDef.run imported the runner); runner → dsl only."""
    import ast
    import dataclasses

    import raypai.dsl
    from raypai.runner import StepOutcome, StepResult, run_pipeline

    tree = ast.parse(Path(raypai.dsl.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "raypai.runner" not in imported
    assert not hasattr(toy, "run") and callable(run_pipeline)
    with pytest.raises(PipelineError, match=r"raypai.run_pipeline\(toy, ...\)"):
        toy()
    for frozen in (StepOutcome("succeeded"), StepResult("a", "id", "succeeded")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            frozen.state = "failed"
