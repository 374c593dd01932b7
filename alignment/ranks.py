"""A role that is several ranks, seen from the driver as one actor (docs/scaling.md).

    group = RankGroup("grpo/policy", actors, store)
    ray.get(group.update_on.remote(objective, *inputs))   # every rank gets the call; rank 0's reply

Each rank of a role is a Ray actor in the run's placement group; DeepSpeed (or, for the frozen
reference, plain all-gathers) joins them in one process group (`roles._ranks`). The driver keeps
writing single-process code: a call on the group is made on every rank with the same arguments,
each rank works on its share of the rows, and the group answers with rank 0's reply (which holds
the whole result). Calls that concern one process only (`ONE_RANK`) go to rank 0 alone.

The ranks meet at a TCPStore that the driver serves (port chosen by the OS at bind time, so no
port is picked free and taken by someone else before use)."""

from __future__ import annotations

import re

import ray

from raypai.alignment.roles._ranks import Rendezvous

# methods of a role's own process: its version, node or counts are rank 0's
ONE_RANK = frozenset(
    {"version", "node_id", "param_counts", "unlink_shared", "rank_memory", "open_weight_group", "join_weight_group"}
)


def rendezvous(prefix: str, ranks: int, timeout_s: float) -> tuple[Rendezvous | None, object]:
    """(where `ranks` ranks of a role meet, the store to keep alive while they run); (None, None) for one rank."""
    if ranks == 1:
        return None, None
    from datetime import timedelta

    import torch

    host = ray.util.get_node_ip_address()
    store = torch.distributed.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    return Rendezvous(host, store.port, f"{prefix}/", ranks, timeout_s), store


class _Call:
    def __init__(self, group: RankGroup, method: str):
        self.group, self.method = group, method

    def remote(self, *args, **kwargs):
        actors = self.group.actors[:1] if self.method in ONE_RANK else self.group.actors
        refs = [getattr(a, self.method).remote(*args, **kwargs) for a in actors]
        self.group.last = refs
        return refs[0]


class RankGroup:
    """The ranks of one role, called like one actor handle (`group.method.remote(...)`)."""

    def __init__(self, name: str, actors: list, store=None):
        self.name, self.actors, self._store = name, actors, store
        self._actor_id = actors[0]._actor_id  # what identifies the role (e.g. its shared-weights buffer)
        self.last: list = []

    def __len__(self) -> int:
        return len(self.actors)

    def __getattr__(self, method: str) -> _Call:
        if method.startswith("__"):
            raise AttributeError(method)
        return _Call(self, method)

    def failures(self, timeout_s: float = 5.0) -> list[str]:
        """What went wrong with which rank: a rank whose actor died, or whose last call raised."""
        found = []
        for i, actor in enumerate(self.actors):
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                found.append(f"rank {i} of {self.name} did not answer within {timeout_s:g} s (stuck in a collective?)")
                continue
            except ray.exceptions.RayActorError as e:
                found.append(f"rank {i} of {self.name} died: {cause(e)}")
                continue
            ref = self.last[i] if i < len(self.last) else None
            if ref is not None:
                done, _ = ray.wait([ref], timeout=0)
                if done:
                    try:
                        ray.get(ref)
                    except Exception as e:  # noqa: BLE001 - reported with the rank's name
                        found.append(f"rank {i} of {self.name} failed: {cause(e)}")
        return found


def cause(e: BaseException) -> str:
    """The line of a Ray error that says what went wrong: the innermost exception's ("ValueError: ...")
    when its traceback is in the message, else the message's first line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b.*:", line)]
    return raised[-1] if raised else (lines[0] if lines else type(e).__name__)


def failures(roles: list) -> list[str]:
    """`RankGroup.failures` of every group among `roles`."""
    return [f for r in roles if isinstance(r, RankGroup) for f in r.failures()]
