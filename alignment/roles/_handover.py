"""The trainer's side of the weight hand-over to the rollout replicas (`raypai.alignment.sync`): its
weights in the replicas' dtype, whole (ZeRO ≤ 2) or gathered bucket by bucket (ZeRO-3), into the
same-node replicas' shared-memory buffer or the object store for replicas on other nodes."""

from __future__ import annotations

import torch

# a ZeRO-3 trainer's weight sync gathers this many bytes of parameters at a time (`_gathered_parts`)
SYNC_BUCKET_BYTES = 64 * 2**20


class HandsOver:
    """Mixed into `Trainer` (which sets `engine`, `rank`, `zero_stage`, `lora`, `sync_dtype`,
    `updates_done`, `_live`, `_shared` and `sync_bucket_bytes`)."""

    @staticmethod
    def _shared_path():
        import sys
        import uuid

        from raypai.alignment.sync import shared_path

        ray = sys.modules.get("ray")  # in an actor Ray is loaded; a role built in-process may have none
        actor = ray.get_runtime_context().get_actor_id() if ray is not None and ray.is_initialized() else None
        return shared_path(actor[:24] if actor else uuid.uuid4().hex[:24])

    def state_dict(self) -> dict:
        """The weights on the host (in `sync_dtype` when set): what replicas on other nodes load. With
        LoRA, the adapters only, as {"lora": tensors by peft's names, "spec": the LoRASpec}: the
        replicas merge them into their own weights (`Rollout.load_weights`)."""
        if self.lora is not None:
            from raypai.alignment.lora import adapter_state

            if self.rank:
                return None  # every rank holds the same adapters (LoRA runs at ZeRO ≤ 2)
            state = adapter_state(self.engine.module)
            return {"lora": {k: v.detach().to("cpu").clone() for k, v in state.items()}, "spec": self.lora}
        state = self._whole_state()
        if state is None:
            return None
        return {k: v.detach().to("cpu", self.sync_dtype).clone() for k, v in state.items()}

    def state_parts(self) -> dict | None:
        """What replicas on other nodes load: at ZeRO-3 {"parts": [ObjectRef of one bucket's
        {name: tensor}, ...]}, each bucket gathered (`_gathered_parts`, `sync_bucket_bytes`) and put
        in Ray's object store on its own, so no rank ever holds a whole copy of the model (every rank
        must call it; rank 0 returns the refs); otherwise `state_dict()`."""
        if self.zero_stage != 3 or self.lora is not None:
            return self.state_dict()
        import ray

        refs, bucket, size = [], {}, 0
        for name, t in self._gathered_parts(self.sync_bucket_bytes):
            if self.rank:
                continue  # every rank takes part in each bucket's gather
            bucket[name] = t.detach().to("cpu", self.sync_dtype if t.is_floating_point() else t.dtype).clone()
            size += t.numel() * t.element_size()
            if size >= self.sync_bucket_bytes:
                refs.append(ray.put(bucket))
                bucket, size = {}, 0
        if self.rank:
            return None
        if bucket:
            refs.append(ray.put(bucket))
        return {"parts": refs}

    def _whole_state(self) -> dict | None:
        """The model's whole state dict on rank 0, None on the others. At ZeRO-3 every rank must call
        it: DeepSpeed gathers the shards one module at a time into rank 0's host memory."""
        if self.zero_stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()  # fp32 here: "16bit" is its name only
        return None if self.rank else self.engine.module.state_dict()

    def _state_layout(self) -> tuple[list, dict[int, list[str]], dict[int, torch.nn.Parameter]]:
        """The module's state dict as ([(name, buffer)], {param id: its names}, {param id: param}),
        parameters in order of first appearance: the order `_gathered_parts` gives them in."""
        names_of: dict[int, list[str]] = {}
        params: dict[int, torch.nn.Parameter] = {}
        buffers = []
        for name, t in self.engine.module.state_dict(keep_vars=True).items():
            if isinstance(t, torch.nn.Parameter):
                names_of.setdefault(id(t), []).append(name)
                params[id(t)] = t
            else:
                buffers.append((name, t))
        return buffers, names_of, params

    def _gathered_parts(self, bucket_bytes: int = SYNC_BUCKET_BYTES):
        """(state-dict name, whole tensor) of a ZeRO-3 model, gathered `bucket_bytes` of parameters at a
        time (every rank must iterate it to the end: each bucket is a collective); tied weights are
        gathered once and given under each of their names; buffers are whole on every rank. A tensor
        is valid only until the next one is asked for (its bucket is released after)."""
        import deepspeed

        buffers, names_of, params = self._state_layout()
        yield from buffers  # buffers (rotary inv_freq, ...): not partitioned
        bucket, size, last = [], 0, next(reversed(params), None)
        self.sync_buckets = 0  # gathers of the last sync (tests and tracing read it)
        for key, p in params.items():
            bucket.append(key)
            size += p.ds_numel * p.element_size()
            if size >= bucket_bytes or key == last:
                self.sync_buckets += 1
                with deepspeed.zero.GatheredParameters([params[k] for k in bucket], modifier_rank=None):
                    for k in bucket:
                        for name in names_of[k]:
                            yield name, params[k].data
                bucket, size = [], 0

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def write_shared(self, *after) -> tuple[str, int, bool]:
        """Make the current weights readable by same-node replicas; returns (the buffer's path, the
        weights' version, live). Live, the parameters already are the buffer: only the version is
        stamped (it covers in-place changes made outside an update, e.g. a checkpoint load).
        Otherwise they are copied into this trainer's buffer. `after`: the replicas' loads of the
        last round, as ObjectRefs, which Ray resolves before this runs (their values are unused)."""
        from raypai.alignment.sync import SharedWeights

        if self._live:
            self._shared.stamp(self.updates_done)
            return self._shared.path, self.updates_done, True
        if self.zero_stage == 3:
            # gathered bucket by bucket straight into the buffer: no whole copy of the model first
            if self._shared is None and self.rank == 0:
                module = self.engine.module
                like = {
                    k: torch.empty(getattr(t, "ds_shape", t.shape), dtype=self.sync_dtype or t.dtype, device="meta")
                    for k, t in module.state_dict(keep_vars=True).items()
                }
                self._shared = SharedWeights(self._shared_path(), like, create=True)
            parts = self._gathered_parts(self.sync_bucket_bytes)
            if self.rank:
                for _ in parts:  # every rank takes part in each bucket's gather
                    pass
                return None
            self._shared.write_parts(parts, self.updates_done)
            return self._shared.path, self.updates_done, False
        state = self._whole_state()
        if state is None:
            return None  # not rank 0: the buffer is rank 0's
        if self._shared is None:
            # the layout in the replicas' dtype: the copy into the buffer casts (fp32 → bf16 for GPU replicas)
            like = {k: torch.empty(v.shape, dtype=self.sync_dtype or v.dtype, device="meta") for k, v in state.items()}
            self._shared = SharedWeights(self._shared_path(), like, create=True)
        self._shared.write(state, self.updates_done)
        return self._shared.path, self.updates_done, False

    def unlink_shared(self) -> None:
        """Remove the buffer's file (every replica has mapped it; the mappings stay valid)."""
        import os

        if self._shared is not None and os.path.exists(self._shared.path):
            os.unlink(self._shared.path)

    # ---- the weight group (`weight_transport="collective"`, raypai.alignment.sync_group) ----------

    def _send_order(self) -> list[tuple[str, tuple, torch.dtype]]:
        """(name, shape, dtype in the replicas' precision) of what `_parts_to_send` yields, in order."""
        module = self.engine.module

        def entry(name, t):
            dtype = self.sync_dtype if self.sync_dtype is not None and t.is_floating_point() else t.dtype
            return name, tuple(getattr(t, "ds_shape", t.shape)), dtype

        if self.zero_stage != 3:
            return [entry(k, t) for k, t in module.state_dict(keep_vars=True).items()]
        # `_gathered_parts`' order: the buffers, then each parameter under every name it has
        buffers, names_of, params = self._state_layout()
        return [entry(k, t) for k, t in buffers] + [entry(n, params[key]) for key in params for n in names_of[key]]

    def _parts_to_send(self):
        if self.zero_stage == 3:
            return self._gathered_parts(self.sync_bucket_bytes)  # every rank takes part in the gathers
        return iter(self.engine.module.state_dict().items()) if self.rank == 0 else iter(())

    def open_weight_group(self, timeout_s: float = 60.0) -> tuple[str, int, str, list]:
        """Rank 0: the weight group's rendezvous (host, port), its backend and the manifest the
        replicas check and follow."""
        from raypai.alignment import sync_group as G

        if self.lora is not None:
            raise RuntimeError("a LoRA trainer hands its replicas the adapters through the object store")
        self._wg_store, host, port = G.make_store(timeout_s)
        self._wg_manifest = G.manifest(self._send_order(), self.sync_bucket_bytes)
        return host, port, G.BACKENDS[self.device.type], self._wg_manifest

    def join_weight_group(self, host: str, port: int, size: int, timeout_s: float = 60.0) -> bool:
        """Rank 0 joins as the group's rank 0 (returns once every replica has joined)."""
        from raypai.alignment import sync_group as G

        self._wg = G.open_group(host, port, 0, size, G.BACKENDS[self.device.type], timeout_s)
        return True

    def push_weights(self) -> int:
        """Broadcast the current weights to the group's replicas, bucket by bucket (every rank must
        call it: at ZeRO-3 each bucket is gathered first). Returns the bytes rank 0 sent."""
        from raypai.alignment import sync_group as G

        parts = self._parts_to_send()
        if self.rank:
            for _ in parts:
                pass
            return 0
        return G.send(self._wg, parts, self._wg_manifest, self.device)
