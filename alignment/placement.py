"""Where role actors run: one placement group per alignment run, one bundle per actor, or one
shared bundle for roles colocated on the same machine.

A role with `gpus` > 0 gets that share of a GPU (Ray's fractional GPUs; colocated roles that take
turns share one GPU through their bundle) and computes on it (`roles._device`); between phases the
trainer sleeps (`raypai.alignment.offload`) so the rollout has the device's memory."""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypai.errors import ConfigError


@dataclass(frozen=True)
class RoleSpec:
    cpus: float = 0.5
    gpus: float = 0.0
    replicas: int = 1


def _check_fits(run_name: str, bundles: list[dict]) -> None:
    """Fail now, naming the shortfall, instead of waiting forever for a placement group that cannot fit."""
    have = ray.cluster_resources()
    problems = [
        f"{res}: the roles of {run_name!r} need {sum(b.get(res, 0) for b in bundles):g}, the cluster has "
        f"{have.get(res, 0):g}"
        for res in ("CPU", "GPU")
        if sum(b.get(res, 0) for b in bundles) > have.get(res, 0)
    ]
    if problems:
        fixes = []
        if any(p.startswith("CPU") for p in problems):
            fixes.append(
                "start Ray with more logical CPUs (RAYPAI_RAY_NUM_CPUS=8, or raypai.runtime.ensure_ray(settings, "
                "num_cpus=8) from Python), or give the roles smaller RoleSpec.cpus / colocate them"
            )
        if any(p.startswith("GPU") for p in problems):
            fixes.append(
                "run on a Ray cluster with that many GPUs, or set gpus=0 in the algorithm's config "
                "to run every role on CPUs"
            )
        raise ConfigError(problems + fixes, what="role placement")


def _resources(cpus: float, gpus: float) -> dict:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def _install_wire(actor) -> None:
    """Run in each role's process once it is built: its replies' tensors travel as arrays
    (raypai.alignment._wire). A role that has not loaded torch (the Reward of plain Python reward
    functions) sends none, and is left without it."""
    import sys

    if "torch" in sys.modules:
        from raypai.alignment import _wire

        _wire.install()


class Placement:
    """`place(name, cls, spec, *args)` → actor handles named `<run>/<role>-<i>` in the dashboard."""

    def __init__(self, run_name: str, specs: dict[str, RoleSpec], colocate: tuple[tuple[str, ...], ...] = ()):
        bad = [
            f"role {r!r} asks for {spec.gpus:g} GPUs: a role runs in one process on one device, so give it at "
            "most 1 (a fraction shares one GPU)"
            for r, spec in specs.items()
            if not 0 <= spec.gpus <= 1
        ]
        if bad:
            raise ConfigError(bad, what="role placement")
        self.run_name = run_name
        self.group_of = {}
        bundles = []
        grouped = {r for g in colocate for r in g}
        for g in colocate:
            idx = len(bundles)
            bundles.append(
                _resources(
                    sum(specs[r].cpus * specs[r].replicas for r in g), sum(specs[r].gpus * specs[r].replicas for r in g)
                )
            )
            for r in g:
                self.group_of[r] = [idx] * specs[r].replicas
        for role, spec in specs.items():
            if role in grouped:
                continue
            self.group_of[role] = []
            for _ in range(spec.replicas):
                self.group_of[role].append(len(bundles))
                bundles.append(_resources(spec.cpus, spec.gpus))
        self.specs = specs
        _check_fits(run_name, bundles)
        from raypai.alignment import _wire

        _wire.install()  # the driver's batches to the roles travel as arrays (raypai.alignment._wire)
        self.pg = placement_group(bundles, strategy="PACK", name=f"{run_name}-roles")
        ray.get(self.pg.ready(), timeout=300)
        self.actors: list = []

    def place(self, role: str, cls, *args, per_replica=None, **kwargs) -> list:
        """`per_replica(i)`: keyword arguments for replica i only (e.g. its own sampling seed)."""
        spec = self.specs[role]
        handles = []
        for i, bundle in enumerate(self.group_of[role]):
            actor = (
                ray.remote(cls)
                .options(
                    name=f"{self.run_name}/{role}-{i}",
                    num_cpus=spec.cpus,
                    num_gpus=spec.gpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
                )
                .remote(*args, **kwargs, **(per_replica(i) if per_replica else {}))
            )
            actor.__ray_call__.remote(_install_wire)  # so do the role's replies (runs before any later call)
            handles.append(actor)
        self.actors += handles
        return handles

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.pg)
