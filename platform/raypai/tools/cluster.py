"""Ship raypai to a Ray cluster and run a pipeline there through the Ray Jobs API.

    raypai submit pipelines/tinychat.py --address http://HEAD:8265 --param docs=500
    raypai submit raypai.pipelines.tinychat --address http://127.0.0.1:8265 --no-wait

The cluster gets raypai as a *built wheel*, never as the source tree: the wheel is built from a
clean copy of the package folders (`pip wheel --no-deps`), unpacked, and its `raypai/` folder is
handed to Ray as a `py_modules` entry. That folder holds every mapped subpackage
(`raypai.data`, `raypai.serving`, ...), which `py_modules=[raypai]` on the source would miss
(docs/production.md, "Shipping the code"). The wheel itself is not passed to `py_modules`: Ray
installs a `.whl` there with `pip install --target` *including its dependencies* (torch, ray,
deepspeed...), which a cluster image already has. A pipeline file given by path travels alone in a
one-file `working_dir`.

Ray ≥ 2.52 protects the dashboard (and so the Jobs API) with a bearer token when the cluster runs
with `RAY_AUTH_MODE=token`; `ray start --head` turns it on by itself when `~/.ray/auth_token`
exists. `auth_headers` finds the token the way Ray does (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH,
~/.ray/auth_token; https://docs.ray.io/en/latest/ray-security/token-auth.html) and sends it
explicitly, because `JobSubmissionClient` only adds it when this process runs in token mode.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import tomllib
import typer

from raypai import exits
from raypai.config import parse_assignments
from raypai.credentials import url_password
from raypai.errors import ConfigError, PipelineError

__all__ = [
    "SubmittedJob",
    "auth_headers",
    "build_wheel",
    "export_clean_tree",
    "pipeline_entrypoint",
    "runtime_env",
    "submit",
    "submit_command",
    "wheel_modules",
]

# Forwarded to the job when set here, next to the resolved settings: the S3 endpoint
# (docs/production.md, "The variables").
FORWARDED_ENV = ("AWS_ENDPOINT_URL", "MLFLOW_S3_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION")
# Secrets travel only on request: runtime_env variables are visible in the Ray dashboard.
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
DEFAULT_ADDRESS = "http://127.0.0.1:8265"


def source_root() -> Path:
    """The checkout this raypai was imported from (editable install); a wheel install has none."""
    root = Path(__file__).resolve().parents[3]  # platform/raypai/tools/cluster.py -> repository root
    pyproject = root / "pyproject.toml"
    if not pyproject.exists() or 'name = "raypai"' not in pyproject.read_text():
        raise ConfigError(
            [
                f"no raypai source checkout found at {root} (raypai is installed from a wheel); "
                "run `raypai submit` from a clone of the repository, or pass source=PATH"
            ],
            what="wheel build",
        )
    return root


def _package_paths(root: Path) -> list[str]:
    """What a wheel build reads: pyproject, the readme and the package folders (package-dir)."""
    conf = tomllib.loads((root / "pyproject.toml").read_text())
    folders = sorted({f or "." for f in conf["tool"]["setuptools"]["package-dir"].values()})
    return ["pyproject.toml", conf["project"].get("readme", "README.md"), *folders]


def export_clean_tree(root: Path, dest: Path, ref: str | None = None) -> str:
    """Copy the build inputs of `root` into `dest`; returns a key of their content.

    ref=None: the working tree's tracked and untracked-but-not-ignored files (uncommitted edits
    ship, build debris and caches do not). ref="HEAD" (or any commit): `git archive` of that commit.
    """
    paths = _package_paths(root)
    dest.mkdir(parents=True, exist_ok=True)
    if ref is not None:
        tree = subprocess.run(["git", "rev-parse", f"{ref}^{{tree}}"], cwd=root, capture_output=True, text=True)
        if tree.returncode != 0:
            raise ConfigError([f"--ref {ref!r}: not a commit of {root} ({tree.stderr.strip()})"], what="wheel build")
        archive = subprocess.run(
            ["git", "archive", "--format=tar", ref, "--", *paths], cwd=root, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return tree.stdout.strip()
    if (root / ".git").exists():
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *paths],
            cwd=root,
            capture_output=True,
            check=True,
        )
        files = sorted({f for f in out.stdout.decode().split("\0") if f and (root / f).is_file()})
    else:
        files = sorted(
            str(p.relative_to(root))
            for w in paths
            for p in ([root / w] if (root / w).is_file() else (root / w).rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        )
    h = hashlib.sha256()
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest / rel)
        h.update(rel.encode() + b"\0" + hashlib.sha256((root / rel).read_bytes()).digest())
    return h.hexdigest()


def build_wheel(out_dir: str | Path, *, source: str | Path | None = None, ref: str | None = None) -> Path:
    """Build the raypai wheel from a clean copy of the package folders; returns the .whl path.

    Wheels are cached under `out_dir` (`raypai submit` passes `$RAYPAI_HOME/wheels`) by the content
    that goes into them, so an unchanged tree is not rebuilt.
    """
    root = Path(source).resolve() if source else source_root()
    with tempfile.TemporaryDirectory(prefix="raypai-wheel-") as tmp:
        clean = Path(tmp) / "src"
        target = Path(out_dir) / export_clean_tree(root, clean, ref)[:16]
        cached = sorted(target.glob("raypai-*.whl"))
        if cached:
            return cached[0]
        staging = Path(tmp) / "dist"
        # --no-build-isolation: build with this environment's setuptools, no package index needed.
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-q",
                "--wheel-dir",
                str(staging),
                str(clean),
            ],
            capture_output=True,
            text=True,
        )
        built = sorted(staging.glob("raypai-*.whl"))
        if proc.returncode != 0 or not built:
            raise PipelineError(
                f"building the raypai wheel from {root} failed:\n{proc.stderr[-3000:]}\n"
                "fix pyproject.toml or the package folders, then retry"
            )
        target.mkdir(parents=True, exist_ok=True)
        final = target / built[0].name
        shutil.move(str(built[0]), final)
    return final


def wheel_modules(wheel: str | Path) -> Path:
    """Unpack a wheel next to itself; returns its `raypai/` folder (a `py_modules` entry)."""
    wheel = Path(wheel)
    site = wheel.parent / "site"
    if not (site / "raypai" / "__init__.py").exists():
        tmp = Path(tempfile.mkdtemp(prefix=".site-", dir=wheel.parent))
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
        try:
            tmp.rename(site)
        except OSError:  # a concurrent unpack of the same wheel won; its content is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return site / "raypai"


def _is_loopback(address: str) -> bool:
    host = urlparse(address if "://" in address else f"http://{address}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def auth_headers(address: str, token: str | None = None, env: dict | None = None) -> dict[str, str]:
    """`Authorization` header for a token-protected Ray dashboard, or {} when no token applies.

    Precedence follows Ray: an explicit token, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, then
    ~/.ray/auth_token. The default file is this machine's own cluster token, so it is only sent to
    a loopback address or when RAY_AUTH_MODE=token says the user means it for remote clusters too.
    """
    env = os.environ if env is None else env
    if not token and env.get("RAY_AUTH_TOKEN"):
        token = env["RAY_AUTH_TOKEN"]
    if not token and env.get("RAY_AUTH_TOKEN_PATH"):
        path = Path(env["RAY_AUTH_TOKEN_PATH"]).expanduser()
        if not path.is_file():
            raise ConfigError(
                [
                    f"RAY_AUTH_TOKEN_PATH={path}: no such file; point it at the cluster's token "
                    "(`ray get-auth-token` on the head prints it)"
                ],
                what="Ray authentication",
            )
        token = path.read_text().strip()
    default = Path.home() / ".ray" / "auth_token"
    if not token and default.is_file() and (_is_loopback(address) or env.get("RAY_AUTH_MODE", "").lower() == "token"):
        token = default.read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def runtime_env(
    wheel: str | Path,
    *,
    env: dict | None = None,
    settings=None,
    working_dir: str | Path | None = None,
    forward_credentials: bool = False,
    same_machine: bool = False,
) -> dict:
    """The job's runtime_env: the unpacked wheel as `py_modules`, the settings and S3 variables.

    No database password travels in it (the dashboard shows it): the settings' URLs lose theirs
    (`Settings.to_env`). A cluster on this machine (`same_machine`) gets PGPASSFILE, a 0600 file here;
    a remote cluster's nodes must hold the password themselves (PGPASSWORD from a Kubernetes Secret,
    infra/k8s; docs/production.md, "Secrets")."""
    from raypai.credentials import worker_secret_env
    from raypai.settings import Settings

    env = os.environ if env is None else env
    settings = settings or Settings.load(dict(env))
    names = FORWARDED_ENV + (CREDENTIAL_ENV if forward_credentials else ())
    env_vars = {**settings.to_env(), **{k: env[k] for k in names if env.get(k)}}
    if same_machine:
        env_vars.update(worker_secret_env(settings))
    # The runner's ray.init adds its own runtime_env inside the job: let Ray merge the two.
    env_vars["RAY_OVERRIDE_JOB_RUNTIME_ENV"] = "1"
    out: dict = {"py_modules": [str(wheel_modules(wheel))], "env_vars": env_vars}
    if working_dir is not None:
        out["working_dir"] = str(working_dir)
    return out


@dataclass(frozen=True)
class SubmittedJob:
    job_id: str
    address: str
    status: str | None = None  # terminal status when waited for, else None
    logs: str = ""


def _client(address: str, token: str | None):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address, headers=auth_headers(address, token))
    except ConnectionError as exc:
        raise PipelineError(
            f"cannot reach the Ray Jobs API at {address} ({exc}); start the cluster "
            "(`infra/local-cluster.sh up` or `ray start --head`) or pass --address"
        ) from exc
    except Exception as exc:  # ray.exceptions.AuthenticationError is not importable everywhere
        if "uthenticat" in type(exc).__name__ + str(exc):
            raise PipelineError(
                f"the Ray dashboard at {address} refused the request: {str(exc).splitlines()[0]}. "
                "Pass --token, or set RAY_AUTH_TOKEN (on the head, `ray get-auth-token` "
                "prints it)"
            ) from exc
        raise


def submit(
    entrypoint: str,
    address: str = DEFAULT_ADDRESS,
    *,
    wheel: str | Path,
    working_dir: str | Path | None = None,
    env: dict | None = None,
    settings=None,
    token: str | None = None,
    forward_credentials: bool = False,
    wait: bool = True,
    timeout_s: float | None = None,
    echo=None,
) -> SubmittedJob:
    """Submit `entrypoint` with raypai shipped as `wheel` (build_wheel); optionally wait and return
    the logs. `echo(text)` receives new log lines while waiting (the CLI prints them).
    """
    client = _client(address, token)
    renv = runtime_env(
        wheel,
        env=env,
        settings=settings,
        working_dir=working_dir,
        forward_credentials=forward_credentials,
        same_machine=_is_loopback(address),
    )
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env=renv, metadata={"raypai_wheel": Path(wheel).name})
    if not wait:
        return SubmittedJob(job_id, address)
    start, seen = time.monotonic(), 0
    while True:
        status = client.get_job_status(job_id)
        logs = client.get_job_logs(job_id)
        if echo and len(logs) > seen:
            echo(logs[seen:])
        seen = len(logs)
        if status.is_terminal():
            return SubmittedJob(job_id, address, str(status.value), logs)
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            client.stop_job(job_id)
            raise PipelineError(
                f"job {job_id} did not finish within {timeout_s:.0f}s and was stopped; "
                "raise --timeout or run with --no-wait"
            )
        time.sleep(1.0)


def pipeline_entrypoint(target: str, params: list[str], python: str = "python") -> tuple[str, Path | None]:
    """(entrypoint, working_dir) for `raypai run TARGET`: a file travels alone in a temp folder."""
    file_part, sep, name = target.partition(":")
    args = [f"--param={p}" for p in params]
    if file_part.endswith(".py"):
        path = Path(file_part)
        if not path.is_file():
            raise ConfigError(
                [
                    f"pipeline file {file_part}: no such file; pass a path to a .py pipeline "
                    "or a module such as raypai.pipelines.tinychat"
                ],
                what="raypai submit",
            )
        folder = Path(tempfile.mkdtemp(prefix="raypai-submit-"))
        shutil.copy2(path, folder / path.name)  # only this file: never the repository as working_dir
        run_target = path.name + (sep + name if sep else "")
    else:
        folder, run_target = None, target
    cmd = [python, "-m", "raypai.cli", "run", run_target, *args]
    return shlex.join(cmd), folder


def submit_command(
    target: str = typer.Argument(..., help="pipeline FILE.py[:NAME] or module (raypai.pipelines.tinychat)"),
    address: str = typer.Option(
        os.environ.get("RAY_API_SERVER_ADDRESS", DEFAULT_ADDRESS), "--address", help="Ray dashboard / Jobs API address"
    ),
    param: list[str] = typer.Option([], "--param", "-p", help="pipeline parameter KEY=VALUE (repeatable)"),
    token: Optional[str] = typer.Option(
        None,
        "--token",
        help="Ray auth token (default: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token for a local cluster)",
    ),
    forward_credentials: bool = typer.Option(
        False, "--forward-credentials", help="also send AWS_ACCESS_KEY_ID/SECRET (visible in the dashboard)"
    ),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="follow the logs until the job ends"),
    ref: Optional[str] = typer.Option(
        None, "--ref", help="build the wheel from this commit (git archive) instead of the working tree's files"
    ),
    wheel: Optional[Path] = typer.Option(None, "--wheel", help="ship this prebuilt raypai wheel instead"),
):
    """Run a pipeline on a Ray cluster through the Jobs API, with raypai shipped as a wheel."""
    from rich.console import Console

    from raypai.settings import Settings

    console = Console(stderr=True)
    s = Settings.load()  # this command is an entry point: settings are read here, once
    parse_assignments(param, flag="--param")  # malformed values fail here, not on the cluster
    entrypoint, folder = pipeline_entrypoint(target, param)
    wheel = wheel or build_wheel(s.home / "wheels", ref=ref)
    console.print(f"wheel: {wheel}")
    if not _is_loopback(address):
        if s.database_url.startswith("sqlite") or "://" not in s.artifact_uri:
            console.print(
                "[yellow]note:[/] this machine's SQLite database / local artifact folder are not visible "
                "to a remote cluster; point RAYPAI_DATABASE_URL and RAYPAI_ARTIFACT_URI at shared services "
                "(docs/production.md)"
            )
        if url_password(s.database_url) or url_password(s.mlflow_tracking_uri):
            console.print(
                "[yellow]note:[/] the database password is not sent with the job (the Ray dashboard shows a "
                "job's environment): the cluster's nodes must have it, as PGPASSWORD from a secret "
                '(infra/k8s) or a PGPASSFILE (docs/production.md, "Secrets")'
            )
    try:
        job = submit(
            entrypoint,
            address,
            wheel=wheel,
            working_dir=folder,
            token=token,
            forward_credentials=forward_credentials,
            wait=wait,
            echo=lambda text: print(text, end="", flush=True),
        )
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    console.print(f"job {job.job_id} at {address}" + (f": {job.status}" if job.status else " submitted"))
    if job.status and job.status != "SUCCEEDED":
        raise typer.Exit(exits.FAILED)
