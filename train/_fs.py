"""Local folders and remote URIs (`s3://bucket/prefix`) behind one pyarrow filesystem interface,
for token shards and checkpoint storage alike."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs


def is_remote(location: str | Path) -> bool:
    return "://" in str(location) and not str(location).startswith("file://")


def resolve(location: str | Path) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it): a URI through pyarrow (credentials and `AWS_ENDPOINT_URL` from
    the environment, as for the artifact store); anything else is an absolute local path."""
    if is_remote(location):
        return pafs.FileSystem.from_uri(str(location))
    return pafs.LocalFileSystem(), str(Path(str(location).removeprefix("file://")).absolute())


def join(location: str | Path, *parts: str) -> str:
    """`location/part/...` keeping a URI a URI (pathlib would fold `s3://` into `s3:/`)."""
    return "/".join([str(location).rstrip("/"), *parts])


def read_json(fs: pafs.FileSystem, path: str) -> dict | None:
    """A JSON file's content, or None where there is no such file."""
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def read_text(fs: pafs.FileSystem, path: str) -> str | None:
    try:
        with fs.open_input_stream(path) as f:
            return f.read().decode()
    except FileNotFoundError:
        return None
