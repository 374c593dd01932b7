"""The cluster image recipe (infra/Dockerfile) agrees with pyproject.toml and the CI pins.

No Docker engine runs here, so the recipe is checked as text: the versions it installs, the
order (torch first, then the raypai wheel under a torch constraint) and what it copies.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]

DOCKERFILE = (ROOT / "infra" / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)", text, flags=re.M))


def _requirement(name: str) -> Requirement:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    return next(r for r in reqs if r.name == name)


def _run_lines() -> list[str]:
    # RUN instructions with their continuation lines joined
    return [m.replace("\\\n", " ") for m in re.findall(r"^RUN (.+?)(?<!\\)$", DOCKERFILE, flags=re.M | re.S)]


def test_ray_version_matches_the_pyproject_pin():
    (pin,) = _requirement("ray").specifier
    assert pin.operator == "==" and _args(DOCKERFILE)["RAY_VERSION"] == pin.version
    assert {"default", "train", "serve", "data"} <= _requirement("ray").extras


def test_torch_version_is_allowed_by_pyproject_and_equals_the_ci_pin():
    torch = _args(DOCKERFILE)["TORCH_VERSION"]
    assert _requirement("torch").specifier.contains(Version(torch))
    ci_pins = dict(line.split("==") for line in (ROOT / ".ci" / "constraints.txt").read_text().split() if "==" in line)
    assert ci_pins["torch"] == torch


def test_python_of_the_base_image_satisfies_requires_python():
    tag = _args(DOCKERFILE)["PYTHON_TAG"]  # py311 -> 3.11
    version = Version(f"{tag[2]}.{tag[3:]}")
    assert PYPROJECT["project"]["requires-python"] and Requirement(
        f"x{PYPROJECT['project']['requires-python']}"
    ).specifier.contains(version)
    # the test suite itself runs on that minor version, so the image runs what CI tested
    assert (sys.version_info.major, sys.version_info.minor) == (version.major, version.minor)


def test_torch_is_installed_first_from_the_matching_index_then_the_wheel_under_a_constraint():
    runs = _run_lines()
    torch_i = next(i for i, r in enumerate(runs) if 'pip install "torch==${TORCH_VERSION}"' in r)
    wheel_i = next(i for i, r in enumerate(runs) if "pip install /tmp/wheels/raypai-" in r)
    assert torch_i < wheel_i
    assert "download.pytorch.org/whl/${TORCH_INDEX}" in runs[torch_i]
    constraint = DOCKERFILE.index("ENV PIP_CONSTRAINT=")
    assert DOCKERFILE.index('pip install "torch==') < constraint < DOCKERFILE.index("pip install /tmp/wheels/")
    # the image proves at build time that the mapped subpackages import and platform is the stdlib's
    assert "import platform, raypai, raypai.data, raypai.alignment, raypai.serving" in runs[wheel_i]


def test_cpu_is_the_default_and_cuda_is_the_same_recipe_with_build_args():
    """Both stages build on the same Ray base (so the wheel is built with the runtime's Python);
    the CUDA image swaps the base flavour and the torch index, nothing else."""
    base = "rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-${RAY_FLAVOR}"
    assert re.findall(r"^FROM (\S+)", DOCKERFILE, flags=re.M) == [base] * 2
    assert _args(DOCKERFILE)["RAY_FLAVOR"] == "cpu" and _args(DOCKERFILE)["TORCH_INDEX"] == "cpu"
    assert "--build-arg RAY_FLAVOR=gpu --build-arg TORCH_INDEX=cu128" in DOCKERFILE


def test_wheel_stage_copies_exactly_the_package_folders():
    """Every mapped folder goes in; the build context itself (.venv, .raypai, tests) never does."""
    copied = {c.rstrip("/") for c in re.findall(r"^COPY (\S+) \S+$", DOCKERFILE, flags=re.M) if not c.startswith("--")}
    folders = {f for f in PYPROJECT["tool"]["setuptools"]["package-dir"].values()}
    assert folders <= copied
    assert "." not in copied and not any(c.startswith((".venv", "tests", ".raypai")) for c in copied)
    assert re.search(r"^COPY pyproject.toml README.md ", DOCKERFILE, flags=re.M)


def test_mlflow_server_image_matches_the_mlflow_pin():
    args = _args((ROOT / "infra" / "mlflow.Dockerfile").read_text())
    assert _requirement("mlflow").specifier.contains(Version(args["MLFLOW_VERSION"]))
