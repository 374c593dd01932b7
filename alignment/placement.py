"""Where role actors run: one placement group per alignment run, one bundle per actor, or one
shared bundle for roles colocated on the same machine.

The role actors run on CPUs only in this version (no device placement, bf16 or offload between
phases inside them), so a RoleSpec asking for GPUs is refused rather than given a GPU it would
leave idle."""

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
    problems = [f"{res}: the roles of {run_name!r} need {sum(b.get(res, 0) for b in bundles):g}, the cluster has "
                f"{have.get(res, 0):g}" for res in ("CPU",)
                if sum(b.get(res, 0) for b in bundles) > have.get(res, 0)]
    if problems:
        raise ConfigError(problems + ["start Ray with more logical CPUs (RAYPAI_RAY_NUM_CPUS=8, or raypai.runtime.ensure_ray(settings, num_cpus=8) from Python), "
                                      "or give the roles smaller RoleSpec.cpus / colocate them"], what="role placement")


class Placement:
    """`place(name, cls, spec, *args)` → actor handles named `<run>/<role>-<i>` in the dashboard."""

    def __init__(self, run_name: str, specs: dict[str, RoleSpec], colocate: tuple[tuple[str, ...], ...] = ()):
        gpu_roles = [r for r, spec in specs.items() if spec.gpus]
        if gpu_roles:
            raise ConfigError([f"role {r!r} asks for {specs[r].gpus:g} GPU(s): raypai's alignment roles run on CPUs "
                               "only in this version (they would hold the GPU and compute on the CPU); use "
                               "RoleSpec(cpus=...) without gpus" for r in gpu_roles], what="role placement")
        self.run_name = run_name
        self.group_of = {}
        bundles = []
        grouped = {r for g in colocate for r in g}
        for g in colocate:
            idx = len(bundles)
            bundles.append({"CPU": sum(specs[r].cpus * specs[r].replicas for r in g)})
            for r in g:
                self.group_of[r] = [idx] * specs[r].replicas
        for role, spec in specs.items():
            if role in grouped:
                continue
            self.group_of[role] = []
            for _ in range(spec.replicas):
                self.group_of[role].append(len(bundles))
                bundles.append({"CPU": spec.cpus})
        self.specs = specs
        _check_fits(run_name, bundles)
        self.pg = placement_group(bundles, strategy="PACK", name=f"{run_name}-roles")
        ray.get(self.pg.ready(), timeout=300)
        self.actors: list = []

    def place(self, role: str, cls, *args, per_replica=None, **kwargs) -> list:
        """`per_replica(i)`: keyword arguments for replica i only (e.g. its own sampling seed)."""
        spec = self.specs[role]
        handles = []
        for i, bundle in enumerate(self.group_of[role]):
            actor = ray.remote(cls).options(
                name=f"{self.run_name}/{role}-{i}", num_cpus=spec.cpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
            ).remote(*args, **kwargs, **(per_replica(i) if per_replica else {}))
            handles.append(actor)
        self.actors += handles
        return handles

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.pg)
