"""Gradient clipping and the gradient norm at ZeRO stage 0 in fp32, where DeepSpeed reports no norm.

DeepSpeed clips fp32 gradients at stage 0 itself (`clip_fp32_gradients`: one norm per parameter in
a Python loop) but drops the norm it computed, so `engine.get_global_grad_norm()` is None there and
a run's `grad_norm` metric would read 0 at every step. For that case raypai takes clipping out of
the DeepSpeed config (`take_clipping`) and clips right before `engine.step()` at the accumulation
boundary (`clip`), after DeepSpeed's all-reduce, so the norm is the global one on every rank. The
arithmetic is DeepSpeed's own, to the bit: a run takes the same steps as before, only the norm is
now known. Other stages and precisions keep DeepSpeed's own clipping and norm.

    conf = ds_config(cfg); max_norm = take_clipping(conf)
    engine = deepspeed.initialize(..., config=conf)
    engine.backward(loss); clip(engine, max_norm); engine.step()
    grad_norm(engine)
"""

from __future__ import annotations

NORM_ATTR = "raypai_grad_norm"
PARAMS_ATTR = "raypai_params"


def take_clipping(conf: dict) -> float | None:
    """For fp32 ZeRO-0 configs: remove the clipping from `conf` (in place) and return its max norm
    (0: the norm is measured, nothing is clipped); otherwise None, which leaves both to DeepSpeed."""
    stage = (conf.get("zero_optimization") or {}).get("stage", 0)
    low_precision = any((conf.get(k) or {}).get("enabled") for k in ("fp16", "bf16", "bfloat16", "amp"))
    if stage or low_precision:
        return None
    max_norm = float(conf.get("gradient_clipping", 0.0) or 0.0)
    conf["gradient_clipping"] = 0.0
    return max_norm


def clip(engine, max_norm: float | None) -> None:
    """At the accumulation boundary (after DeepSpeed's gradient all-reduce, before `engine.step()`):
    the global 2-norm of the gradients, kept for `grad_norm`, and the gradients scaled to at most
    `max_norm` (Pascanu et al. 2013, "On the difficulty of training recurrent neural networks", §3.2)."""
    import torch

    if max_norm is None or not engine.is_gradient_accumulation_boundary():
        return
    # the parameters as a list made once where the engine carries one (`PARAMS_ATTR`: walking the
    # module tree every step is a visible share of a small step; benchmarks/history/asides.md)
    params = getattr(engine, PARAMS_ATTR, None) or engine.module.parameters()
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    # DeepSpeed's own arithmetic (its clip_grad_norm_ at one model-parallel rank, gradients already
    # averaged over data-parallel ranks), so a run takes the same steps as under DeepSpeed's clipping
    # the per-tensor norms in one call (on the CPU the same per-tensor kernel, without a Python call each)
    norm = torch.stack(torch._foreach_norm([g.detach().float() for g in grads], 2)).pow(2).sum().float().pow(0.5)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    setattr(engine, NORM_ATTR, float(norm))


def grad_norm(engine) -> float:
    """The last step's global gradient norm (before clipping); 0.0 where none was measured."""
    norm = getattr(engine, NORM_ATTR, None)
    if norm is None:
        norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else 0.0
