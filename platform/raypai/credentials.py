"""Secrets kept out of what raypai prints and ships: one redaction function for every URL shown, and
database passwords handed to Ray workers and jobs by reference (a file of mode 0600), never by value.

    redact_url("postgresql+psycopg://app:s3cret@db:5432/raypai")   # 'postgresql+psycopg://app:***@db:5432/raypai'
    redact_params({"db": "postgresql://app:s3cret@db/x", "api_token": "abc"})  # {'db': '…app:***@db/x', 'api_token': '***'}
    worker_secret_env(settings)   # {'PGPASSFILE': '$RAYPAI_HOME/secrets/pgpass'}; the file is written 0600

Ray shows a runtime_env's variables in its dashboard and writes them to its logs, so the settings a
worker or job gets (`Settings.to_env`) carry database URLs without their password. The password goes
where libpq (psycopg, under SQLAlchemy and MLflow) looks for it by itself when a URL has none:
`PGPASSFILE`, a pgpass file of mode 0600 (libpq ignores one that others can read), or `PGPASSWORD`
in the node's own environment (a Kubernetes Secret, infra/k8s). A job sent to a remote cluster gets
no password at all: that cluster's nodes hold it (docs/production.md, "Secrets").
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

__all__ = [
    "REDACTED",
    "pgpass_env",
    "redact_params",
    "redact_url",
    "strip_password",
    "url_password",
    "worker_secret_env",
    "write_private",
]

REDACTED = "***"
# scheme://user:password@ anywhere in a text: the password is what lies between ':' and the last '@'
# before the host (a password may itself hold '@', ':' or '/' when written unescaped)
_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@]*:)(?P<password>[^\s/]*)(?P<tail>@[^\s@/]+)")
# query parameters that carry a secret: ?password=..., &sslpassword=..., &token=...
_SECRET_QUERY = re.compile(r"(?P<head>[?&](?:[a-z_]*password|passwd|token|secret|api_key)=)(?P<value>[^&\s#]*)", re.I)
# parameter names whose values are secrets whatever they look like
_SECRET_KEY = re.compile(r"pass(word|wd)?$|secret|token|api_?key|access_?key|credential|private_?key", re.I)
_POSTGRES = ("postgresql", "postgresql+psycopg", "postgresql+psycopg2", "postgres")


def redact_url(text: str) -> str:
    """`text` with the password of every URL in it (and secret query parameters) replaced by ***:
    a URL, an error message or a log line. The one function raypai prints URLs through."""
    if not isinstance(text, str) or "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(lambda m: m["head"] + (REDACTED if m["password"] else "") + m["tail"], text)
    return _SECRET_QUERY.sub(lambda m: m["head"] + REDACTED, text)


def redact_params(params):
    """Parameters as they may be shown or logged (MLflow params and tags): values under a secret-looking
    name (password, token, secret, api_key, ...) become ***, URLs lose their passwords; nested
    dicts and lists are walked."""
    if isinstance(params, dict):
        return {
            k: REDACTED if _SECRET_KEY.search(str(k)) and v not in (None, "") else redact_params(v)
            for k, v in params.items()
        }
    if isinstance(params, list | tuple):
        return type(params)(redact_params(v) for v in params)
    return redact_url(params) if isinstance(params, str) else params


def url_password(url: str) -> str | None:
    """The (decoded) password of `url`, None when it has none."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return None
    return unquote(password) if password else None


def strip_password(url: str) -> str:
    """`url` without its password (user, host, database and options kept): what may travel in an
    environment variable that Ray shows."""
    if url_password(url) is None:
        return url
    parts = urlsplit(url)
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}" if user else host))


def write_private(path: str | Path, text: str) -> Path:
    """Write `text` to `path` readable by this user only (mode 0600, its folder created 0700), atomically:
    the file never exists with wider permissions or half written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is masked by the umask, and an old tmp keeps its own
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


def _pgpass_line(url: str) -> str | None:
    """The pgpass entry (host:port:database:user:password) that gives libpq the password of `url`."""
    scheme = url.split("://", 1)[0]
    password = url_password(url)
    if scheme not in _POSTGRES or password is None:
        return None
    parts = urlsplit(url)

    def esc(v) -> str:
        return str(v).replace("\\", "\\\\").replace(":", "\\:")

    fields = (
        parts.hostname or "localhost",
        parts.port or "*",
        parts.path.lstrip("/") or "*",
        unquote(parts.username or "*"),
    )
    return ":".join(esc(f) if f != "*" else f for f in fields) + ":" + esc(password)


def worker_secret_env(settings) -> dict[str, str]:
    """The variables that let a process on this machine use the settings' PostgreSQL passwords without
    seeing them in its environment: {"PGPASSFILE": path} to a pgpass file of mode 0600 under
    `$RAYPAI_HOME/secrets/` (written here), or {} when no URL has a password. Only for processes that
    share this machine's filesystem (a local Ray, a head raypai started here)."""
    urls = (settings.database_url, settings.mlflow_tracking_uri)
    return pgpass_env(urls, Path(settings.home) / "secrets" / "pgpass")


def pgpass_env(urls, path: str | Path) -> dict[str, str]:
    """{"PGPASSFILE": path} after writing the passwords of the PostgreSQL `urls` there (mode 0600);
    {} when none has a password. A child process then gets `strip_password(url)` and this."""
    lines = [line for url in urls if (line := _pgpass_line(url))]
    if not lines:
        return {}
    path = write_private(path, "".join(f"{line}\n" for line in dict.fromkeys(lines)))
    return {"PGPASSFILE": str(path)}
