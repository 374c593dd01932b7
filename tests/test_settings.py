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
