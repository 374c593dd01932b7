"""`raypai verify ARTIFACT` against a real metadata store (SQLite and PostgreSQL) and a real local
artifact store: exit 0 when every file holds the recorded digest, 1 naming the file that differs,
2 for an artifact that is not recorded."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from raypai.artifacts import ArtifactStore
from raypai.settings import Settings
from raypai.store import MetadataStore


@pytest.fixture
def recorded(raypai_home, db_url, tmp_path, monkeypatch):
    """(artifact, env) of a dataset saved in the store of RAYPAI_HOME and recorded in `db_url`."""
    monkeypatch.setenv("RAYPAI_DATABASE_URL", db_url)
    settings = Settings.load()
    src = tmp_path / "src"
    (src / "shards").mkdir(parents=True)
    (src / "manifest.json").write_text('{"rows": 2}')
    (src / "shards" / "part-0.parquet").write_bytes(b"p" * 300)
    art = ArtifactStore(settings.artifact_uri).put_dir(src, kind="dataset", name="clean")
    return MetadataStore(settings.database_url).record_artifact(art)


def _verify(ref: str):
    from raypai.cli.main import app

    return CliRunner().invoke(app, ["verify", ref], env={"COLUMNS": "300"})


def test_verify_by_id_or_uri_exits_0_when_whole_and_1_naming_the_file_that_differs(recorded):
    art = recorded
    for ref in (art.id, art.id[:10], art.uri):
        out = _verify(ref)
        assert out.exit_code == 0, out.output
        assert "ok dataset clean" in out.output and art.digest in out.output

    part = Path(art.uri) / "shards" / "part-0.parquet"
    part.write_bytes(b"q" * 300)  # same size: a cache hit's size check passes, the digest does not
    out = _verify(art.uri)
    assert out.exit_code == 1, out.output
    assert "shards/part-0.parquet differs" in out.output and "manifest.json" not in out.output

    part.write_bytes(b"p" * 299)
    out = _verify(art.id)
    assert out.exit_code == 1 and "shards/part-0.parquet differs" in out.output, out.output


def test_verify_of_an_unknown_artifact_is_refused(recorded):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", "from raypai.cli.main import main; main()", "verify", "ffffffffffff"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not found by id, id prefix, digest prefix or uri" in proc.stdout
