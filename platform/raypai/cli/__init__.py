"""`raypai` CLI (typer + rich). Entry point: `raypai.cli:main`."""

from raypai.cli.main import app, main

__all__ = ["app", "main"]
