"""LoRA (Hu et al. 2021) on any trained role, through `peft`: W' = W + (α / r) · B A with A (r × in),
B (out × r), B starting at 0, so an adapted model starts as its base.

- `target_modules(model)`: the default targets, found from the model: every linear projection
  (`nn.Linear`, GPT-2's `Conv1D`) inside its repeated decoder blocks (attention and MLP), never the
  embeddings, the LM head or a scalar head.
- `attach(model, spec, head_modules)`: the peft model; the scalar head of a reward model or critic
  (`head_modules`) trains whole beside the adapters.
- `merged_weight(module)`: the weight a linear layer applies, adapters included (the lean forward
  and decoding loops read weights directly, so they call this rather than `.weight`).
- `merge_into(model, adapter, spec)`: a plain model's weights set to base + its adapters (the rollout
  replicas take only the factors at each sync and merge them here).

The reference of a LoRA run is the same weights with the adapters switched off
(`peft_model.disable_adapter()`), in the policy's own process.
"""

from __future__ import annotations

import torch

from raypai.alignment.config import LoRASpec
from raypai.errors import ConfigError


def _linear_types() -> tuple:
    from transformers.pytorch_utils import Conv1D

    return (torch.nn.Linear, Conv1D)


def _blocks(model) -> torch.nn.ModuleList | None:
    """The model's repeated decoder blocks: the longest ModuleList of identical block types."""
    best = None
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            if best is None or len(module) > len(best):
                best = module
    return best


def target_modules(model) -> list[str]:
    """The leaf names of every linear projection inside the decoder blocks (e.g. Llama's q_proj,
    k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; GPT-2's c_attn, c_proj, c_fc; Phi-3's
    qkv_proj, o_proj, gate_up_proj, down_proj)."""
    blocks = _blocks(model)
    if blocks is None:
        return []
    kinds = _linear_types()
    return sorted({name.rsplit(".", 1)[-1] for name, m in blocks.named_modules() if isinstance(m, kinds) and name})


def check(model_config, spec: LoRASpec, what: str = "LoRA") -> list[str]:
    """Problems of `spec` against a model (its `transformers` config; the model is built on the meta
    device, so nothing is allocated): a 4-bit base, target modules the model does not have."""
    problems = []
    quant = getattr(model_config, "quantization_config", None)
    if quant is not None:
        q = quant if isinstance(quant, dict) else quant.to_dict()
        if q.get("load_in_4bit") or q.get("bits") == 4 or q.get("quant_method") in ("bitsandbytes", "gptq", "awq"):
            problems.append(
                f"{what}: the base model is quantized ({q.get('quant_method', 'bitsandbytes')}, 4-bit): QLoRA is not "
                "supported; give a full-precision base model (fp32, bf16 or fp16 weights)"
            )
            return problems
    if not spec.target_modules:
        return problems
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    found = target_modules(model)
    unknown = [t for t in spec.target_modules if t not in found]
    if unknown:
        problems.append(
            f"{what}: lora_target_modules {unknown} are not linear projections of this model's blocks "
            f"({model_config.model_type}); choose among {found}, or leave lora_target_modules empty for all of them"
        )
    return problems


def attach(model, spec: LoRASpec, head_modules: list[str] | None = None):
    """`model` with LoRA adapters on `spec.target_modules` (default: all of `target_modules(model)`):
    only the adapters (and `head_modules`, trained whole) require gradients."""
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    targets = list(spec.target_modules) or target_modules(model)
    if not targets:
        raise ConfigError(
            [f"LoRA: no linear projections found in the blocks of {type(model).__name__}; set lora_target_modules"],
            what="LoRA",
        )
    conv1d = any(isinstance(m, Conv1D) for m in model.modules())  # GPT-2 stores its weights (in, out)
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        modules_to_save=head_modules or None,
        fan_in_fan_out=conv1d,
    )
    return get_peft_model(model, config)


def head_modules(model) -> list[str]:
    """The top-level modules of a scalar-head model outside its backbone (e.g. `score`, GPT-2's
    token-classification `classifier`): trained whole beside the adapters."""
    backbone = getattr(model, "base_model_prefix", "")
    return [name for name, _ in model.named_children() if name != backbone and name != "dropout"]


def is_lora(module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def merged_weight(module) -> torch.Tensor:
    """The (out, in) weight a linear layer applies: its own, or, for a LoRA layer with adapters on
    and not merged, base + Σ (α / r) · B A over the active adapters (differentiable in A and B)."""
    if not is_lora(module):
        return module.weight
    base = module.get_base_layer()
    w = base.weight
    transposed = getattr(module, "fan_in_fan_out", False)
    if transposed:
        w = w.T
    if module.disable_adapters or module.merged:
        return w
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        a, b = module.lora_A[name].weight, module.lora_B[name].weight  # (r, in), (out, r)
        w = w + module.scaling[name] * (b @ a)
    return w


def lean_ready(module) -> bool:
    """A LoRA layer the lean paths can apply as one merged weight: a plain low-rank adapter (no DoRA,
    no adapter bias) whose dropout is off (RL trains without dropout; in training mode a LoRA
    dropout > 0 needs peft's own forward, which drops the adapter's input)."""
    if not is_lora(module):
        return True
    for name in module.active_adapters:
        if module.use_dora.get(name, False) or getattr(module, "lora_bias", {}).get(name, False):
            return False
        drop = module.lora_dropout[name]
        if module.training and isinstance(drop, torch.nn.Dropout) and drop.p > 0:
            return False
    return True


def adapter_state(peft_model) -> dict:
    """The adapters' tensors (and a trained head's), by peft's names: what a sync or a checkpoint holds."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model)


def merge_into(model, adapter: dict, spec: LoRASpec, kept: dict) -> dict:
    """Set a plain model's targeted weights to base + (α / r) · B A from `adapter` (peft's names,
    `adapter_state`). `kept` (the caller's, filled here) is what the next call needs: for fp32
    weights, the factors last merged, and each call adds the difference of the two deltas in place
    (no copy of the base weights; each update adds one fp32 rounding, ~1e-7 of the weight); for
    lower precision, where that rounding would pile up, a copy of the targeted base weights. A
    trained head's weights are copied. Returns `kept`."""
    params = dict(model.named_parameters())
    factors: dict[str, dict] = {}
    for key, t in adapter.items():
        path = key.removeprefix("base_model.model.")
        if ".lora_A." in path or ".lora_B." in path:
            module, part = path.split(".lora_A." if ".lora_A." in path else ".lora_B.")[0], path
            factors.setdefault(module, {})["A" if ".lora_A." in part else "B"] = t
        elif path.endswith(".weight") or path.endswith(".bias"):  # modules_to_save: `x.modules_to_save.default.w`
            name = path.replace(".modules_to_save.default", "")
            if name in params:
                with torch.no_grad():
                    params[name].copy_(t)
    kinds = _linear_types()
    modules = dict(model.named_modules())

    def delta_of(f: dict, scale: float, conv1d: bool) -> torch.Tensor:
        d = scale * (f["B"].to(torch.float32) @ f["A"].to(torch.float32))  # (out, in)
        return d.T if conv1d else d  # Conv1D: (in, out)

    with torch.no_grad():
        for module, f in factors.items():
            layer = modules[module]
            w, conv1d = layer.weight, isinstance(layer, kinds[1])
            delta = delta_of(f, spec.scale, conv1d).to(w.device)
            if w.dtype == torch.float32:
                last = kept.get(module)
                if last is not None:
                    delta = delta - delta_of(last[0], last[1], conv1d).to(w.device)
                w.add_(delta)
                kept[module] = ({"A": f["A"].clone(), "B": f["B"].clone()}, spec.scale)
            else:
                if module not in kept:
                    kept[module] = w.detach().clone()
                w.copy_((kept[module].to(torch.float32) + delta).to(w.dtype))
    return kept


def adapter_folder(out_dir) -> str:
    """Where a LoRA run's adapter goes: beside its merged model, `out_dir` + "-adapter" (`dpo/` →
    `dpo-adapter/`); `raypai align` and the steps read it from here."""
    return f"{str(out_dir).rstrip('/')}-adapter"


def param_counts(model) -> tuple[int, int]:
    """(trainable, total) parameters."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
