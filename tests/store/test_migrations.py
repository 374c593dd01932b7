"""Alembic: upgrade from an empty database and from the previous revision, SQLite and PostgreSQL."""

from sqlalchemy import create_engine, inspect, text

from raypai.store import MetadataStore, current_revision, migrate


def test_upgrade_from_empty_and_from_previous_revision(db_url):
    engine = create_engine(db_url)
    with engine.begin() as conn:  # start from nothing, even on the shared PostgreSQL test database
        for t in ("step_outputs", "step_inputs", "op_stats", "api_tokens", "deployments", "step_run_events",
                  "artifacts", "step_runs", "pipeline_runs", "pipelines", "alembic_version"):
            conn.execute(text(f"DROP TABLE IF EXISTS {t}" + (" CASCADE" if engine.dialect.name == "postgresql" else "")))
    assert current_revision(engine) is None
    migrate(engine, "0001")
    assert current_revision(engine) == "0001"
    tables = set(inspect(engine).get_table_names())
    assert "artifacts" in tables and "deployments" not in tables
    with engine.begin() as conn:  # data written under the old schema survives the upgrade
        conn.execute(text("INSERT INTO pipelines (name, created_at) VALUES ('old', CURRENT_TIMESTAMP)"))
    store = MetadataStore(db_url)  # opening the store upgrades to head
    assert current_revision(engine) == "0002"
    assert {"deployments", "api_tokens", "op_stats"} <= set(inspect(engine).get_table_names())
    assert store.create_run("old", {})  # the pre-existing pipeline row is reused
    migrate(engine, "head")  # idempotent
    assert current_revision(engine) == "0002"
