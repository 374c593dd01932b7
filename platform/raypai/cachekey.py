"""Cache keys that see code changes, and the reason a step was or was not a cache hit.

    keys = KeyBuilder()                        # one per pipeline run: shares module closures between steps
    parts = keys.components(step_def, inputs)  # what the key is made of (stored with the step run)
    key = cache_key(parts)                     # sha256 over the parts
    explain_miss(parts, earlier_parts)         # ["code of raypai.data.ops.filters changed", ...]

A key is made of:
  - `step`, `source`: the step's identity `module:function` and its function source;
  - `inputs`: per parameter, a digest of its value (artifacts by content digest);
  - `code`: a digest per module of the user's project that the step's module imports, directly or
    transitively, the step's module included. "Project" means source files outside the Python
    installation (stdlib, site-packages): the user's own packages, editable installs, and raypai
    itself when installed editable. Imports are read from the source (`import`/`from` statements
    anywhere in a module, function bodies included), so nothing is imported to compute a key;
  - `libraries`: versions of the distributions the step declares (`@step(libraries=(...))`), else
    `BUILTIN_LIBRARIES` for raypai's own steps, else the third-party packages that the step's
    project modules import;
  - `raypai`: the installed version; for an editable install also a digest of every file of its
    packages (data files such as word lists included), which catches code reached by import path;
  - `files` (only when the step declares path parameters: `@step(paths=(...))` or a `pathlib.Path`
    type): per parameter the file's or folder's content digest (raypai.filedigests; a URI by its
    listing), so an edited file under the same path is a miss;
  - `refs` (only when the step declares `@step(import_paths=(...))`): per 'pkg.mod:fn' named, the
    digests of its module's project closure, as for the step's own imports.

File digests are cached per process: the user's files by (path, mtime, size), so an edit between
two runs in one process counts; raypai's own files once per process (the platform the process runs).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import site
import sys
import sysconfig
from pathlib import Path

from raypai.filedigests import FileDigests

__all__ = ["BUILTIN_LIBRARIES", "KeyBuilder", "cache_key", "explain_miss", "library_version"]

COMPONENTS_VERSION = 1

# Libraries whose version can change what a built-in step computes (tokenizer merges, kernels,
# model code, Ray Data block order). A step's own `libraries=` replaces its entry.
BUILTIN_LIBRARIES: dict[str, tuple[str, ...]] = {
    "raypai.data.steps": ("ray", "pyarrow", "numpy", "tokenizers", "transformers"),
    "raypai.train.steps": ("ray", "torch", "transformers", "tokenizers", "deepspeed", "safetensors", "pyarrow"),
    "raypai.alignment.steps": ("ray", "torch", "transformers", "tokenizers", "deepspeed", "safetensors", "datasets"),
    "raypai.serving.steps": ("ray", "torch", "transformers", "tokenizers"),
    "raypai.pipelines.toy": (),
}


def cache_key(components: dict) -> str:
    return hashlib.sha256(_canonical(components).encode()).hexdigest()


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]  # 128 bits per part; the key itself is a full sha256


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


@functools.lru_cache(maxsize=None)
def library_version(dist: str) -> str | None:
    """Installed version of a distribution (pip's name, e.g. "transformers"), None when absent."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- files and imports -----------------------------------------------------------------------------


class _Source:
    """A file's digest; for Python files also its import statements, parsed on first use."""

    def __init__(self, data: bytes, is_python: bool):
        self.digest = _digest(data)
        self._data = data if is_python else None
        self._imports: tuple | None = None if is_python else ()

    @property
    def imports(self) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
        """(level, module, names) per import statement, function bodies included."""
        if self._imports is None:
            self._imports, self._data = _imports(self._data), None
        return self._imports


_SOURCES: dict[tuple, _Source] = {}  # process-wide memo: (path,) for raypai's files, (path, mtime, size) else


def _read_source(path: str, *, stable: bool) -> _Source:
    st = os.stat(path)
    memo = (path,) if stable else (path, st.st_mtime_ns, st.st_size)
    hit = _SOURCES.get(memo)
    if hit is None:
        hit = _SOURCES[memo] = _Source(Path(path).read_bytes(), path.endswith(".py"))
    return hit


def _imports(data: bytes) -> tuple:
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return ()  # the module cannot run either; its digest still enters the key
    out = []
    for n in _statements(tree.body):
        if isinstance(n, ast.Import):
            out += [(0, a.name, ()) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            out.append((n.level, n.module or "", tuple(a.name for a in n.names if a.name != "*")))
    return tuple(out)


def _statements(body: list):
    """Every statement, nested ones included (imports are statements: expressions need no visit)."""
    for n in body:
        yield n
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            sub = getattr(n, name, None)
            if isinstance(sub, list):
                yield from _statements(sub)


def _imported_names(module: str, is_package: bool, imports) -> list[str]:
    """Absolute module names an import statement may load (parent packages included)."""
    names: list[str] = []
    for level, mod, attrs in imports:
        if level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (level - 1)] if level > 1 else base
            mod = ".".join([*base, mod] if mod else base)
        if not mod:
            continue
        names += [mod, *(f"{mod}.{a}" for a in attrs)]  # `from pkg import sub` may name a submodule
    out = []
    for name in names:
        parts = name.split(".")
        out += [".".join(parts[: i + 1]) for i in range(len(parts))]
    return list(dict.fromkeys(out))


@functools.lru_cache(maxsize=1)
def _installed_dirs() -> tuple[str, ...]:
    """Folders of the Python installation: stdlib and site-packages (never the user's project)."""
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        dirs |= set(site.getsitepackages()) | {site.getusersitepackages()}
    except AttributeError:  # some embedded interpreters have no site helpers
        pass
    return tuple(sorted(os.path.realpath(d) + os.sep for d in dirs if d))


def _is_installed(path: str) -> bool:
    return os.path.realpath(path).startswith(_installed_dirs())


def _find_spec(name: str):
    """The module spec of `name` without importing it (parents already imported are used as they are)."""
    mod = sys.modules.get(name)
    if mod is not None:
        spec = getattr(mod, "__spec__", None)
        if spec is None and getattr(mod, "__file__", None):
            return importlib.util.spec_from_file_location(name, mod.__file__)
        return spec
    parent = name.rpartition(".")[0]
    path = None
    if parent:
        pspec = _find_spec(parent)
        if pspec is None or not pspec.submodule_search_locations:
            return None
        path = list(pspec.submodule_search_locations)
    for finder in sys.meta_path:  # what importlib does, minus executing parents
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(name, path)
        except (ImportError, ValueError, AttributeError, TypeError):
            continue
        if spec is not None:
            return spec
    return None


def _is_raypai(name: str) -> bool:
    return name == "raypai" or name.startswith("raypai.")


# ---- raypai itself ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def raypai_version() -> str:
    """ "0.1.0", or "0.1.0+src.<digest of its package files>" when raypai runs from a source tree."""
    import raypai

    version = getattr(raypai, "__version__", None) or library_version("raypai") or "unknown"
    if _is_installed(raypai.__file__):
        return version
    h = hashlib.sha256()
    for root in _raypai_roots():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
            for f in sorted(filenames):
                if f.startswith(".") or f.endswith((".pyc", ".pyo")):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root.parent)
                h.update(f"{rel}\0{_read_source(path, stable=True).digest}\n".encode())
    return f"{version}+src.{h.hexdigest()[:16]}"


def _raypai_roots() -> list[Path]:
    """raypai's package folders in a source tree: `raypai/` and, for an editable install, the
    subpackages mapped to other folders of the project (pyproject's package-dir puts raypai.data in
    data/, ...), found by asking the import system about each folder of the project."""
    import raypai

    main = Path(raypai.__file__).resolve().parent
    roots = [main]
    project = _editable_project()
    if project is None:
        return roots
    for d in sorted(p for p in project.iterdir() if (p / "__init__.py").is_file()):
        spec = _find_spec(f"raypai.{d.name}")
        locs = list(spec.submodule_search_locations or []) if spec is not None else []
        if any(Path(loc).resolve() == d.resolve() for loc in locs) and d.resolve() != main:
            roots.append(d.resolve())
    return roots


def _editable_project() -> Path | None:
    """The project folder of an editable install of raypai (PEP 610 direct_url.json), else None."""
    from urllib.parse import unquote, urlparse

    try:
        info = json.loads(importlib.metadata.distribution("raypai").read_text("direct_url.json") or "{}")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
    url = urlparse(info.get("url", ""))
    if not info.get("dir_info", {}).get("editable") or url.scheme != "file":
        return None
    path = Path(unquote(url.path))
    return path if path.is_dir() else None


@functools.lru_cache(maxsize=1)
def _distributions_of() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


# ---- components ------------------------------------------------------------------------------------


class KeyBuilder:
    """Cache-key components for the steps of one run. Module closures are computed once per run
    (steps of one module share them); file digests are cached per process (see the module doc)."""

    def __init__(self, digests: FileDigests | None = None):
        self.digests = digests or FileDigests()  # the runner passes one kept in the raypai home
        self._closures: dict[str, tuple[dict[str, str], frozenset[str]]] = {}
        self._resolved: dict[str, tuple[str, str | None]] = {}

    def components(self, step, inputs_view: dict) -> dict:
        """`step` is a StepDef; `inputs_view` maps each parameter to its JSON-able key view."""
        module = step.fn.__module__
        code, third_party = self._closure(module)
        return {
            "v": COMPONENTS_VERSION,
            "step": step.identity,
            "source": step.source_hash[:32],
            "inputs": {k: _digest(_canonical(v).encode()) for k, v in sorted(inputs_view.items())},
            "code": code,
            "libraries": {d: library_version(d) for d in sorted(self._libraries(step, module, third_party))},
            "raypai": raypai_version(),
            **self._named(step, inputs_view),
        }

    def _named(self, step, inputs_view: dict) -> dict:
        """`files` and `refs`: what the step's path and import-path parameters name, by content."""
        files = {
            p: _each(inputs_view[p], self.digests.of)
            for p in sorted(getattr(step, "path_params", ()))
            if inputs_view.get(p) not in (None, "", [], ())
        }
        refs: dict[str, dict[str, str]] = {}
        for p in sorted(getattr(step, "import_params", ())):
            for ref in _import_refs(inputs_view.get(p)):
                refs[ref] = self._closure(_module_of(ref))[0]
        return {k: v for k, v in (("files", files), ("refs", refs)) if v}

    @staticmethod
    def _libraries(step, module: str, third_party: frozenset[str]) -> set[str]:
        if step.libraries is not None:
            return set(step.libraries)
        if module in BUILTIN_LIBRARIES:
            return set(BUILTIN_LIBRARIES[module])
        dists = _distributions_of()
        return {d for top in third_party for d in dists.get(top, ()) if d.lower() != "raypai"}

    def _resolve(self, name: str) -> tuple[str, str | None]:
        """(kind, file): kind is "project", "installed" or "skip" (stdlib, builtin, missing)."""
        got = self._resolved.get(name)
        if got is None:
            top = name.partition(".")[0]
            spec = None if top in sys.stdlib_module_names else _find_spec(name)
            origin = getattr(spec, "origin", None) if spec is not None else None
            if spec is None or not origin or not os.path.isfile(origin):
                got = ("skip", None)  # stdlib, builtin, namespace package, or not a module at all
            elif _is_installed(origin):
                got = ("installed", origin)
            else:
                got = ("project", origin)
            self._resolved[name] = got
        return got

    def _closure(self, root: str) -> tuple[dict[str, str], frozenset[str]]:
        """(digest per project module reachable from `root`, third-party top-level packages that the
        user's (non-raypai) modules among them import)."""
        if root in self._closures:
            return self._closures[root]
        code: dict[str, str] = {}
        third_party: set[str] = set()
        queue = [root]
        while queue:
            name = queue.pop()
            if name in code:
                continue
            kind, origin = self._resolve(name)
            if kind != "project":
                continue
            src = _read_source(origin, stable=_is_raypai(name))
            code[name] = src.digest
            is_pkg = os.path.basename(origin) == "__init__.py"
            for dep in _imported_names(name, is_pkg, src.imports):
                dep_kind, _ = self._resolve(dep)
                if dep_kind == "project":
                    queue.append(dep)
                elif dep_kind == "installed" and not _is_raypai(name) and "." not in dep:
                    third_party.add(dep)
        out = (dict(sorted(code.items())), frozenset(third_party))
        self._closures[root] = out
        return out


def _each(value, fn):
    return [fn(v) for v in value] if isinstance(value, list | tuple) else fn(value)


def _import_refs(value) -> list[str]:
    """'pkg.mod:fn' strings in a parameter: one string, a list (of strings or (string, weight)
    pairs) or a {string: weight} dict; a trailing '=weight' is no part of the name."""
    if isinstance(value, dict):
        value = list(value)
    items = value if isinstance(value, list | tuple) else [value]
    names = [(i[0] if isinstance(i, list | tuple) and i else i) for i in items]
    return sorted({n.partition("=")[0].strip() for n in names if isinstance(n, str) and n.strip()})


def _module_of(ref: str) -> str:
    mod, sep, _ = ref.partition(":")
    return mod if sep else ref.rpartition(".")[0]


# ---- why (not) a hit -------------------------------------------------------------------------------


def explain_miss(
    now: dict, before: dict | None, *, params_now: dict | None = None, params_before: dict | None = None
) -> list[str]:
    """What differs between two steps' key components, most telling first; [] when nothing does."""
    if not before:
        return ["no earlier run of this step recorded its key"]
    if before.get("v") != now.get("v"):
        return ["the earlier run's key was computed by another raypai version"]
    why: list[str] = _named_changes(now, before)
    module = now["step"].partition(":")[0]
    if now["source"] != before.get("source"):
        why.append(f"the step function {now['step']} changed")
    changed, added, removed = _dict_diff(now["code"], before.get("code", {}))
    if module in changed and now["source"] != before.get("source"):
        changed.remove(module)  # already said: the step function itself changed
    if changed:
        why.append(f"code of {_names(changed)} changed")
    if added:
        why.append(f"it now imports {_names(added)}")
    if removed:
        why.append(f"it no longer imports {_names(removed)}")
    lib_changed, lib_added, lib_removed = _dict_diff(now["libraries"], before.get("libraries", {}))
    why += [f"library {d} {before['libraries'][d]} → {now['libraries'][d]}" for d in lib_changed]
    why += [f"library {d} {now['libraries'][d]} is now part of the key" for d in lib_added]
    why += [f"library {d} is no longer part of the key" for d in lib_removed]
    rp_now, rp_before = now["raypai"], before.get("raypai", "")
    if rp_now != rp_before:
        v_now, v_before = rp_now.partition("+")[0], rp_before.partition("+")[0]
        if v_now != v_before:
            why.append(f"raypai {v_before} → {v_now}")
        elif not any(_is_raypai(m) for m in changed + added + removed):
            why.append("raypai's source changed outside this step's imports (editable install)")
    in_changed, in_added, in_removed = _dict_diff(now["inputs"], before.get("inputs", {}))
    for p in in_changed:
        a, b = (params_before or {}).get(p), (params_now or {}).get(p)
        why.append(
            f"parameter {p} {_short(a)} → {_short(b)}" if a is not None and b is not None else f"input {p} changed"
        )
    why += [f"new parameter {p}" for p in in_added] + [f"parameter {p} removed" for p in in_removed]
    return why


def _named_changes(now: dict, before: dict) -> list[str]:
    """What changed in the files and import-path code a step's parameters name (a renamed path or
    an added reward is said by the parameter's own line)."""
    why = []
    files_now, files_before = now.get("files", {}), before.get("files", {})
    for p in _dict_diff(files_now, files_before)[0]:
        a, b = files_now[p], files_before[p]
        if isinstance(a, dict) and isinstance(b, dict):
            if a.get("path", a.get("uri")) == b.get("path", b.get("uri")):
                why.append(_file_change(a, b))
        else:
            why.append(f"the files of parameter {p} changed")
    refs_now, refs_before = now.get("refs", {}), before.get("refs", {})
    for ref in _dict_diff(refs_now, refs_before)[0]:
        mods = _dict_diff(refs_now[ref], refs_before[ref])
        why.append(f"{ref.replace(':', '.')} changed (code of {_names(sorted(set().union(*mods)))})")
    return why


def _file_change(now: dict, before: dict) -> str:
    where = now.get("path") or now.get("uri") or "?"
    name = os.path.basename(where.rstrip("/")) or where
    if now.get("missing"):
        return f"{name} is gone ({where})"
    if "sha256" in now:
        old = before.get("sha256", "none")[:12]
        return f"{name} changed: sha256 {old}… → {now['sha256'][:12]}… ({now['bytes']} bytes, {where})"
    return f"{name} changed: its listing (object sizes and times) differs ({where})"


def _dict_diff(now: dict, before: dict) -> tuple[list[str], list[str], list[str]]:
    changed = sorted(k for k in now if k in before and now[k] != before[k])
    return changed, sorted(set(now) - set(before)), sorted(set(before) - set(now))


def _names(mods: list[str], limit: int = 4) -> str:
    if len(mods) <= limit:
        return ", ".join(mods)
    return f"{', '.join(mods[:limit])} and {len(mods) - limit} more"


def _short(value) -> str:
    text = _canonical(value)
    return text if len(text) <= 40 else text[:37] + "..."
