"""`@step` and `@pipeline`: calling steps inside a pipeline function builds a DAG; nothing runs.

    @step(cpus=1, retries=2)
    def count(ctx, text: Artifact) -> dict: ...

    @pipeline
    def toy(n: int = 3):
        return count(write(n=n))

    run_pipeline(toy, n=5)    # raypai.runner; or: raypai run toy.py:toy --param n=5

This module only builds DAGs; raypai.runner executes them (the runner imports the DSL, never the
other way round).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import re
import threading
import typing
from dataclasses import dataclass, field

from raypai.config import coerce, type_name, unknown_key
from raypai.errors import ConfigError, PipelineError

_BUILD = threading.local()  # the DAG under construction while a @pipeline function body runs
# The parameter types checked when a pipeline is built; a StepOutput, a container or a class of the
# user's own is what the step it comes from (or the user) makes it.
_SIMPLE_TYPES = (int, float, str, bool)


@dataclass(frozen=True)
class StepOutput:
    """A handle on a step call's result inside a pipeline body; index it for a named output."""

    node: str
    key: str | None = None

    def __getitem__(self, key: str) -> "StepOutput":
        return StepOutput(self.node, key)

    def __bool__(self):
        raise PipelineError(
            f"the output of step call {self.node!r} was used as a condition while building the pipeline; "
            "outputs only exist when the pipeline runs: move the condition into a step"
        )


@dataclass
class Node:
    name: str
    step: "StepDef"
    args: dict  # param -> StepOutput | plain value

    def upstream(self) -> list[str]:
        return sorted({v.node for v in _walk_refs(self.args)})


@dataclass
class DAG:
    pipeline: str
    params: dict
    nodes: dict[str, Node] = field(default_factory=dict)
    result: object = None

    def order(self) -> list[str]:
        """Topological order; a cycle or a dangling reference is a PipelineError naming the nodes."""
        missing = [(n.name, u) for n in self.nodes.values() for u in n.upstream() if u not in self.nodes]
        if missing:
            raise PipelineError(
                f"pipeline {self.pipeline!r}: step inputs refer to unknown step calls {missing}; "
                "pass outputs of steps called in the same pipeline"
            )
        indeg = {n: len(self.nodes[n].upstream()) for n in self.nodes}
        ready = [n for n, d in indeg.items() if d == 0]
        out: list[str] = []
        while ready:
            cur = ready.pop(0)
            out.append(cur)
            for n in self.nodes.values():
                if cur in n.upstream():
                    indeg[n.name] -= 1
                    if indeg[n.name] == 0:
                        ready.append(n.name)
        if len(out) != len(self.nodes):
            cyc = sorted(set(self.nodes) - set(out))
            raise PipelineError(
                f"pipeline {self.pipeline!r} has a cycle through steps {cyc}; "
                "a step cannot consume its own (indirect) output"
            )
        return out


def _walk_refs(value):
    if isinstance(value, StepOutput):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _walk_refs(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _walk_refs(v)


class StepDef:
    """A function made into a pipeline step. Call it inside a @pipeline body."""

    def __init__(
        self,
        fn,
        *,
        name=None,
        cpus=1.0,
        gpus=0.0,
        memory=None,
        resources=None,
        retries=0,
        retry_delay_s=1.0,
        cache=True,
        libraries=None,
        cache_check=None,
        paths=(),
        import_paths=(),
    ):
        self.fn = fn
        self.name = name or fn.__name__
        self.identity = f"{fn.__module__}:{fn.__qualname__}"
        self.cpus, self.gpus, self.memory = float(cpus), float(gpus), memory
        self.resources = dict(resources or {})
        self.retries, self.retry_delay_s, self.cache = int(retries), float(retry_delay_s), bool(cache)
        # cache_check(value, store) -> None when a cached result still holds outside raypai's stores
        # (e.g. a deployment still serves it), else the reason it does not (the step then runs)
        if cache_check is not None and not callable(cache_check):
            raise ConfigError(
                [f"cache_check={cache_check!r} must be a function (value, store) -> str | None"],
                what=f"step {self.identity}",
            )
        self.cache_check = cache_check
        # distributions whose installed versions enter the cache key (None: raypai.cachekey's defaults)
        self.libraries = _check_libraries(self.identity, libraries)
        self.signature = inspect.signature(fn)
        hints = _hints(fn)
        from raypai.context import StepContext

        self.ctx_param = next((p for p in self.signature.parameters if p == "ctx" or hints.get(p) is StepContext), None)
        self.hints = hints
        # parameters that enter the cache key by what they name (raypai.cachekey): files or folders by
        # content (declared with paths=, or typed pathlib.Path), import paths 'mod:fn' by module source
        self.path_params = _declared(self, "paths", paths) | {p for p, h in hints.items() if _is_path_hint(h)}
        self.import_params = _declared(self, "import_paths", import_paths)
        functools.update_wrapper(self, fn)

    @functools.cached_property
    def source_hash(self) -> str:
        try:
            src = inspect.getsource(self.fn)
        except (OSError, TypeError):
            src = self.fn.__code__.co_code.hex()
        return hashlib.sha256(src.encode()).hexdigest()

    def named(self, node: str):
        """Call this step under a node name of your choosing: `load.named("eval_data")(path=...)`
        (shown in `raypai show`, the Ray dashboard and MLflow instead of `load_2`)."""
        if not valid_node_name(node):
            raise PipelineError(f"node name {node!r} is not allowed: use letters, digits and '_'")

        def call(*args, **kwargs):
            return self(*args, _node=node, **kwargs)

        return call

    def __call__(self, *args, _node: str | None = None, **kwargs):
        dag: DAG | None = getattr(_BUILD, "dag", None)
        if dag is None:
            raise PipelineError(
                f"step {self.name!r} was called outside a @pipeline function; call it inside "
                "one and run the pipeline, or call `{0}.fn(...)` to run the plain function".format(self.name)
            )
        params = [p for p in self.signature.parameters.values() if p.name != self.ctx_param]
        sig = inspect.Signature(params)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            valid = ", ".join(p.name for p in params) or "(none)"
            raise PipelineError(
                f"step {self.name!r} in pipeline {dag.pipeline!r}: {exc}; its parameters are: {valid}"
            ) from None
        bound.apply_defaults()
        args, problems = {}, []
        for pname, value in bound.arguments.items():
            args[pname], problem = _typed(f"step {self.name!r}", pname, value, self.hints.get(pname))
            problems += [problem] if problem else []
        if problems:
            raise ConfigError(problems, what=f"call of step {self.name!r}")
        name = _node or self.name
        if _node and name in dag.nodes:
            raise PipelineError(f"pipeline {dag.pipeline!r} already has a node named {name!r}")
        i = 2
        while name in dag.nodes:
            name, i = f"{self.name}_{i}", i + 1
        dag.nodes[name] = Node(name, self, args)
        return StepOutput(name)


def step(fn=None, **options):
    """Decorator: `@step` or `@step(cpus=2, gpus=0, retries=1, cache=True, memory=None, resources={},
    libraries=("transformers", "torch"), cache_check=None, paths=("data",), import_paths=("rewards",))`.
    `libraries` names the distributions (as pip names them) whose versions enter the step's cache key;
    by default raypai picks them (see raypai.cachekey). `paths` names the parameters holding a file,
    folder or URI (a parameter typed `pathlib.Path` is one too): they enter the key by content, so an
    edited file is a cache miss. `import_paths` names the parameters holding 'pkg.mod:fn' strings
    (one or a list): they enter the key by the source of those modules and what they import. `cache_check(value, store)` vets a cache hit against the world outside
    raypai's stores: it returns None when the cached value still holds, else the reason it does not
    (the step then runs again); the deploy step checks that its deployment still serves the version."""
    if fn is None:
        return lambda f: StepDef(f, **options)
    return StepDef(fn, **options)


class PipelineDef:
    def __init__(self, fn, name: str | None = None):
        self.fn = fn
        self.name = name or fn.__name__
        self.signature = inspect.signature(fn)
        self.hints = _hints(fn)
        functools.update_wrapper(self, fn)

    def build(self, **params) -> DAG:
        params = self.coerce_params(params)
        dag = DAG(self.name, params)
        if getattr(_BUILD, "dag", None) is not None:
            raise PipelineError("pipelines cannot be nested: call steps, not another pipeline, inside a pipeline")
        _BUILD.dag = dag
        try:
            dag.result = self.fn(**params)
        finally:
            _BUILD.dag = None
        if not dag.nodes:
            raise PipelineError(f"pipeline {self.name!r} calls no steps; call at least one @step function in its body")
        dag.order()
        return dag

    def coerce_params(self, params: dict) -> dict:
        """Check names and read values as the annotated types (raypai.config: `--param` text "3e-3" and
        "false" become numbers and booleans); all problems at once."""
        valid = list(self.signature.parameters)
        problems = [
            f"pipeline {self.name!r}: {unknown_key(k, valid, noun='parameter')}" for k in params if k not in valid
        ]
        out = {}
        for pname, p in self.signature.parameters.items():
            if pname in params:
                hint = self.hints.get(pname)
                value, problem = _typed(f"pipeline {self.name!r}", pname, params[pname], hint)
                if problem:
                    problems.append(f"{problem}; pass e.g. --param {pname}={_example(hint)}")
                    continue
                out[pname] = value
            elif p.default is inspect.Parameter.empty:
                problems.append(f"pipeline {self.name!r} needs parameter {pname!r}; pass --param {pname}=VALUE")
            else:
                out[pname] = p.default
        if problems:
            raise ConfigError(problems, what=f"parameters of pipeline {self.name!r}")
        return out

    def __call__(self, *args, **kwargs):
        raise PipelineError(
            f"pipeline {self.name!r} is run with `raypai.run_pipeline({self.name}, ...)` or "
            f"`raypai run FILE:{self.name}`"
        )


def pipeline(fn=None, *, name: str | None = None):
    """Decorator: `@pipeline` or `@pipeline(name="tinychat")`."""
    if fn is None:
        return lambda f: PipelineDef(f, name)
    return PipelineDef(fn, name)


def canonical(value) -> str:
    """Stable JSON of a parameter value (dataclasses and pydantic models included)."""
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), default=str)


def _plain(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump())
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _declared(step: StepDef, option: str, names) -> frozenset[str]:
    if isinstance(names, str) or not all(isinstance(x, str) for x in names):
        raise ConfigError([f"{option}={names!r} must be a tuple of parameter names"], what=f"step {step.identity}")
    unknown = [n for n in names if n not in step.signature.parameters]
    if unknown:
        raise ConfigError(
            [f"{option}: {unknown_key(n, list(step.signature.parameters), noun='parameter')}" for n in unknown],
            what=f"step {step.identity}",
        )
    return frozenset(names)


def _is_path_hint(hint) -> bool:
    """`Path`, `Path | None`, `list[Path]`."""
    from pathlib import PurePath

    if isinstance(hint, type) and typing.get_origin(hint) is None:
        return issubclass(hint, PurePath)
    return any(_is_path_hint(a) for a in typing.get_args(hint))


def _check_libraries(identity: str, libraries) -> tuple[str, ...] | None:
    if libraries is None:
        return None
    from raypai.cachekey import library_version

    if isinstance(libraries, str) or not all(isinstance(x, str) for x in libraries):
        raise ConfigError(
            [
                f"libraries={libraries!r} must be a tuple of distribution names, "
                'e.g. libraries=("transformers", "torch")'
            ],
            what=f"step {identity}",
        )
    missing = [x for x in libraries if library_version(x) is None]
    if missing:
        raise ConfigError(
            [
                f"library {x!r} is not installed, so its version cannot enter the cache key; "
                "name distributions as pip lists them (`pip list`)"
                for x in missing
            ],
            what=f"step {identity}",
        )
    return tuple(sorted(set(libraries)))


def _hints(fn) -> dict:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable forward refs: fall back to no type checks
        return {}


def _typed(owner: str, pname: str, value, hint) -> tuple[object, str | None]:
    """(`value` read as `hint` by the core's reader, the problem or None): "3" → 3, "false" → False,
    3.5 for an int or True for an int refused. An int where a float is wanted stays the int it was:
    arguments enter the cache key as given."""
    if isinstance(value, StepOutput) or hint not in _SIMPLE_TYPES or value is None:
        return value, None
    try:
        typed = coerce(hint, value)
    except ValueError:
        return value, f"{owner}: parameter {pname!r} must be {type_name(hint)} (got {type(value).__name__} {value!r})"
    return (value if hint is float and isinstance(value, int) else typed), None


def _example(hint) -> str:
    return {int: "3", float: "0.5", bool: "true"}.get(hint, "x")


def valid_node_name(name: str) -> bool:
    return bool(re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name))
