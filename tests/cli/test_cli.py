"""The `raypai` CLI as a user runs it: a fresh process per command, the embedded defaults."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "pipelines" / "toy.py")


@pytest.fixture
def cli(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAYPAI_", "MLFLOW_TRACKING", "RAY_ADDRESS"))}
    env.update(RAYPAI_HOME=str(tmp_path / "home"), RAYPAI_DASHBOARD="0", COLUMNS="200")

    def run(*args, ok=True):
        out = subprocess.run(
            [sys.executable, "-m", "raypai.cli", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if ok is not None:
            assert (out.returncode == 0) == ok, out.stdout + out.stderr
        return out

    return run


def test_run_twice_change_param_lineage_show(cli):
    first = cli("run", TOY, "--param", "n=5")
    assert "succeeded" in first.stdout and "write_text" in first.stdout
    second = cli("run", TOY, "--param", "n=5")
    assert second.stdout.count("(cache hit)") == 3
    third = cli("run", TOY, "--param", "n=5", "--param", "upper=false")
    assert third.stdout.count("(cache hit)") == 1

    runs = cli("runs")
    assert runs.stdout.count("toy") >= 3
    run_id = re.search(r"run ([0-9a-f]{8})", first.stdout).group(1)
    show = cli("show", run_id)
    assert "count" in show.stdout and "report counts" in show.stdout
    # every step row names the Ray node its task ran on (all three ran, on the one local node)
    nodes = {
        m.group(1): m.group(2)
        for m in re.finditer(r"│ (write_text|transform|count) +│ succeeded.*?│ ([0-9a-f]{8}) │", show.stdout)
    }
    assert "ray node" in show.stdout and len(nodes) == 3 and len(set(nodes.values())) == 1, show.stdout
    report_id = re.search(r"count → output: report counts (\w+)", show.stdout).group(1)
    lineage = cli("lineage", report_id)
    for node in ("toy.count", "toy.transform", "toy.write_text"):
        assert node in lineage.stdout
    down = cli("lineage", report_id, "--json")
    assert '"produced_by"' in down.stdout
    ol = cli("show", run_id, "--openlineage")
    assert '"eventType": "COMPLETE"' in ol.stdout


def test_failure_then_resume_from_cli(cli, tmp_path):
    marker = tmp_path / "broken"
    marker.write_text("1")
    failed = cli("run", TOY, "--param", f"fail_if_exists={marker}", ok=False)
    assert failed.returncode == 1  # the run failed (raypai.exits.FAILED)
    assert "transform failed" in failed.stdout and "Traceback" in failed.stdout and "raypai resume" in failed.stdout
    run_id = re.search(r"raypai resume ([0-9a-f]+)", failed.stdout).group(1)
    marker.unlink()
    resumed = cli("resume", run_id)
    assert "write_text cached" in resumed.stdout and "transform succeeded" in resumed.stdout
    assert "count succeeded" in resumed.stdout


def test_bad_input_gives_one_clear_error_without_traceback(cli, tmp_path):
    out = cli("run", TOY, "--param", "colour=red", ok=False)
    assert "unknown parameter 'colour'" in out.stdout and "Traceback" not in out.stdout + out.stderr
    assert out.returncode == 2  # refused before any work (raypai.exits.REFUSED)
    out = cli("run", str(tmp_path / "nope.py"), ok=False)
    assert "not found" in out.stdout and out.returncode == 2
    out = cli("run", TOY, "--param", "n", "--param", "m", ok=False)
    assert "--param 'n' is not KEY=VALUE" in out.stdout and "--param 'm' is not KEY=VALUE" in out.stdout
    assert out.returncode == 2
    out = cli("show", "0123456789ab", ok=False)
    assert "not found (no runs are recorded yet)" in out.stdout and out.returncode == 2


def test_doctor_reports_every_check(cli):
    out = cli("doctor")
    for check in (
        "stdlib platform not shadowed",
        "metadata database",
        "MLflow tracking",
        "ray",
        "deepspeed",
        "ray runtime",
        "default ports",
    ):
        assert check in out.stdout


def test_a_broken_sub_command_module_stops_the_cli_loudly(tmp_path):
    """A temporary copy of serving/cli.py with a broken import stands in for the real one: `raypai
    --help` fails, naming the module and the cause, instead of dropping `raypai deploy` silently."""
    import subprocess
    import sys
    from pathlib import Path

    import raypai.serving

    broken = tmp_path / "cli.py"
    source = (Path(raypai.serving.__file__).parent / "cli.py").read_text()
    assert "\nimport json\n" in source
    broken.write_text(source.replace("\nimport json\n", "\nimport json\nimport raypai_no_such_module  # broken\n", 1))
    script = tmp_path / "run.py"
    script.write_text(
        "import importlib.abc, importlib.util, sys\n"
        "class Copy(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        return importlib.util.spec_from_file_location(name, {str(broken)!r}) "
        "if name == 'raypai.serving.cli' else None\n"
        "sys.meta_path.insert(0, Copy())\n"
        "sys.argv = ['raypai', '--help']\n"
        "from raypai.cli import main\n"
        "main()\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, out.stdout
    assert "`raypai deploy` cannot be loaded: importing raypai.serving.cli failed" in out.stderr, out.stderr
    assert "raypai_no_such_module" in out.stderr and "Traceback" in out.stderr
    ok = subprocess.run([sys.executable, "-m", "raypai.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "deploy" in ok.stdout  # the real module mounts
