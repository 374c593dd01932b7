"""Verifiable demo tasks shipped with raypai."""
