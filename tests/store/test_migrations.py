"""Alembic: upgrade from an empty database and from each previous revision, SQLite and PostgreSQL."""

from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from raypai.store import MetadataStore, current_revision, migrate
from raypai.store.metadata import _MIGRATIONS


def _head() -> str:
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    script = ScriptDirectory.from_config(cfg)
    assert len(script.get_heads()) == 1, f"migrations have several heads {script.get_heads()}: chain down_revision"
    return script.get_current_head()


def test_upgrade_from_empty_and_from_previous_revision(db_url):
    engine = create_engine(db_url)
    with engine.begin() as conn:  # start from nothing, even on the shared PostgreSQL test database
        from raypai.store.models import Base  # every table of the current schema, dependents first

        for t in [t.name for t in reversed(Base.metadata.sorted_tables)] + ["alembic_version"]:
            conn.execute(
                text(f"DROP TABLE IF EXISTS {t}" + (" CASCADE" if engine.dialect.name == "postgresql" else ""))
            )
    assert current_revision(engine) is None
    migrate(engine, "0001")
    assert current_revision(engine) == "0001"
    tables = set(inspect(engine).get_table_names())
    assert "artifacts" in tables and "deployments" not in tables
    with engine.begin() as conn:  # data written under the old schema survives the upgrade
        conn.execute(text("INSERT INTO pipelines (name, created_at) VALUES ('old', CURRENT_TIMESTAMP)"))
    migrate(engine, "0002")
    assert {"deployments", "api_tokens", "op_stats"} <= set(inspect(engine).get_table_names())
    assert "cache_components" not in {c["name"] for c in inspect(engine).get_columns("step_runs")}
    store = MetadataStore(db_url)  # opening the store upgrades to head
    assert current_revision(engine) == _head()
    assert {"cache_components", "cache_reason"} <= {c["name"] for c in inspect(engine).get_columns("step_runs")}
    run = store.create_run("old", {})  # the pre-existing pipeline row is reused
    migrate(engine, "head")  # idempotent
    assert current_revision(engine) == _head()

    # a step run recorded without components is never what a cache miss is explained against
    old = store.create_step_run(run, "clean", "m:clean", {}, "k1")
    store.transition(old, "succeeded")
    assert store.get_step_run(old)["cache_components"] is None
    assert store.last_keyed_step_run("m:clean", pipeline="old", node="clean") is None


def test_downgrade_drops_the_cache_columns_and_upgrade_restores_them(tmp_path):
    url = f"sqlite:///{tmp_path}/meta.db"
    MetadataStore(url)
    engine = create_engine(url)
    from alembic import command

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0002")
    assert "cache_reason" not in {c["name"] for c in inspect(engine).get_columns("step_runs")}
    migrate(engine, "head")
    assert "cache_reason" in {c["name"] for c in inspect(engine).get_columns("step_runs")}
