"""Alembic environment: the connection is handed in by `raypai.store.migrate` (no alembic.ini)."""

from alembic import context
from sqlalchemy import create_engine

from raypai.store.models import Base

config = context.config
connection = config.attributes.get("connection")


def _run(conn) -> None:
    context.configure(
        connection=conn,
        target_metadata=Base.metadata,
        render_as_batch=conn.dialect.name == "sqlite",  # SQLite ALTER TABLE goes through batch copies
    )
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    _run(connection)
else:  # `alembic -x url=... upgrade head` from a shell
    url = context.get_x_argument(as_dictionary=True)["url"]
    with create_engine(url).connect() as conn:
        _run(conn)
