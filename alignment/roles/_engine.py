"""A single-process DeepSpeed engine inside an actor: fp32 weights and a torch AdamW (CPU: gloo and
the fused kernel; CUDA: NCCL, and the role runs its forward under bf16 autocast, `roles._device`)."""

from __future__ import annotations

import time

import torch

from raypai.train._deepspeed import import_deepspeed
from raypai.train.clipping import PARAMS_ATTR, clip, grad_norm, take_clipping

# DeepSpeed's gradient buckets hold this many elements by default (5e8: 2 GB of fp32, allocated whole
# on a GPU whatever the model's size); a role's are sized to its model, between these bounds
BUCKET_MIN, BUCKET_MAX = 1_000_000, 500_000_000


def engine_config(
    zero_stage: int = 0,
    *,
    grad_clip: float = 1.0,
    offload_optimizer: bool = False,
    ranks: int = 1,
    params: int | None = None,
    use_gpu: bool = False,
) -> dict:
    """The DeepSpeed config of a trained role: a micro-batch of one "sample" per rank (the role hands
    the engine whole batches, their size is the objective's business), ZeRO `zero_stage`; `params`
    (the model's parameter count) sizes the gradient buckets."""
    zero: dict = {"stage": zero_stage}
    if params is not None and zero_stage:
        bucket = int(min(BUCKET_MAX, max(BUCKET_MIN, params)))
        zero.update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
    if zero_stage == 3:
        # every parameter partitioned, however small (the default keeps those under 1e5 elements whole on
        # every rank: a toy model's weights would not be sharded at all); gathered per module in forward
        zero["stage3_param_persistence_threshold"] = 0
        if not use_gpu:
            # no prefetch and no reuse window on CPUs: with DeepSpeed's defaults a model under 5e7
            # elements stays gathered whole on every rank from its forward to its backward, and there
            # is no copy engine to overlap a prefetch with (the pretraining loop measured it: train/loop.py)
            zero.update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": ranks,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # ZeRO-Offload with the torch optimizer the role makes (DeepSpeed would insist on its own CPU Adam)
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }


def make_engine(model, *, lr: float, conf: dict, weight_decay: float = 0.0, use_gpu: bool = False):
    """A DeepSpeed engine of `model` with `conf` (`engine_config`), in the process group this
    process has joined (`roles._ranks.join`)."""
    import torch

    from raypai.checkpoint_io import guard_engine

    deepspeed = import_deepspeed()
    # torch's fused AdamW kernel (one pass over each tensor; the same update as the default loop), on
    # CPU and CUDA alike. The weights stay fp32 on a GPU too: the role's bf16 autocast is the mixed
    # precision, so the optimizer, clipping and sleep/wake see plain fp32 tensors. ZeRO-Offload steps
    # on host tensors, where the fused kernel needs the CPU build.
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    conf = dict(conf)
    zero_stage = conf["zero_optimization"]["stage"]
    max_norm = take_clipping(conf)  # fp32 ZeRO 0: raypai clips and keeps the norm (raypai.train.clipping)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=conf, dist_init_required=False)
    engine.raypai_max_norm = max_norm
    guard_engine(engine)  # checkpoints are read with weights_only=True
    if zero_stage == 0 and torch.distributed.get_world_size() == 1:
        # a role is one process: DeepSpeed's data-parallel gradient all-reduce would flatten every
        # gradient, all-reduce it with itself and copy it back at each step, an identity that costs
        # two copies of the gradients and a collective call (ZeRO ≥ 1 reduces through its optimizer)
        engine.enable_backward_allreduce = False
    if zero_stage == 0:
        # after each fp32 stage-0 step DeepSpeed sets every gradient to None by walking the module tree
        # (`named_parameters`, a visible share of a small step: benchmarks/history/asides.md); the
        # same over a list of the parameters, made once
        every = list(model.parameters())
        setattr(engine, PARAMS_ATTR, every)  # the clipping's list too (raypai.train.clipping)

        def zero_grad():
            for p in every:
                p.grad = None

        engine.zero_grad = zero_grad
    return engine


def without_dropout(model) -> None:
    """Turn off every dropout of `model` for training: `nn.Dropout` modules, and the attention
    dropout rate attention modules keep as a float (Llama, Qwen2: applied functionally in training
    mode). An RL update compares the policy's log-probs (or the critic's values) in training mode
    with those its samples, the reference and the rollout-time values were computed with in eval mode; dropout would make those differ for the same weights (a ratio off 1
    on-policy, a nonzero DPO margin at the start), so RL trainers train without it, as TRL's DPO and
    PPO trainers do by default (`disable_dropout`). The model's saved config is left as it is."""
    import torch

    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def step(engine) -> float:
    """Clip (where raypai does, see `make_engine`), step the optimizer; returns the gradient norm
    before clipping."""
    clip(engine, engine.raypai_max_norm)
    engine.step()
    return grad_norm(engine)


class Sleeps:
    """sleep()/wake() for a role holding a DeepSpeed `engine` on `self.device`: while a colocated
    role works on the same GPU, this one's weights, gradients and optimizer state wait in host
    memory (raypai.alignment.offload). On the CPU both are no-ops."""

    device = None
    _slept = None

    def sleep(self) -> dict:
        """Returns offload_bytes and offload_seconds (0 on the CPU or when already asleep)."""
        from raypai.alignment.offload import sleep

        if self.device is None or self.device.type == "cpu" or self._slept is not None:
            return {"offload_bytes": 0, "offload_seconds": 0.0}
        if self.engine.zero_optimization_partition_weights():
            # ZeRO-3: the parameters' `.data` are empty placeholders and the state lives in the
            # optimizer's flat partitions, which DeepSpeed's own offload moves (and reloads)
            t0 = time.perf_counter()
            moved = _zero3_state_bytes(self.engine)
            self.engine.offload_states(pin_memory=True)
            torch.cuda.synchronize()
            self._slept = "zero3"
            return {"offload_bytes": moved, "offload_seconds": time.perf_counter() - t0}
        self._slept = sleep(self.engine.module, self.engine.optimizer)
        return {"offload_bytes": self._slept.bytes, "offload_seconds": self._slept.seconds}

    def wake(self) -> float:
        """Back on the GPU, bitwise as before `sleep` (seconds; 0 when awake)."""
        if self._slept is None:
            return 0.0
        if self._slept == "zero3":
            t0 = time.perf_counter()
            self.engine.reload_states()
            torch.cuda.synchronize()
            self._slept = None
            return time.perf_counter() - t0
        seconds, self._slept = self._slept.wake(), None
        return seconds


def _zero3_state_bytes(engine) -> int:
    """Bytes of this rank's ZeRO-3 partitions: parameters, and the optimizer's fp32 copy and state."""
    params = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in engine.module.parameters())
    opt = engine.optimizer
    flat = sum(t.numel() * t.element_size() for t in getattr(opt, "fp32_partitioned_groups_flat", []))
    state = sum(
        v.numel() * v.element_size()
        for st in getattr(opt, "optimizer", opt).state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
    return params + flat + state


def set_mode(engine, training: bool) -> None:
    """The engine's model in train (`training`) or eval mode. `Module.train` walks every submodule
    and sets an attribute on each (a visible share of a small step: benchmarks/history/asides.md);
    the roles switch modes only here, on the whole model, so its top module's flag is the mode of
    every submodule and an unchanged mode is left alone."""
    if engine.module.training != training:
        engine.train(training)
