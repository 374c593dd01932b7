"""Where role actors run: one placement group per alignment run, one bundle per actor, or one
shared bundle for roles colocated on the same machine.

A role with `gpus` > 0 gets that share of a GPU (Ray's fractional GPUs; colocated roles that take
turns share one GPU through their bundle) and computes on it (`roles._device`); between phases the
trainer sleeps (`raypai.alignment.offload`) so the rollout has the device's memory.

A run on several GPUs (`gpus` > 1, whole GPUs, on one node or several: the placement group packs
its bundles where they fit) is laid out one of two ways (`placement`):
- `colocated` (verl's hybrid engine): one bundle per GPU; rank i of every GPU role goes to GPU
  i mod `gpus`, each with its share of that GPU (the shares of one GPU, as on a single GPU), so the
  roles time-share every GPU of the run;
- `separate` (ChatLearn, OpenRLHF): every rank of a GPU role gets a whole GPU of its own, nothing
  shared; the run needs one GPU per rank.
The layout (role, rank, node, GPU share, CPUs) is printed once the placement group is reserved and
before any actor starts (`Placement.table`), and actors are named `<run>/<role>-<rank>` in the
dashboard. A layout the cluster cannot hold is refused with the fix."""

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


PLACEMENTS = ("colocated", "separate")


def gpu_layout(specs: dict[str, RoleSpec], gpus: int, placement: str) -> tuple[list[dict], dict, dict]:
    """(bundles, {role: [bundle of each rank]}, {role: GPU share of each of its actors}) of a run on
    `gpus` whole GPUs. `specs[r].gpus` is role r's share of one GPU when the roles share it (0: a
    CPU role, placed beside the GPU roles' ranks when colocated, on its own otherwise)."""
    if placement not in PLACEMENTS:
        raise ConfigError(
            [f"placement {placement!r} is unknown; choose one of {', '.join(PLACEMENTS)}"], what="role placement"
        )
    group_of: dict[str, list[int]] = {}
    share: dict[str, float] = {}
    if placement == "colocated":
        bundles = [{"CPU": 0.0, "GPU": 1.0} for _ in range(gpus)]
        for role, spec in specs.items():
            group_of[role] = [i % gpus for i in range(spec.replicas)]
            stacked = -(-spec.replicas // gpus)  # ranks of this role on one GPU
            share[role] = spec.gpus / stacked
            for b in group_of[role]:
                bundles[b]["CPU"] += spec.cpus
        over = [i for i in range(gpus) if sum(share[r] * group_of[r].count(i) for r in specs) > 1 + 1e-9]
        if over:
            raise ConfigError(
                [f"GPU {over[0]} would be shared beyond itself: the roles' shares of a GPU add up to more than 1"],
                what="role placement",
            )
        return [{k: v for k, v in b.items() if v} for b in bundles], group_of, share
    bundles = []
    need = sum(spec.replicas for spec in specs.values() if spec.gpus)
    if need > gpus:
        raise ConfigError(
            [
                "placement 'separate' gives every rank of a GPU role a GPU of its own: "
                + ", ".join(f"{r} {s.replicas}" for r, s in specs.items() if s.gpus)
                + f" = {need} GPUs, the run has gpus={gpus}",
                f"set gpus={need}, or placement='colocated' (the roles time-share the {gpus} GPUs), or fewer "
                "ranks / reference_ranks / rollout_replicas",
            ],
            what="role placement",
        )
    for role, spec in specs.items():
        group_of[role] = []
        share[role] = 1.0 if spec.gpus else 0.0
        for _ in range(spec.replicas):
            group_of[role].append(len(bundles))
            bundles.append(_resources(spec.cpus, share[role]))
    return bundles, group_of, share


class Placement:
    """`place(name, cls, spec, *args)` → actor handles named `<run>/<role>-<i>` in the dashboard.
    `gpus` > 1 (whole GPUs) lays the roles out over them as `placement` says (`gpu_layout`)."""

    def __init__(
        self,
        run_name: str,
        specs: dict[str, RoleSpec],
        colocate: tuple[tuple[str, ...], ...] = (),
        *,
        gpus: float = 0,
        placement: str = "colocated",
    ):
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
        self.share = {r: spec.gpus for r, spec in specs.items()}
        if gpus > 1:
            bundles, self.group_of, self.share = gpu_layout(specs, int(gpus), placement)
        else:
            bundles = self._one_device(specs, colocate)
        self.specs = specs
        _check_fits(run_name, bundles)
        from raypai.alignment import _wire

        _wire.install()  # the driver's batches to the roles travel as arrays (raypai.alignment._wire)
        self.pg = placement_group(bundles, strategy="PACK", name=f"{run_name}-roles")
        ray.get(self.pg.ready(), timeout=300)
        self.actors: list = []
        if gpus > 1:
            print(self.table(), flush=True)

    def _one_device(self, specs: dict[str, RoleSpec], colocate) -> list[dict]:
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
        return bundles

    def layout(self) -> list[dict]:
        """One row per actor to be placed: role, rank, bundle, node (its IP) and GPU share and CPUs."""
        from ray.util import placement_group_table

        nodes = placement_group_table(self.pg).get("bundles_to_node_id", {})
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return [
            {
                "role": role,
                "rank": i,
                "bundle": b,
                "node": ips.get(nodes.get(b), str(nodes.get(b, "?"))[:12]),
                "gpu": self.share[role],
                "cpus": self.specs[role].cpus,
            }
            for role, bundles in self.group_of.items()
            for i, b in enumerate(bundles)
        ]

    def table(self) -> str:
        rows = self.layout()
        lines = [
            f"[raypai.placement] {self.run_name}: {len(rows)} actors",
            "  role/rank            node             bundle  GPU   CPUs",
        ]
        lines += [
            f"  {r['role'] + '-' + str(r['rank']):<20} {r['node']:<16} {r['bundle']:>6}  {r['gpu']:<5.3g} {r['cpus']:g}"
            for r in rows
        ]
        return "\n".join(lines)

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
                    num_gpus=self.share[role],
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
