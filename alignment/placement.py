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
A role with `tensor_parallel` = k > 1 (the vLLM rollout with `rollout_tensor_parallel`) spans k GPUs
per replica, in either layout: the replica's actor holds CPUs only, in the bundle of its first GPU,
and vLLM's Ray workers (one per GPU, started by the engine inside the actor as child tasks of the
run's placement group) take its share of each of the k GPU bundles (`gpus_of`). Colocated, replica i
takes GPUs [i·k, i·k + k) mod `gpus` (aligned blocks: `gpus` a multiple of k); separate, k GPU
bundles of its own. A group's bundles must land on one node (NCCL between a node's GPUs): once the
placement group is reserved, one split over nodes is refused with the fix (`split_groups`).
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
    gpus: float = 0.0  # the share of one GPU each actor takes (of each of its GPUs when tensor_parallel > 1)
    replicas: int = 1
    tensor_parallel: int = 1  # GPUs per replica (a vLLM tensor-parallel group); its share `gpus` of each


def _check_fits(run_name: str, bundles: list[dict]) -> None:
    """Fail now, naming the shortfall, instead of waiting forever for a placement group that cannot fit."""
    have = ray.cluster_resources()
    problems = [
        f"{res}: the roles of {run_name!r} need {sum(b.get(res, 0) for b in bundles):g}, the cluster has "
        f"{have.get(res, 0):g}"
        for res in ("CPU", "GPU")
        if sum(b.get(res, 0) for b in bundles) > have.get(res, 0)
    ]
    # each bundle lands whole on one node: on several nodes the sums above can fit while no node holds
    # a bundle, and the placement group would wait forever
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    for b in {tuple(sorted(b.items())) for b in bundles}:
        if not any(all(node.get(k, 0) >= v for k, v in b) for node in nodes):
            need = dict(b)
            problems.append(
                f"bundle: no node of the cluster can hold {need.get('CPU', 0):g} CPUs"
                + (f" and {need['GPU']:g} GPUs" if need.get("GPU") else "")
                + " in one bundle (the roles placed together); the largest node has "
                f"{max((n.get('CPU', 0) for n in nodes), default=0):g} CPUs, the most GPUs on a node are "
                f"{max((n.get('GPU', 0) for n in nodes), default=0):g}"
            )
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
        if any(p.startswith("bundle") for p in problems):
            fixes.append(
                "give the roles smaller RoleSpec.cpus / gpus, or colocate fewer of them (a colocated group is one "
                "bundle), or add nodes that large"
            )
        raise ConfigError(problems + fixes, what="role placement")


def _resources(cpus: float, gpus: float) -> dict:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def _gpu_text(row: dict) -> str:
    """The GPU column: the share of one GPU, or of each of a tensor-parallel rank's GPUs (0.5×2)."""
    k = len(row["tp_bundles"])
    return f"{row['gpu']:.3g}" + (f"×{k}" if k > 1 else "")


def _install_wire(actor) -> None:
    """Run in each role's process once it is built: its replies' tensors travel as arrays
    (raypai.alignment._wire). A role that has not loaded torch (the Reward of plain Python reward
    functions) sends none, and is left without it."""
    import sys

    if "torch" in sys.modules:
        from raypai.alignment import _wire

        _wire.install()


PLACEMENTS = ("colocated", "separate")


def gpu_layout(
    specs: dict[str, RoleSpec], gpus: int, placement: str
) -> tuple[list[dict], dict, dict[str, list[list[int]]], dict]:
    """(bundles, {role: [bundle of each rank's actor]}, {role: [GPU bundles of each rank]}, {role: GPU
    share of each of its GPUs}) of a run on `gpus` whole GPUs. `specs[r].gpus` is role r's share of one
    GPU when the roles share it (0: a CPU role, placed beside the GPU roles' ranks when colocated, on its
    own otherwise); `specs[r].tensor_parallel` = k: each rank spans k GPUs (its actor in the first one's
    bundle, with no GPU of its own: the engine's workers take them)."""
    if placement not in PLACEMENTS:
        raise ConfigError(
            [f"placement {placement!r} is unknown; choose one of {', '.join(PLACEMENTS)}"], what="role placement"
        )
    _check_groups(specs, gpus, placement)
    group_of: dict[str, list[int]] = {}
    gpus_of: dict[str, list[list[int]]] = {}
    share: dict[str, float] = {}
    if placement == "colocated":
        bundles = [{"CPU": 0.0, "GPU": 1.0} for _ in range(gpus)]
        for role, spec in specs.items():
            k = spec.tensor_parallel
            gpus_of[role] = [[(i * k + j) % gpus for j in range(k)] for i in range(spec.replicas)]
            group_of[role] = [g[0] for g in gpus_of[role]]
            stacked = -(-spec.replicas * k // gpus)  # ranks (TP workers) of this role on one GPU
            share[role] = spec.gpus / stacked
            for b in group_of[role]:
                bundles[b]["CPU"] += spec.cpus
        over = [i for i in range(gpus) if sum(share[r] * sum(g.count(i) for g in gpus_of[r]) for r in specs) > 1 + 1e-9]
        if over:
            raise ConfigError(
                [f"GPU {over[0]} would be shared beyond itself: the roles' shares of a GPU add up to more than 1"],
                what="role placement",
            )
        return [{k: v for k, v in b.items() if v} for b in bundles], group_of, gpus_of, share
    bundles = []
    need = sum(spec.replicas * spec.tensor_parallel for spec in specs.values() if spec.gpus)
    if need > gpus:
        raise ConfigError(
            [
                "placement 'separate' gives every rank of a GPU role a GPU of its own: "
                + ", ".join(_ranks_text(r, s) for r, s in specs.items() if s.gpus)
                + f" = {need} GPUs, the run has gpus={gpus}",
                f"set gpus={need}, or placement='colocated' (the roles time-share the {gpus} GPUs), or fewer "
                "ranks / reference_ranks / rollout_replicas / a smaller rollout_tensor_parallel",
            ],
            what="role placement",
        )
    for role, spec in specs.items():
        group_of[role], gpus_of[role] = [], []
        share[role] = 1.0 if spec.gpus else 0.0
        for _ in range(spec.replicas):
            first = len(bundles)
            group_of[role].append(first)
            bundles.append(_resources(spec.cpus, share[role]))
            if spec.gpus:  # the other GPUs of its tensor-parallel group, for the engine's workers
                bundles += [{"GPU": 1.0} for _ in range(spec.tensor_parallel - 1)]
            gpus_of[role].append(list(range(first, len(bundles))))
    return bundles, group_of, gpus_of, share


def _ranks_text(role: str, spec: RoleSpec) -> str:
    k = spec.tensor_parallel
    return f"{role} {spec.replicas}" + (f" × {k} (tensor parallel)" if k > 1 else "")


def _check_groups(specs: dict[str, RoleSpec], gpus: int, placement: str) -> None:
    """A tensor-parallel group of k GPUs needs k ≤ `gpus`, colocated on aligned blocks (`gpus` a multiple of k)."""
    bad = []
    for role, spec in specs.items():
        k = spec.tensor_parallel
        if k == 1:
            continue
        if not spec.gpus:
            bad.append(f"role {role!r} has tensor_parallel={k} but no GPU share: tensor parallelism runs on GPUs")
        elif k > gpus or (placement == "colocated" and gpus % k):
            bad.append(
                f"role {role!r}: each replica spans rollout_tensor_parallel={k} GPUs, which the run's gpus={gpus} "
                + (
                    "cannot hold"
                    if k > gpus
                    else "does not divide into (colocated replicas take aligned blocks of k GPUs)"
                )
                + f": set gpus to a multiple of {k}, or a smaller rollout_tensor_parallel"
            )
    if bad:
        raise ConfigError(bad, what="role placement")


def split_groups(gpus_of: dict[str, list[list[int]]], node_of: dict[int, str]) -> list[str]:
    """Problems for every tensor-parallel group (a rank's GPU bundles, more than one) whose bundles the
    placement group put on more than one node (`node_of`: bundle → node)."""
    return [
        f"{role}-{i}'s {len(g)} GPUs (bundles {', '.join(map(str, g))}) landed on {len(nodes)} nodes "
        f"({', '.join(sorted(nodes))}): a tensor-parallel group runs on one node"
        for role, groups in gpus_of.items()
        for i, g in enumerate(groups)
        if len(g) > 1 and len(nodes := {str(node_of.get(b)) for b in g}) > 1
    ]


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
        bad += [
            f"role {r!r} spans tensor_parallel={spec.tensor_parallel} GPUs, but the run has gpus={gpus:g}: set gpus "
            f"to at least {spec.tensor_parallel} whole GPUs, or rollout_tensor_parallel=1"
            for r, spec in specs.items()
            if spec.tensor_parallel > 1 and gpus <= 1
        ]
        if bad:
            raise ConfigError(bad, what="role placement")
        self.run_name = run_name
        self.group_of = {}
        self.gpus_of: dict[str, list[list[int]]] = {}  # GPU bundles of each rank spanning several
        self.share = {r: spec.gpus for r, spec in specs.items()}
        if gpus > 1:
            bundles, self.group_of, self.gpus_of, self.share = gpu_layout(specs, int(gpus), placement)
        else:
            bundles = self._one_device(specs, colocate)
        self.specs = specs
        _check_fits(run_name, bundles)
        from raypai.alignment import _wire

        _wire.install()  # the driver's batches to the roles travel as arrays (raypai.alignment._wire)
        self.pg = placement_group(bundles, strategy="PACK", name=f"{run_name}-roles")
        ray.get(self.pg.ready(), timeout=300)
        self.actors: list = []
        self._refuse_split_groups()
        if gpus > 1 or len({r["node_id"] for r in self.layout()}) > 1:  # several GPUs or nodes
            print(self.table(), flush=True)

    def _refuse_split_groups(self) -> None:
        from ray.util import placement_group_table

        if not any(len(g) > 1 for groups in self.gpus_of.values() for g in groups):
            return
        split = split_groups(self.gpus_of, placement_group_table(self.pg).get("bundles_to_node_id", {}))
        if split:
            remove_placement_group(self.pg)
            raise ConfigError(
                split + ["run on nodes whose free GPUs are a multiple of rollout_tensor_parallel, or lower it"],
                what="role placement",
            )

    def tensor_parallel(self, role: str, rank: int) -> dict:
        """What an engine spanning several GPUs needs to start its workers (beside its share of each,
        `share[role]`): k and the GPU bundles of `role`'s rank `rank` in this run's placement group ({}
        for a rank on one device)."""
        k = self.specs[role].tensor_parallel
        return {} if k == 1 else {"tensor_parallel": k, "gpu_bundles": list(self.gpus_of[role][rank])}

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
        """One row per actor to be placed: role, rank, bundle, node (its IP) and GPU share and CPUs; a rank
        spanning several GPUs (`tensor_parallel`): its share of each and their bundles (`tp_bundles`)."""
        from ray.util import placement_group_table

        nodes = placement_group_table(self.pg).get("bundles_to_node_id", {})
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return [
            {
                "role": role,
                "rank": i,
                "bundle": b,
                "node": ips.get(nodes.get(b), str(nodes.get(b, "?"))[:12]),
                "node_id": nodes.get(b),  # the IP alone is shared by the nodes of one host
                "gpu": self.share[role],
                "cpus": self.specs[role].cpus,
                "tp_bundles": self.gpus_of[role][i] if self.specs[role].tensor_parallel > 1 else [],
            }
            for role, bundles in self.group_of.items()
            for i, b in enumerate(bundles)
        ]

    def table(self) -> str:
        rows = self.layout()
        lines = [
            f"[raypai.placement] {self.run_name}: {len(rows)} actors",
            "  role/rank            node (IP, id)             bundle  GPU   CPUs",
        ]
        lines += [
            f"  {r['role'] + '-' + str(r['rank']):<20} {r['node'] + ' ' + str(r['node_id'])[:8]:<25} {r['bundle']:>6}  "
            f"{_gpu_text(r):<5} {r['cpus']:g}"
            + (
                f"  tensor parallel over the GPUs of bundles {','.join(map(str, r['tp_bundles']))}"
                if r["tp_bundles"]
                else ""
            )
            for r in rows
        ]
        return "\n".join(lines)

    def place(self, role: str, cls, *args, per_replica=None, **kwargs) -> list:
        """`per_replica(i)`: keyword arguments for replica i only (e.g. its own sampling seed). A rank
        spanning several GPUs holds none itself: the workers its engine starts as child tasks (captured
        by this placement group) take them, in the bundles `tensor_parallel(role, i)` names."""
        spec = self.specs[role]
        tp = spec.tensor_parallel > 1
        handles = []
        for i, bundle in enumerate(self.group_of[role]):
            actor = (
                ray.remote(cls)
                .options(
                    name=f"{self.run_name}/{role}-{i}",
                    num_cpus=spec.cpus,
                    num_gpus=0 if tp else self.share[role],
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.pg, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=tp
                    ),
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
