"""Runner: executes a pipeline DAG on Ray, one Ray task per step call, ready steps concurrently.

Per step: cache key = sha256 over its components (raypai.cachekey: step source, params and input
digests, the code of the project modules it imports, library and raypai versions); a finished
step run with the same key whose outputs are still whole (committed, each file the size its marker
records) is reused (state `cached`), and the step run records why it was or was not a hit. Failed
steps retry with exponential backoff; their descendants are skipped, independent branches finish.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import cloudpickle

from raypai.artifacts import Artifact, ArtifactStore
from raypai.cachekey import KeyBuilder, cache_key, explain_miss
from raypai.dsl import DAG, StepOutput, canonical
from raypai.errors import PipelineError
from raypai.filedigests import FileDigests
from raypai.settings import Settings
from raypai.store import MetadataStore
from raypai.tracking import Tracker


@dataclass(frozen=True)
class StepOutcome:
    """What one attempt of a step, run as a Ray task, hands back to the runner: its state, the
    artifacts it produced by output name, its small JSON-able value, key metrics, or its error."""

    state: str  # succeeded | failed
    outputs: dict = field(default_factory=dict)  # name -> Artifact
    value: object = None
    metrics: dict = field(default_factory=dict)
    error: str | None = None
    traceback: str | None = None


@dataclass(frozen=True)
class StepResult:
    """A step call's result in a finished run (also what the progress display receives)."""

    node: str
    step_run_id: str
    state: str  # succeeded | cached | failed | skipped
    outputs: dict = field(default_factory=dict)  # name -> Artifact
    value: object = None
    seconds: float = 0.0
    error: str | None = None
    traceback: str | None = None
    metrics: dict = field(default_factory=dict)
    attempts: int = 1

    def output(self):
        if self.outputs:
            return self.outputs.get("output") or next(iter(self.outputs.values()))
        return self.value


@dataclass
class RunResult:
    run_id: str
    pipeline: str
    state: str
    steps: dict[str, StepResult]
    seconds: float
    mlflow_run_id: str | None
    result: object = None

    @property
    def ok(self) -> bool:
        return self.state == "succeeded"

    def __getitem__(self, node: str) -> StepResult:
        return self.steps[node]


def run_pipeline(
    pipe, *, settings: Settings | None = None, progress=None, origin_run_id: str | None = None, **params
) -> RunResult:
    """Build `pipe` (a @pipeline) with `params` and run it: `run_pipeline(toy, n=5)`."""
    import inspect

    dag = pipe.build(**params)
    return Runner(settings=settings, progress=progress).run(
        dag, origin_run_id=origin_run_id, source_file=inspect.getsourcefile(pipe.fn)
    )


def tracker_for(settings: Settings) -> Tracker:
    from raypai.runtime import tracker

    return tracker(settings)


class Runner:
    def __init__(self, settings: Settings | None = None, progress=None):
        self.settings = settings or Settings.load()
        self.progress = progress or _print_progress
        self.store = MetadataStore(self.settings.database_url)
        self.artifacts = ArtifactStore(self.settings.artifact_uri, cache_dir=self.settings.home / "cache")
        self.tracker = tracker_for(self.settings)
        # sha256 per user file by (size, mtime_ns): an unchanged big input is not read on every run
        self.file_digests = FileDigests(self.settings.home / "cache" / "file_digests.json")

    def run(self, dag: DAG, *, origin_run_id: str | None = None, source_file: str | None = None) -> RunResult:
        from raypai.progress import WorkerLogs
        from raypai.runtime import ensure_ray

        dag.order()  # a malformed DAG fails before Ray starts
        ray_info = ensure_ray(self.settings)
        # steps deploy on the Serve port chosen for this Ray (a free one when 8000 is taken)
        self.settings = self.settings.replace(serve_port=ray_info.serve_port)
        log = (
            self.settings.home / "logs" / (f"{dag.pipeline}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}.log")
        )
        # the workers' output goes to `log`; their progress lines reach self.progress as step_progress
        with WorkerLogs(log, dag.pipeline) as self._logs:
            self._ray = ray_info
            return self._run(dag, origin_run_id=origin_run_id, source_file=source_file)

    def _relay_logs(self) -> None:
        for event in self._logs.drain():
            self.progress(event)

    def _run(self, dag: DAG, *, origin_run_id: str | None, source_file: str | None) -> RunResult:
        import ray

        order = dag.order()
        t0 = time.time()
        run_id = self.store.create_run(
            dag.pipeline, _jsonable(dag.params), source_file=source_file, origin_run_id=origin_run_id
        )
        mlflow_parent = self.tracker.start_run(
            dag.pipeline, f"{dag.pipeline}-{run_id[:8]}", tags={"raypai.run_id": run_id}
        )
        self.tracker.logger(mlflow_parent).log_params(_jsonable(dag.params))
        self.store.update_run(run_id, mlflow_run_id=mlflow_parent, ray_job_id=_ray_job_id())
        self.progress(
            {
                "event": "run_started",
                "run_id": run_id,
                "pipeline": dag.pipeline,
                "steps": order,
                "log": str(self._logs.path),
                "ray": self._ray.describe(),
            }
        )
        _register_by_value(dag)

        results: dict[str, StepResult] = {}
        pending = list(order)
        running: dict = {}  # ObjectRef -> (node, step_run_id, attempt, started)
        waiting_retry: list = []  # (ready_at, node, step_run_id, attempt)
        while pending or running or waiting_retry:
            for node in list(pending):
                ups = dag.nodes[node].upstream()
                if any(results.get(u) and results[u].state in ("failed", "skipped") for u in ups):
                    pending.remove(node)
                    results[node] = self._skip(run_id, dag, node)
                elif all(u in results for u in ups):
                    pending.remove(node)
                    srid, cached = self._prepare(run_id, dag, node, results, origin_run_id)
                    if cached is not None:
                        results[node] = cached
                    else:
                        running[self._submit(run_id, dag, node, srid, 0, results, mlflow_parent)] = (
                            node,
                            srid,
                            0,
                            time.time(),
                        )
                        self.progress({"event": "step_started", "node": node})
            now = time.time()
            for item in [w for w in waiting_retry if w[0] <= now]:
                waiting_retry.remove(item)
                _, node, srid, attempt = item
                ref = self._submit(run_id, dag, node, srid, attempt, results, mlflow_parent)
                running[ref] = (node, srid, attempt, time.time())
            if not running:
                if waiting_retry:
                    time.sleep(min(max(0.0, min(w[0] for w in waiting_retry) - time.time()), 1.0))
                continue
            done, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
            self._relay_logs()
            for ref in done:
                node, srid, attempt, started = running.pop(ref)
                out = _get(ref)
                spec = dag.nodes[node].step
                if out.state == "failed" and attempt < spec.retries:
                    delay = spec.retry_delay_s * (2**attempt)
                    self.progress(
                        {
                            "event": "step_retry",
                            "node": node,
                            "attempt": attempt + 1,
                            "error": out.error,
                            "delay_s": delay,
                        }
                    )
                    waiting_retry.append((time.time() + delay, node, srid, attempt + 1))
                    continue
                res = StepResult(
                    node,
                    srid,
                    out.state,
                    dict(out.outputs),
                    out.value,
                    time.time() - started,
                    out.error,
                    out.traceback,
                    dict(out.metrics),
                    attempt + 1,
                )
                if res.state == "failed":
                    self.store.transition(srid, "failed", error=res.error, traceback=res.traceback)
                results[node] = res
                self.progress({"event": "step_finished", "node": node, "result": res})

        failed = [n for n, r in results.items() if r.state == "failed"]
        state = "failed" if failed else "succeeded"
        error = "; ".join(f"{n}: {results[n].error}" for n in failed) or None
        self.store.update_run(run_id, state=state, error=error)
        self.tracker.end_run(mlflow_parent, "FAILED" if failed else "FINISHED")
        rr = RunResult(
            run_id, dag.pipeline, state, results, time.time() - t0, mlflow_parent, _resolve(dag.result, results)
        )
        self._relay_logs()
        self.progress({"event": "run_finished", "result": rr})
        return rr

    # ---- per node --------------------------------------------------------------------------------

    def _inputs(self, dag: DAG, node: str, results: dict) -> dict:
        return {k: _resolve(v, results) for k, v in dag.nodes[node].args.items()}

    def cache_components(self, run_id: str, dag: DAG, node: str, inputs: dict) -> dict:
        """What the step call's cache key is made of (raypai.cachekey): step source, inputs, the code
        of the project modules it imports, library and raypai versions. Module closures are shared
        by the steps of one run."""
        if getattr(self, "_keys_run", None) != run_id:
            self._keys_run, self._keys = run_id, KeyBuilder(self.file_digests)
        return self._keys.components(dag.nodes[node].step, {k: _digest_view(v) for k, v in inputs.items()})

    def _prepare(self, run_id, dag, node, results, origin_run_id) -> tuple[str, StepResult | None]:
        """Record the step run with its cache key; (its id, the cached result when the cache has one,
        else None: the caller submits it)."""
        spec = dag.nodes[node].step
        inputs = self._inputs(dag, node, results)
        parts = self.cache_components(run_id, dag, node, inputs)
        key = cache_key(parts)
        params = {k: _jsonable(v) for k, v in inputs.items() if not _has_artifact(v)}
        hit, reason = self._cache_lookup(key, spec.cache or origin_run_id is not None, spec.cache_check, node=node)
        self.file_digests.save()  # raw sources checked by the lookup
        if reason is None:
            reason = self._explain_miss(dag, node, parts, params)
        srid = self.store.create_step_run(
            run_id, node, spec.identity, params, key, cache_components=parts, cache_reason=reason
        )
        if hit is not None:
            src = hit["step_run"]
            for name, art in hit["outputs"].items():
                self.store.add_edge(srid, art.id, name, direction="output")
            for pname, art in _artifacts_in(inputs):
                self.store.add_edge(srid, art.id, pname, direction="input")
            value = (src.get("result") or {}).get("value")
            self.store.transition(
                srid,
                "cached",
                cache_hit=True,
                cached_from=src["id"],
                result=src.get("result"),
                metrics=src.get("metrics") or {},
                mlflow_run_id=src.get("mlflow_run_id"),
            )
            res = StepResult(node, srid, "cached", hit["outputs"], value, 0.0, metrics=src.get("metrics") or {})
            self.progress({"event": "step_finished", "node": node, "result": res})
            return srid, res
        return srid, None

    def _cache_lookup(self, key: str, allowed: bool, check=None, *, node: str = "") -> tuple[dict | None, str | None]:
        """(the reusable earlier step run or None, why; None when a miss is still to be explained)."""
        if not allowed:
            return None, "cache off: the step is declared with cache=False"
        hit = self.store.find_cached(key)
        if hit is None:
            return None, None
        src = hit["step_run"]
        for name, art in hit["outputs"].items():
            # outputs deleted from the store, or committed files whose sizes differ (a truncated
            # write, a disk that lost blocks), or raw sources moved or edited: run again
            problems = _problems(self.artifacts, art, self.file_digests)
            if problems:
                reason = (
                    f"cache miss: run {src['run_id'][:8]} step {src['node']} had the same key, but its output "
                    f"{name} ({art.kind} {art.digest[:12]}…) at {art.uri} cannot be reused: {'; '.join(problems[:3])}"
                )
                if art.kind != "source" and "gone" not in problems[0]:  # damaged, not deleted: say so now
                    self.progress({"event": "artifact_damaged", "node": node, "reason": reason})
                return None, reason
        # the raw files it registered while it ran (ctx.register_source) must still hold what it read
        for art in self.store.inputs_of(src["id"]).values():
            if art.kind == "source" and _problems(self.artifacts, art, self.file_digests):
                return None, (
                    f"cache miss: run {src['run_id'][:8]} step {src['node']} had the same key, but the source "
                    f"it read, {art.uri}, is gone or changed (it held sha256 {art.digest[:12]}…)"
                )
        if check is not None:
            stale = check((src.get("result") or {}).get("value"), self.store)
            if stale:
                return None, (f"cache miss: run {src['run_id'][:8]} step {src['node']} had the same key, but {stale}")
        return hit, f"cache hit: same key as run {src['run_id'][:8]} step {src['node']}"

    def _explain_miss(self, dag: DAG, node: str, parts: dict, params: dict) -> str:
        before = self.store.last_keyed_step_run(parts["step"], pipeline=dag.pipeline, node=node)
        if before is None:
            return "cache miss: no earlier run of this step recorded its key"
        why = explain_miss(parts, before["cache_components"], params_now=params, params_before=before["params"])
        why = why[:4] + ([f"{len(why) - 4} more differences"] if len(why) > 4 else [])
        text = "; ".join(why) or "the key is unchanged, but no succeeded run with it is on record"
        return f"cache miss: {text} (compared with run {before['run_id'][:8]} step {before['node']})"

    def _submit(self, run_id, dag, node, srid, attempt, results, mlflow_parent):

        spec = dag.nodes[node].step
        inputs = self._inputs(dag, node, results)
        # SPREAD: on a cluster, concurrent steps go to different nodes rather than packing the head
        opts = {
            "num_cpus": spec.cpus,
            "num_gpus": spec.gpus,
            "name": f"{dag.pipeline}.{node}",
            "max_retries": 0,
            "scheduling_strategy": "SPREAD",
        }
        if spec.memory:
            opts["memory"] = spec.memory
        if spec.resources:
            opts["resources"] = spec.resources
        payload = {
            "settings": self.settings,
            "run_id": run_id,
            "step_run_id": srid,
            "node": node,
            "pipeline": dag.pipeline,
            "attempt": attempt,
            "mlflow_parent": mlflow_parent,
            "cache_key": self.store.get_step_run(srid)["cache_key"],
        }
        return _remote_execute().options(**opts).remote(payload, spec, inputs)

    def _skip(self, run_id, dag, node) -> StepResult:
        spec = dag.nodes[node].step
        srid = self.store.create_step_run(run_id, node, spec.identity, {}, None)
        self.store.transition(srid, "skipped", detail="an upstream step failed")
        res = StepResult(node, srid, "skipped", error="upstream step failed")
        self.progress({"event": "step_finished", "node": node, "result": res})
        return res


def _execute_step_impl(payload: dict, spec, inputs: dict) -> StepOutcome:
    """Runs inside the Ray task: one attempt of one step run, recorded from start to end."""
    import ray

    from raypai.context import StepContext

    settings: Settings = payload["settings"]
    store = MetadataStore(settings.database_url, migrate_schema=False)
    tracker = tracker_for(settings)
    srid = payload["step_run_id"]
    ctx_rt = ray.get_runtime_context()
    mlflow_run = tracker.start_run(
        payload["pipeline"],
        payload["node"],
        parent_run_id=payload["mlflow_parent"],
        tags={"raypai.step_run_id": srid, "raypai.step": spec.identity},
    )
    store.transition(
        srid,
        "running",
        attempt=payload["attempt"],
        mlflow_run_id=mlflow_run,
        ray_task_id=ctx_rt.get_task_id(),
        ray_node_id=ctx_rt.get_node_id(),
    )
    logger = tracker.logger(mlflow_run)
    ctx = StepContext(
        settings,
        payload["run_id"],
        srid,
        payload["node"],
        payload["pipeline"],
        store,
        ArtifactStore(settings.artifact_uri, cache_dir=settings.home / "cache"),
        tracker,
        logger,
        attempt=payload["attempt"],
        cache_key=payload.get("cache_key"),
    )
    try:
        logger.log_params({k: _jsonable(v) for k, v in inputs.items() if not _has_artifact(v)})
        for pname, art in _artifacts_in(inputs):
            store.add_edge(srid, art.id, pname, direction="input")
            logger.log_dataset(art)
        kwargs = dict(inputs)
        if spec.ctx_param:
            kwargs[spec.ctx_param] = ctx
        value = spec.fn(**kwargs)
        outputs, plain = _split_result(spec.name, value)
        for name, art in outputs.items():
            store.add_edge(srid, art.id, name, direction="output")
        result = {"value": plain, "outputs": sorted(outputs)}
        store.transition(srid, "succeeded", result=result, metrics=ctx.key_metrics)
        tracker.end_run(mlflow_run, "FINISHED")
        return StepOutcome("succeeded", dict(outputs), plain, dict(ctx.key_metrics))
    except BaseException as exc:  # noqa: BLE001 - a step failure is data, reported to the driver
        tb = traceback.format_exc()
        msg = f"{type(exc).__name__}: {exc}"
        store.transition(srid, "failed", error=msg, traceback=tb, detail=f"attempt {payload['attempt']}")
        try:
            logger.set_tags({"raypai.error": msg[:4000]})
            tracker.end_run(mlflow_run, "FAILED")
        except Exception:  # noqa: BLE001 - tracking must not mask the step's own error
            pass
        return StepOutcome("failed", error=msg, traceback=tb)
    finally:
        ctx.cleanup()


def _remote_execute():
    import ray

    global _EXECUTE
    if _EXECUTE is None:
        _EXECUTE = ray.remote(_execute_step_impl)
    return _EXECUTE


_EXECUTE = None


def _problems(store: ArtifactStore, art: Artifact, digests: FileDigests) -> list[str]:
    """Why `art` cannot be reused ([] when it can). Raw sources live outside the store (recorded,
    not copied): they count while their path holds the content recorded (its digest, by the
    size/mtime fast path when unchanged). A stored artifact counts while it is committed and each
    file has the size its commit marker records."""
    if art.kind == "source" and "://" not in art.uri:
        return [] if digests.of(art.uri).get("sha256") == art.digest else ["it is gone or changed"]
    return store.problems(art.uri)


def _split_result(step_name: str, value) -> tuple[dict, object]:
    if isinstance(value, Artifact):
        return {"output": value}, None
    if isinstance(value, dict) and value and all(isinstance(v, Artifact) for v in value.values()):
        return dict(value), None
    if isinstance(value, dict) and any(isinstance(v, Artifact) for v in value.values()):
        arts = {k: v for k, v in value.items() if isinstance(v, Artifact)}
        return arts, _jsonable({k: v for k, v in value.items() if k not in arts})
    try:
        canonical(value)
    except (TypeError, ValueError) as err:
        raise PipelineError(
            f"step {step_name!r} returned a {type(value).__name__}, which cannot be recorded; "
            "return an Artifact (ctx.save(...)), a dict of Artifacts, or a small JSON-able value"
        ) from err
    return {}, _jsonable(value)


def _resolve(value, results: dict):
    if isinstance(value, StepOutput):
        res = results[value.node]
        if value.key is None:
            return res.output()
        if value.key in res.outputs:
            return res.outputs[value.key]
        if isinstance(res.value, dict) and value.key in res.value:
            return res.value[value.key]
        raise PipelineError(
            f"step {value.node!r} has no output {value.key!r}; it produced "
            f"{sorted(res.outputs) or sorted(res.value or {})}"
        )
    if isinstance(value, dict):
        return {k: _resolve(v, results) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_resolve(v, results) for v in value)
    return value


def _digest_view(value):
    """What of an input enters the cache key: an artifact's digest, a plain value as itself."""
    if isinstance(value, Artifact):
        return {"artifact": value.kind, "digest": value.digest}
    if isinstance(value, dict):
        return {k: _digest_view(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_digest_view(v) for v in value]
    return value


def _artifacts_in(inputs: dict):
    for k, v in inputs.items():
        if isinstance(v, Artifact):
            yield k, v
        elif isinstance(v, list | tuple):
            yield from ((f"{k}[{i}]", a) for i, a in enumerate(v) if isinstance(a, Artifact))
        elif isinstance(v, dict):
            yield from ((f"{k}.{n}", a) for n, a in v.items() if isinstance(a, Artifact))


def _has_artifact(v) -> bool:
    return any(True for _ in _artifacts_in({"x": v}))


def _jsonable(value):
    import json

    return json.loads(canonical(value))


def _get(ref) -> StepOutcome:
    import ray

    try:
        return ray.get(ref)
    except Exception as exc:  # noqa: BLE001 - the worker died (OOM, killed): no structured result
        return StepOutcome("failed", error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}", traceback=str(exc))


def _ray_job_id() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().get_job_id()
    except Exception:  # noqa: BLE001
        return None


def _register_by_value(dag: DAG) -> None:
    """Steps defined in a file loaded by path are pickled by value so workers need not import it."""
    for n in dag.nodes.values():
        mod = sys.modules.get(n.step.fn.__module__)
        if mod is not None and getattr(mod, "__raypai_by_value__", False):
            cloudpickle.register_pickle_by_value(mod)


def _print_progress(event: dict) -> None:
    kind = event["event"]
    if kind == "run_started":
        print(
            f"run {event['run_id'][:8]} of {event['pipeline']}: {len(event['steps'])} steps; "
            f"worker logs: {event['log']}",
            flush=True,
        )
    elif kind == "step_started":
        print(f"  ▶ {event['node']} started", flush=True)
    elif kind == "artifact_damaged":
        print(f"  ! {event['node']}: {event['reason']}", flush=True)
    elif kind == "step_retry":
        print(f"  ↻ {event['node']} retry {event['attempt']} in {event['delay_s']:.1f}s: {event['error']}", flush=True)
    elif kind == "step_finished":
        r: StepResult = event["result"]
        extra = f" ({r.error})" if r.error else ""
        print(
            f"  {'✓' if r.state in ('succeeded', 'cached') else '✗'} {r.node} {r.state} in {r.seconds:.1f}s{extra}",
            flush=True,
        )
    elif kind == "run_finished":
        rr: RunResult = event["result"]
        print(f"run {rr.run_id[:8]} {rr.state} in {rr.seconds:.1f}s", flush=True)
