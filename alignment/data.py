"""Alignment datasets in the formats users already have (TRL's documented conventions), loaded
from files, raypai dataset artifacts or `datasets.save_to_disk` folders, validated before any actor
starts.

    rows = load_rows("chats.jsonl")                 # JSONL/Parquet file or folder, any pyarrow filesystem URI
    train, held = split(sft_examples(rows), eval_fraction=0.1, seed=0)

Formats (a prompt/completion is a string — "standard" — or a list of {role, content} messages —
"conversational"):
- SFT: `messages` (multi-turn; loss on the assistant turns) or `prompt` + `completion`.
- preference: `prompt` + `chosen` + `rejected`, or `chosen` + `rejected` conversations that share
  their opening turns (the implicit prompt).
- prompt-only (GRPO, PPO, online DPO): `prompt`; every other column reaches the reward functions
  as a keyword list (e.g. `answer`, `tests`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from raypai.chat import is_conversational
from raypai.errors import DataError

FORMATS = {
    "sft": "{'messages': [{'role': 'user', 'content': ...}, {'role': 'assistant', 'content': ...}, ...]} or "
    "{'prompt': ..., 'completion': ...}",
    "preference": "{'prompt': ..., 'chosen': ..., 'rejected': ...} or {'chosen': [messages], 'rejected': [messages]} "
    "sharing their opening turns",
    "prompt": "{'prompt': ..., <any extra column passed to the rewards>}",
}


@dataclass(frozen=True)
class SFTExample:
    prompt: object = None  # str | list[dict]; None for `messages` rows
    completion: object = None
    messages: list | None = None


@dataclass(frozen=True)
class PreferenceExample:
    prompt: object
    chosen: object
    rejected: object


@dataclass(frozen=True)
class PromptExample:
    prompt: object
    extras: dict = field(default_factory=dict)


# ---- sources ---------------------------------------------------------------------------------
def load_rows(source, *, name: str | None = None) -> list[dict]:
    """Rows of a dataset: a list of dicts, a JSONL/Parquet file or folder (local path or any URI
    pyarrow.fs understands), a raypai Artifact, or a `datasets.save_to_disk` folder."""
    if isinstance(source, list):
        return [dict(r) for r in source]
    if hasattr(source, "local_path") and hasattr(source, "kind"):  # a raypai Artifact
        return load_rows(str(source.local_path()), name=name or source.name)
    src = str(source)
    import pyarrow.fs as pafs

    fs, path = pafs.FileSystem.from_uri(src) if "://" in src else (pafs.LocalFileSystem(), str(Path(src).absolute()))
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise DataError(
            f"dataset {src!r} does not exist; pass a JSONL/Parquet file or folder, a raypai dataset "
            "artifact, or a datasets.save_to_disk folder"
        )
    if info.type == pafs.FileType.Directory:
        names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(path))}
        if "dataset_info.json" in names and "state.json" in names:
            return _load_hf(src)
        files = sorted(
            i.path
            for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
            if i.type == pafs.FileType.File and i.path.endswith((".jsonl", ".json", ".parquet"))
        )
        # a raypai dataset artifact: its rows file only (not the manifest or the store's commit marker)
        if "rows.jsonl" in names and "manifest.json" in names:
            files = [f for f in files if f.endswith("/rows.jsonl")]
        files = [
            f
            for f in files
            if not Path(f).name.startswith(("_", "."))
            and not f.endswith(("manifest.json", "rejected.parquet", "dropped.parquet"))
        ]
        if not files:
            raise DataError(f"dataset folder {src!r} holds no .jsonl/.json/.parquet files")
        return [r for f in files for r in _read_file(fs, f)]
    return _read_file(fs, path)


def _read_file(fs, path: str) -> list[dict]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path, filesystem=fs).to_pylist()
    with fs.open_input_stream(path) as f:
        text = f.read().decode("utf-8")
    if path.endswith(".json") and text.lstrip().startswith("["):
        return json.loads(text)
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{n} is not valid JSON ({e.msg}); every line of a JSONL file is one object"
                ) from e
    return rows


def _load_hf(path: str) -> list[dict]:
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"{path} is a `datasets.save_to_disk` folder; install the `datasets` package to read it") from e
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    return ds.to_list()


# ---- validation ------------------------------------------------------------------------------
def _require(rows: list[dict], kind: str, name: str) -> list[str]:
    if not rows:
        raise DataError(f"dataset {name} is empty; {kind} data needs at least one row of the form {FORMATS[kind]}")
    return sorted(rows[0])


def _missing(columns, kind: str, name: str) -> DataError:
    return DataError(f"dataset {name} has columns {columns}, which match no {kind} format; accepted: {FORMATS[kind]}")


def _check_field(value, what: str, where: str) -> None:
    if isinstance(value, str):
        return
    if is_conversational(value) and all(isinstance(m["content"], str) for m in value):
        return
    raise DataError(
        f"{where}: {what} must be a string or a list of {{'role', 'content'}} messages with string "
        f"content (got {type(value).__name__}: {str(value)[:80]!r})"
    )


def sft_examples(rows: list[dict], name: str = "(rows)") -> list[SFTExample]:
    cols = _require(rows, "sft", name)
    out = []
    for i, r in enumerate(rows):
        where = f"{name} row {i}"
        if "messages" in r:
            _check_field(r["messages"], "messages", where)
            if isinstance(r["messages"], str) or not any(m["role"] == "assistant" for m in r["messages"]):
                raise DataError(f"{where}: `messages` needs at least one assistant turn to learn from")
            out.append(SFTExample(messages=list(r["messages"])))
        elif "prompt" in r and ("completion" in r or "response" in r):
            comp = r["completion"] if "completion" in r else r["response"]
            _check_field(r["prompt"], "prompt", where)
            _check_field(comp, "completion", where)
            if isinstance(r["prompt"], str) != isinstance(comp, str):
                raise DataError(f"{where}: prompt and completion must both be strings or both message lists")
            out.append(SFTExample(prompt=r["prompt"], completion=comp))
        else:
            raise _missing(cols if i == 0 else sorted(r), "sft", name)
    return out


def preference_examples(rows: list[dict], name: str = "(rows)") -> list[PreferenceExample]:
    cols = _require(rows, "preference", name)
    out = []
    for i, r in enumerate(rows):
        where = f"{name} row {i}"
        if "chosen" not in r or "rejected" not in r:
            raise _missing(cols if i == 0 else sorted(r), "preference", name)
        for k in ("chosen", "rejected"):
            _check_field(r[k], k, where)
        if "prompt" in r:
            _check_field(r["prompt"], "prompt", where)
            out.append(PreferenceExample(r["prompt"], r["chosen"], r["rejected"]))
            continue
        c, rj = r["chosen"], r["rejected"]
        if isinstance(c, str) or isinstance(rj, str):
            raise DataError(
                f"{where}: without a `prompt` column, chosen and rejected must be conversations that "
                "share their opening turns (the implicit prompt)"
            )
        k = 0
        while k < min(len(c), len(rj)) and c[k] == rj[k]:
            k += 1
        if k == 0 or k == len(c) or k == len(rj):
            raise DataError(
                f"{where}: chosen and rejected share no opening turns (or one contains the other); add a "
                "`prompt` column"
            )
        out.append(PreferenceExample(c[:k], c[k:], rj[k:]))
    return out


def prompt_examples(rows: list[dict], name: str = "(rows)") -> list[PromptExample]:
    cols = _require(rows, "prompt", name)
    out = []
    for i, r in enumerate(rows):
        if "prompt" not in r:
            raise _missing(cols if i == 0 else sorted(r), "prompt", name)
        _check_field(r["prompt"], "prompt", f"{name} row {i}")
        out.append(PromptExample(r["prompt"], {k: v for k, v in r.items() if k != "prompt"}))
    keys = set(out[0].extras)
    for i, e in enumerate(out):
        if set(e.extras) != keys:
            raise DataError(
                f"{name} row {i} has extra columns {sorted(e.extras)}, row 0 has {sorted(keys)}: every row "
                "needs the same columns (the rewards receive each as one list)"
            )
    return out


def split(examples: list, eval_fraction: float = 0.1, seed: int = 0) -> tuple[list, list]:
    """A seeded (train, eval) split; eval gets at least one example."""
    if not 0 < eval_fraction < 1:
        raise DataError(f"eval_fraction must be in (0, 1) (got {eval_fraction})")
    if len(examples) < 2:
        raise DataError(f"a train/eval split needs at least 2 examples (got {len(examples)}); pass eval data instead")
    idx = list(range(len(examples)))
    random.Random(seed).shuffle(idx)
    n = max(1, int(round(len(idx) * eval_fraction)))
    return [examples[i] for i in sorted(idx[n:])], [examples[i] for i in sorted(idx[:n])]


KINDS = {"sft": sft_examples, "preference": preference_examples, "prompt": prompt_examples}


def load(source, kind: str, *, name: str | None = None) -> list:
    """Load and validate: `kind` is 'sft', 'preference' or 'prompt'."""
    return KINDS[kind](
        load_rows(source, name=name),
        name or str(getattr(source, "name", None) or ("(rows)" if isinstance(source, list) else source)),
    )
