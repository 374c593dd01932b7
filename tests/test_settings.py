import pytest

from raypai.errors import ConfigError
from raypai.settings import Settings


def test_embedded_defaults_live_under_home(tmp_path):
    s = Settings.load({"RAYPAI_HOME": str(tmp_path)})
    assert s.database_url == f"sqlite:///{tmp_path}/raypai.db"
    assert s.mlflow_tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert s.artifact_uri == str(tmp_path / "artifacts")
    assert s.ray_address is None
    assert Settings.load(s.to_env()) == s


def test_toml_file_is_read_and_env_wins(tmp_path):
    cfg = tmp_path / "raypai.toml"
    cfg.write_text('[raypai]\nhome = "/srv/rp"\nartifact_uri = "s3://bucket/prefix"\n')
    s = Settings.load({"RAYPAI_CONFIG": str(cfg), "RAYPAI_HOME": str(tmp_path)})
    assert s.home == tmp_path and s.artifact_uri == "s3://bucket/prefix"


def test_invalid_values_are_all_reported_with_fixes(tmp_path):
    with pytest.raises(ConfigError) as err:
        Settings.load(
            {
                "RAYPAI_HOME": str(tmp_path),
                "RAYPAI_DATABASE_URL": "mysql://x/y",
                "MLFLOW_TRACKING_URI": "ftp://nope",
                "RAYPAI_ARTIFACT_URI": "weird://b",
                "RAYPAI_RAY_NUM_CPUS": "zero",
                "RAY_ADDRESS": "nowhere",
            }
        )
    problems = err.value.problems
    assert len(problems) == 5
    text = str(err.value)
    for name in (
        "RAYPAI_DATABASE_URL",
        "MLFLOW_TRACKING_URI",
        "RAYPAI_ARTIFACT_URI",
        "RAYPAI_RAY_NUM_CPUS",
        "RAY_ADDRESS",
    ):
        assert name in text
    assert "postgresql+psycopg://" in text  # the fix is named


def test_ports_and_dashboard_settings(tmp_path):
    s = Settings.load({"RAYPAI_HOME": str(tmp_path), "RAYPAI_SERVE_PORT": "18000", "RAYPAI_DASHBOARD": "0"})
    assert s.serve_port == 18000 and s.dashboard is False
    assert Settings.load(s.to_env()) == s  # workers rebuild the same settings
    defaults = Settings.load({"RAYPAI_HOME": str(tmp_path)})
    assert defaults.serve_port is None and defaults.dashboard is True  # None: raypai.runtime picks a free port
    cfg = tmp_path / "raypai.toml"
    cfg.write_text("[raypai]\ndashboard = false\nserve_port = 18001\n")
    from_file = Settings.load({"RAYPAI_CONFIG": str(cfg), "RAYPAI_HOME": str(tmp_path)})
    assert from_file.dashboard is False and from_file.serve_port == 18001
    assert defaults.serve_host == "127.0.0.1"  # loopback unless asked
    cluster = Settings.load({"RAYPAI_HOME": str(tmp_path), "RAYPAI_SERVE_HOST": "0.0.0.0"})
    assert cluster.serve_host == "0.0.0.0" and Settings.load(cluster.to_env()) == cluster
    with pytest.raises(ConfigError) as err:
        Settings.load(
            {
                "RAYPAI_HOME": str(tmp_path),
                "RAYPAI_SERVE_PORT": "70000",
                "RAYPAI_DASHBOARD": "maybe",
                "RAYPAI_SERVE_HOST": "http://0.0.0.0",
            }
        )
    assert len(err.value.problems) == 3
    assert "RAYPAI_SERVE_PORT='70000'" in str(err.value) and "RAYPAI_DASHBOARD='maybe'" in str(err.value)
    assert "RAYPAI_SERVE_HOST='http://0.0.0.0'" in str(err.value) and "0.0.0.0 (every interface)" in str(err.value)


# ---- a raypai.toml in the current directory (issue #37 item 7) ------------------------------------


def test_a_config_in_the_current_directory_is_read_with_a_notice_naming_it(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "cloned-repo"
    repo.mkdir()
    (repo / "raypai.toml").write_text(f'[raypai]\nhome = "{tmp_path / "elsewhere"}"\nallow_remote_token = true\n')
    monkeypatch.chdir(repo)
    s = Settings.load({})
    notice = capsys.readouterr().err
    assert str(repo / "raypai.toml") in notice and "current directory" in notice and "RAYPAI_CONFIG" in notice
    assert s.home == tmp_path / "elsewhere" and s.config_from_cwd and s.config_file == repo / "raypai.toml"
    assert not s.allow_remote_token  # a file found in the current directory cannot allow it
    named = Settings.load({"RAYPAI_CONFIG": str(repo / "raypai.toml")})
    assert named.allow_remote_token and not named.config_from_cwd  # a file the user names can
    assert capsys.readouterr().err == ""  # named explicitly: no notice
    monkeypatch.chdir(tmp_path)
    assert Settings.load({"RAYPAI_HOME": str(tmp_path)}).config_file is None


def test_a_token_goes_off_this_machine_only_to_an_address_the_user_gave_or_allowed(tmp_path):
    from raypai.settings import check_token_destination

    s = Settings.load({"RAYPAI_HOME": str(tmp_path)})
    for url in ("http://127.0.0.1:8080", "http://localhost:8080", "http://[::1]:8080", "http://0.0.0.0:8080"):
        check_token_destination(s, url, explicit=False)
    check_token_destination(s, "https://deploy.example.com", explicit=True)  # RAYPAI_API_URL
    with pytest.raises(ConfigError, match=r"refusing to send RAYPAI_TOKEN to http://203\.0\.113\.5:8080") as err:
        check_token_destination(s, "http://203.0.113.5:8080", explicit=False)
    assert "RAYPAI_API_URL=" in str(err.value) and "RAYPAI_ALLOW_REMOTE_TOKEN=1" in str(err.value)
    allowed = Settings.load({"RAYPAI_HOME": str(tmp_path), "RAYPAI_ALLOW_REMOTE_TOKEN": "1"})
    check_token_destination(allowed, "http://203.0.113.5:8080", explicit=False)


def test_raypai_deploy_sends_no_token_where_a_cloned_repositorys_config_points(tmp_path):
    """A repository ships raypai.toml (home = its own folder) and a runtime.json recording a "deploy
    API" on another machine; `raypai deploy list` run inside it with RAYPAI_TOKEN set refuses before
    connecting (before the fix it sent the token there)."""
    import json
    import os
    import subprocess
    import sys

    repo = tmp_path / "cloned-repo"
    (repo / "state").mkdir(parents=True)
    (repo / "raypai.toml").write_text('[raypai]\nhome = "state"\n')
    # the pid must be alive for raypai to believe the record: this test's own
    record = {"endpoints": {"api": {"url": "http://203.0.113.5:8080", "pid": os.getpid()}}}
    (repo / "state" / "runtime.json").write_text(json.dumps(record))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAYPAI_", "RAY_ADDRESS", "MLFLOW_"))}
    env.update(RAYPAI_TOKEN="secret-deploy-token", COLUMNS="1000")  # COLUMNS: rich wraps no line
    out = subprocess.run(
        [sys.executable, "-m", "raypai.cli", "deploy", "list"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,  # the unfixed CLI tries to reach 203.0.113.5 (TEST-NET, no answer) and times out here
    )
    shown = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2, shown
    assert "refusing to send RAYPAI_TOKEN to http://203.0.113.5:8080" in shown
    assert f"reading settings from {repo / 'raypai.toml'}" in out.stderr  # the notice
    assert f"set by {repo / 'raypai.toml'} in the current directory" in shown  # the refusal names the file
    assert "secret-deploy-token" not in shown
