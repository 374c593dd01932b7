"""The raypai wheel shipped to clusters: built from a clean tree, complete, cached; and the token
lookup `raypai submit` uses against a protected Ray dashboard."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from raypai.errors import ConfigError
from raypai.tools.cluster import auth_headers, build_wheel, export_clean_tree, runtime_env, wheel_modules

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(out_dir=tmp_path_factory.mktemp("wheels"))


def _mapped_sources() -> dict[str, str]:
    """wheel path -> source path for every tracked .py file in the package folders."""
    import tomllib

    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    files = subprocess.run(
        ["git", "ls-files", *dirs.values()], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        if not f.endswith(".py"):
            continue
        # the longest matching folder wins: "data/x.py" -> raypai/data/x.py, "platform/raypai/y.py" -> raypai/y.py
        pkg, folder = max(((p, d) for p, d in dirs.items() if f.startswith(d + "/")), key=lambda pd: len(pd[1]))
        rel = f[len(folder) + 1 :]
        out[(pkg.replace(".", "/") + "/" + rel) if pkg else rel] = f
    return out


def test_wheel_holds_every_mapped_subpackage_and_nothing_else(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for must in (
        "raypai/__init__.py",
        "raypai/data/__init__.py",
        "raypai/serving/__init__.py",
        "raypai/alignment/__init__.py",
        "raypai/pipelines/tinychat.py",
        "raypai/train/__init__.py",
        "raypai/tools/cluster.py",
        "raypai/tools/services.py",
    ):
        assert must in names, must
    missing = sorted(set(_mapped_sources()) - names)
    assert not missing, f"tracked modules missing from the wheel: {missing[:10]}"
    top = {n.split("/")[0] for n in names}
    assert top == {"raypai", "raypai-0.1.0.dist-info"}, top  # no platform/, tests/, data/ at top level
    assert not any(n.startswith("platform/") or n.endswith("platform/__init__.py") for n in names)
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    entry_points = zipfile.ZipFile(wheel).read("raypai-0.1.0.dist-info/entry_points.txt").decode()
    assert "raypai = raypai.cli:main" in entry_points


def test_unchanged_tree_reuses_the_built_wheel(wheel):
    again = build_wheel(out_dir=wheel.parent.parent)
    assert again == wheel and again.stat().st_mtime == wheel.stat().st_mtime


def test_unpacked_package_is_a_complete_py_modules_entry(wheel):
    pkg = wheel_modules(wheel)
    assert pkg.name == "raypai" and (pkg / "data" / "__init__.py").exists() and (pkg / "serving").is_dir()
    env = runtime_env(
        wheel, env={"RAYPAI_HOME": "/srv/raypai", "AWS_ENDPOINT_URL": "http://s3:9000", "AWS_SECRET_ACCESS_KEY": "hush"}
    )
    assert env["py_modules"] == [str(pkg)] and "working_dir" not in env
    assert env["env_vars"]["AWS_ENDPOINT_URL"] == "http://s3:9000" and env["env_vars"]["RAYPAI_HOME"] == "/srv/raypai"
    assert "AWS_SECRET_ACCESS_KEY" not in env["env_vars"]  # secrets only with forward_credentials
    assert env["env_vars"]["RAY_OVERRIDE_JOB_RUNTIME_ENV"] == "1"


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd, check=True, capture_output=True
    )


def test_clean_tree_ships_working_tree_edits_but_not_ignored_files_and_ref_ships_the_commit(tmp_path):
    repo = tmp_path / "repo"
    (repo / "src" / "pkg").mkdir(parents=True)
    (repo / "pyproject.toml").write_text(
        '[project]\nname = "pkg"\nreadme = "README.md"\n[tool.setuptools.package-dir]\n"" = "src"\n'
    )
    (repo / "README.md").write_text("pkg\n")
    (repo / "src" / "pkg" / "__init__.py").write_text("V = 1\n")
    (repo / ".gitignore").write_text("*.log\n")
    (repo / "notes.txt").write_text("outside the package folders\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    (repo / "src" / "pkg" / "__init__.py").write_text("V = 2\n")  # uncommitted edit
    (repo / "src" / "pkg" / "new.py").write_text("")  # untracked, not ignored
    (repo / "src" / "pkg" / "debug.log").write_text("noise")  # ignored

    work = tmp_path / "work"
    key_work = export_clean_tree(repo, work)
    shipped = {str(p.relative_to(work)) for p in work.rglob("*") if p.is_file()}
    assert shipped == {"pyproject.toml", "README.md", "src/pkg/__init__.py", "src/pkg/new.py"}
    assert (work / "src/pkg/__init__.py").read_text() == "V = 2\n"

    head = tmp_path / "head"
    key_head = export_clean_tree(repo, head, ref="HEAD")
    assert (head / "src/pkg/__init__.py").read_text() == "V = 1\n" and not (head / "src/pkg/new.py").exists()
    assert key_work != key_head
    with pytest.raises(ConfigError, match="not a commit"):
        export_clean_tree(repo, tmp_path / "x", ref="no-such-branch")


def test_token_lookup_follows_rays_precedence_and_keeps_the_local_token_local(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("local-token\n")
    (tmp_path / "tok").write_text("file-token\n")
    local, remote = "http://127.0.0.1:8265", "http://ray-head.example:8265"
    bearer = lambda t: {"Authorization": f"Bearer {t}"}  # noqa: E731
    assert auth_headers(local, "explicit", env={"RAY_AUTH_TOKEN": "env"}) == bearer("explicit")
    assert auth_headers(local, env={"RAY_AUTH_TOKEN": "env", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "tok")}) == bearer(
        "env"
    )
    assert auth_headers(remote, env={"RAY_AUTH_TOKEN_PATH": str(tmp_path / "tok")}) == bearer("file-token")
    assert auth_headers(local, env={}) == bearer("local-token")
    assert auth_headers(remote, env={}) == {}  # this machine's token is not sent to another host
    assert auth_headers(remote, env={"RAY_AUTH_MODE": "token"}) == bearer("local-token")
    with pytest.raises(ConfigError, match="RAY_AUTH_TOKEN_PATH"):
        auth_headers(local, env={"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")})


def test_submit_targets_and_an_unreachable_cluster_give_clear_answers(tmp_path, free_port):
    from raypai.errors import PipelineError
    from raypai.tools.cluster import _client, pipeline_entrypoint

    entry, folder = pipeline_entrypoint(str(ROOT / "pipelines" / "toy.py"), ["n=3"])
    try:
        assert entry == "python -m raypai.cli run toy.py --param=n=3"
        assert [p.name for p in folder.iterdir()] == ["toy.py"]  # the file alone, never the repository
    finally:
        import shutil

        shutil.rmtree(folder)
    module_entry = pipeline_entrypoint("raypai.pipelines.tinychat", [])
    assert module_entry == ("python -m raypai.cli run raypai.pipelines.tinychat", None)
    with pytest.raises(ConfigError, match="no such file"):
        pipeline_entrypoint(str(tmp_path / "missing.py"), [])
    with pytest.raises(PipelineError, match="cannot reach the Ray Jobs API .* pass --address"):
        _client(f"http://127.0.0.1:{free_port()}", None)
