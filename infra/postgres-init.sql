-- Runs once, when the PostgreSQL volume is first created (infra/compose.yaml).
-- The raypai metadata database is POSTGRES_DB; MLflow gets its own (separate Alembic histories).
CREATE DATABASE mlflow OWNER raypai;
