"""infra/ is safe by default (issue #37 item 6), checked statically (no Docker or Kubernetes here):
compose publishes nothing beyond loopback and writes no password (each comes from the 0600 env
file `raypai services secrets` makes), MLflow is published only behind its basic-auth app, the
Kubernetes manifests take every credential from a Secret by secretKeyRef and contain none, and
`raypai services up` keeps its state files to this user."""

from __future__ import annotations

import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
# names whose values are credentials
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY|_KEY_ID|PRIVATE_KEY", re.I)
# user:password@ in a URL, anywhere in a file
URL_PASSWORD = re.compile(r"://[^\s/:@'\"]+:[^\s/@'\"]+@")
LOOPBACK = ("127.0.0.1", "::1", "[::1]", "localhost")


def _compose() -> dict:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())


def _published(port) -> tuple[str | None, str]:
    """(host address, spec) of one compose `ports` entry, short ("IP:HOST:CONTAINER") or long syntax."""
    if isinstance(port, dict):
        return port.get("host_ip"), str(port)
    text = str(port)
    parts = text.rsplit("/", 1)[0].split(":")
    return (":".join(parts[:-2]) or None, text) if len(parts) >= 3 else (None, text)


def _compose_problems(doc: dict) -> list[str]:
    problems = []
    for name, svc in doc["services"].items():
        for port in svc.get("ports", []):
            host, spec = _published(port)
            if host not in LOOPBACK:
                problems.append(f"{name}: port {spec} is published beyond loopback")
        env = svc.get("environment", {})
        env = dict(e.split("=", 1) for e in env) if isinstance(env, list) else env
        for key, value in env.items():
            if SECRET_NAME.search(key) and not re.fullmatch(r"\$\{[A-Z0-9_]+(:?[?-][^}]*)?\}", str(value)):
                problems.append(f"{name}: {key} is written in the file ({value!r}), not read from infra/.env")
        for text in [*map(str, env.values()), *map(str, svc.get("command") or [])]:
            if URL_PASSWORD.search(text):
                problems.append(f"{name}: a URL with a password: {text}")
        cmd = " ".join(map(str, svc.get("command") or []))
        if "mlflow" in cmd and "server" in cmd and svc.get("ports") and "--app-name=basic-auth" not in cmd:
            problems.append(f"{name}: MLflow published without authentication (--app-name=basic-auth)")
    return problems


def test_compose_publishes_on_loopback_only_with_no_password_in_the_file():
    assert _compose_problems(_compose()) == []
    assert "mlflow" in _compose()["services"] and _compose()["services"]["mlflow"]["ports"]


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda d: d["services"]["postgres"].update(ports=["5432:5432"]), "beyond loopback"),
        (lambda d: d["services"]["minio"].update(ports=["0.0.0.0:9000:9000"]), "beyond loopback"),
        (lambda d: d["services"]["mlflow"].update(ports=[{"target": 5000, "published": 5000}]), "beyond loopback"),
        (lambda d: d["services"]["postgres"]["environment"].update(POSTGRES_PASSWORD="raypai"), "written in the file"),
        (lambda d: d["services"]["mlflow"]["command"].remove("--app-name=basic-auth"), "without authentication"),
        (
            lambda d: d["services"]["mlflow"]["command"].append("--backend-store-uri=postgresql://raypai:pw@pg/m"),
            "a URL with a password",
        ),
    ],
)
def test_the_compose_check_catches_each_unsafe_change(change, problem):
    """The check above can fail: each unsafe edit of the real file is reported."""
    doc = _compose()
    change(doc)
    assert any(problem in p for p in _compose_problems(doc)), _compose_problems(doc)


def test_every_password_compose_reads_is_one_raypai_services_secrets_writes(tmp_path):
    env_values = [str(v) for svc in _compose()["services"].values() for v in (svc.get("environment") or {}).values()]
    wanted = {m for v in env_values for m in re.findall(r"\$\{([A-Z0-9_]+):\?", v)}
    assert {"POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "MLFLOW_TRACKING_PASSWORD"} <= wanted
    out = tmp_path / "infra" / ".env"
    proc = subprocess.run(
        [sys.executable, "-m", "raypai.cli", "services", "secrets", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    values = dict(line.split("=", 1) for line in out.read_text().splitlines() if line and not line.startswith("#"))
    assert wanted <= set(values), wanted - set(values)
    for key in wanted & {k for k in values if SECRET_NAME.search(k)}:
        assert len(values[key]) >= 32, key  # random, not a word
    assert values["PGPASSWORD"] == values["POSTGRES_PASSWORD"] and len(values["POSTGRES_PASSWORD"]) >= 32
    assert not any(v in proc.stdout + proc.stderr for k, v in values.items() if SECRET_NAME.search(k))
    again = subprocess.run(
        [sys.executable, "-m", "raypai.cli", "services", "secrets", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2 and "--force" in again.stdout + again.stderr  # never silently replaced
    # git ignores the file where the docs put it
    ignored = subprocess.run(["git", "check-ignore", "-q", "infra/.env"], cwd=ROOT)
    assert ignored.returncode == 0


def _k8s_docs() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in sorted((INFRA / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def _containers(doc):
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "containers" and isinstance(value, list):
                yield from value
            else:
                yield from _containers(value)
    elif isinstance(doc, list):
        for item in doc:
            yield from _containers(item)


def test_k8s_manifests_take_credentials_from_secrets_and_hold_none():
    docs = _k8s_docs()
    assert docs
    for name, doc in docs:
        assert doc["kind"] != "Secret" or not (doc.get("data") or doc.get("stringData")), (
            f"{name}: a Secret with values"
        )
        if doc["kind"] == "ConfigMap":
            assert not [k for k in doc["data"] if SECRET_NAME.search(k)], f"{name}: credentials in a ConfigMap"
        for c in _containers(doc):
            for e in c.get("env", []):
                if SECRET_NAME.search(e["name"]):
                    assert "value" not in e and "secretKeyRef" in e.get("valueFrom", {}), f"{name}: {e}"
    for path in (INFRA / "k8s").glob("*.yaml"):
        assert not URL_PASSWORD.search(path.read_text()), f"{path.name}: a URL with a password"
    assert not URL_PASSWORD.search((INFRA / "raypai.env.example").read_text())


def test_services_state_files_are_this_users_only(tmp_path):
    from raypai.tools.services import ServicesConfig, _write_state, service_env

    cfg = ServicesConfig(home=tmp_path, postgres_url="postgresql+psycopg://postgres:canary-pw@127.0.0.1:5432/postgres")
    cfg.dir.mkdir(parents=True)
    _write_state(cfg, service_env(cfg))
    for f in ("state.json", "env.sh"):
        assert stat.S_IMODE((cfg.dir / f).stat().st_mode) == 0o600, f
    assert "canary-pw" in (cfg.dir / "env.sh").read_text()  # the credentials are there, for this user


def test_the_mlflow_server_raypai_services_starts_has_no_password_on_its_command_line(tmp_path):
    """Every user of the machine can read a process's command line (ps): the backend URL goes
    without its password, which `_start` gives to libpq as a 0600 PGPASSFILE."""
    from raypai.tools.services import ServicesConfig, _commands

    cfg = ServicesConfig(home=tmp_path, postgres_url="postgresql+psycopg://postgres:canary-pw@127.0.0.1:5432/postgres")
    argv, env, _health = _commands(cfg)["mlflow"]
    assert "canary-pw" not in " ".join(argv) + str(env)
    assert "postgresql+psycopg://postgres@127.0.0.1:5432/raypai_mlflow" in argv
