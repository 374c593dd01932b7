"""`raypai doctor`: checks that the install and the configured services work."""

from __future__ import annotations

import importlib
import sys
import sysconfig
from pathlib import Path

from raypai.settings import Settings


def run_checks(settings: Settings) -> list[tuple[str, bool, str]]:
    out = []
    import platform as std_platform

    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    shadow_ok = Path(std_platform.__file__).resolve().is_relative_to(stdlib)
    out.append(
        (
            "stdlib platform not shadowed",
            shadow_ok,
            std_platform.__file__
            if shadow_ok
            else f"{std_platform.__file__} shadows the standard library: remove platform/__init__.py",
        )
    )
    try:
        from raypai.store import MetadataStore, current_revision

        store = MetadataStore(settings.database_url)
        out.append(
            (
                "metadata database",
                True,
                f"{_redact(settings.database_url)} at revision {current_revision(store.engine)}",
            )
        )
    except Exception as exc:  # noqa: BLE001 - report, don't crash
        out.append(("metadata database", False, _redact(str(exc))))
    try:
        from raypai.tracking import Tracker

        Tracker(settings.mlflow_tracking_uri).client.search_experiments(max_results=1)
        out.append(("MLflow tracking", True, _redact(settings.mlflow_tracking_uri)))
    except Exception as exc:  # noqa: BLE001
        out.append(("MLflow tracking", False, _redact(f"{settings.mlflow_tracking_uri}: {exc}")))
    try:
        from raypai.artifacts import ArtifactStore

        ArtifactStore(settings.artifact_uri)
        out.append(("artifact store", True, settings.artifact_uri))
    except Exception as exc:  # noqa: BLE001
        out.append(("artifact store", False, str(exc)))
    for mod in ("ray", "torch", "deepspeed", "transformers", "mlflow"):
        try:
            m = importlib.import_module(mod)
            out.append((mod, True, getattr(m, "__version__", "?")))
        except Exception as exc:  # noqa: BLE001
            out.append((mod, False, f"import failed: {exc}"))
    out.append(("python", sys.version_info >= (3, 10), sys.version.split()[0]))
    out.extend(runtime_checks(settings))
    return out


def runtime_checks(settings: Settings) -> list[tuple[str, bool, str]]:
    """Where raypai's Ray runs, and which default ports are taken (raypai then picks free ones)."""
    from raypai.runtime import DEFAULT_PORTS, load_state, port_is_free, state_path

    try:
        state = load_state(settings)
    except Exception as exc:  # noqa: BLE001 - report, don't crash
        return [("ray runtime", False, f"{state_path(settings)}: {exc}")]
    if settings.ray_address:
        where = f"RAY_ADDRESS={settings.ray_address}: runs join that cluster"
    elif state.head is not None:
        where = (
            f"raypai's Ray head at {state.head.address} (dashboard {state.head.dashboard_url or 'off'}, "
            f"Serve port {state.head.serve_port}); `raypai ray stop` stops it"
        )
    else:
        where = "no Ray head recorded: each run starts a local Ray; `raypai ray start` keeps one up"
    taken = [f"{port} ({name})" for name, port in DEFAULT_PORTS.items() if not port_is_free(port)]
    ports = ("in use, raypai picks free ones instead: " + ", ".join(taken)) if taken else "all free"
    return [("ray runtime", True, where), ("default ports", True, ports)]


def _redact(url: str) -> str:
    from raypai.store.metadata import _redact as r

    return r(url)
