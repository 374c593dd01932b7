"""Packaging guards: the stdlib `platform` module is never shadowed and the public API imports."""

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_fresh_interpreter_from_repo_root_sees_stdlib_platform_and_imports_api():
    code = (
        "import platform, sysconfig, pathlib;"
        "std = pathlib.Path(sysconfig.get_paths()['stdlib']).resolve();"
        "assert pathlib.Path(platform.__file__).resolve().is_relative_to(std), platform.__file__;"
        "import raypai, raypai.data, raypai.alignment, raypai.serving, raypai.pipelines, raypai.train;"
        "import uuid, torch;"  # both import platform internally
        "print(platform.__file__, raypai.__version__, sorted(raypai.__all__)[:3])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "python3" in out.stdout and "0.1.0" in out.stdout


def test_platform_folder_has_no_init():
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_every_package_folder_is_listed_in_pyproject():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    dirs = conf["package-dir"]
    found = set()
    for pkg, folder in dirs.items():
        base = ROOT / folder
        prefix = pkg
        for init in base.rglob("__init__.py"):
            if ".venv" in init.parts or "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(base).parts
            name = ".".join(p for p in ([prefix] if prefix else []) + list(rel))
            if not name or (pkg == "" and not name.startswith("raypai")):
                continue
            found.add(name)
    missing = sorted(found - listed)
    assert not missing, f"add these to [tool.setuptools].packages in pyproject.toml: {missing}"
