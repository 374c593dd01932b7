"""LoRA adapter folders (PEFT's format: adapter_config.json + adapter_model.safetensors), as `raypai
align` and the steps write them beside a merged model, or as any PEFT user saves them: checked against
a base model before they are registered on it, and merged into it for serving.

    raypai model import dpo-adapter/ --base models:/qwen-base@base --name qwen-dpo            # the adapter
    raypai model import dpo-adapter/ --base models:/qwen-base@base --name qwen-dpo --merge    # servable

    problems = check("dpo-adapter/", "qwen-base/")       # [] when it is a LoRA adapter that fits the base
    merge("dpo-adapter/", "qwen-base/", "qwen-dpo/")       # base + adapter as a plain HF folder
"""

from __future__ import annotations

from pathlib import Path

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def is_adapter(folder: str | Path) -> bool:
    """A folder holding a PEFT adapter's config (and no model of its own)."""
    return (Path(folder) / CONFIG).is_file() and not (Path(folder) / "config.json").is_file()


def _shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The saved tensors' shapes, read without loading them (safetensors' header; a .bin on the meta device)."""
    st = folder / WEIGHTS[0]
    if st.is_file():
        from safetensors import safe_open

        with safe_open(str(st), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    import torch

    state = torch.load(folder / WEIGHTS[1], map_location="meta", weights_only=True)
    return {k: tuple(v.shape) for k, v in state.items()}


def _features(layer) -> tuple[int, int] | None:
    """(in, out) features of a layer of the base that LoRA adapts: A is (r, in), B (out, r)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    if isinstance(layer, (Conv1D, torch.nn.Embedding)):  # weights stored (in, out): GPT-2's Conv1D, (num, dim)
        return tuple(layer.weight.shape)
    if isinstance(layer, torch.nn.Linear):
        return layer.in_features, layer.out_features
    return None


def check(adapter_dir: str | Path, base_dir: str | Path, base_name: str | None = None) -> list[str]:
    """Problems of `adapter_dir` as a LoRA adapter of the model in `base_dir` (named `base_name` in
    the messages): not a PEFT folder, not LoRA, or tensors whose shapes do not fit the base's
    layers (an adapter trained on another model). [] when it fits. The base is built on the meta
    device: nothing is loaded."""
    folder, base_name = Path(adapter_dir), base_name or str(base_dir)
    if not (folder / CONFIG).is_file() or not any((folder / w).is_file() for w in WEIGHTS):
        missing = CONFIG if not (folder / CONFIG).is_file() else " or ".join(WEIGHTS)
        return [
            f"{str(adapter_dir)!r} is not a PEFT adapter folder (no {missing}): pass the folder "
            "PeftModel.save_pretrained writes, e.g. the OUT-adapter folder `raypai align` writes beside --out"
        ]
    from peft import PeftConfig

    try:
        config = PeftConfig.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - peft raises several types for a bad config
        return [f"{str(adapter_dir)!r}: peft cannot read its {CONFIG} ({e})"]
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    if kind != "LORA":
        return [f"{str(adapter_dir)!r} is a {kind} adapter; only LoRA adapters can be registered on a base model"]

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(base_dir)))
    modules, params = dict(base.named_modules()), dict(base.named_parameters())
    bad = []
    for key, shape in sorted(_shapes(folder).items()):
        name = key.removeprefix("base_model.model.")
        part = next((p for p in (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B") if p in name), None)
        if part is None:  # a module trained whole (modules_to_save): the base's own tensor
            want = tuple(params[name].shape) if name in params else None
            if want != shape:
                bad.append(f"{key} is {list(shape)}, the base's {name} is {list(want) if want else 'missing'}")
            continue
        module = name.split(part)[0]
        features = _features(modules[module]) if module in modules else None
        if features is None:
            bad.append(f"{key}: the base has no linear layer or embedding {module}")
        elif "_A" in part and shape[-1] != features[0]:
            bad.append(f"{key} is {list(shape)}: {module} of the base takes {features[0]} inputs")
        elif "_B" in part and shape[0] != features[1]:
            bad.append(f"{key} is {list(shape)}: {module} of the base has {features[1]} outputs")
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        return [
            f"adapter {str(adapter_dir)!r} does not fit the base model {base_name}: {'; '.join(bad[:3])}{more}. It "
            f"was trained on another model (its {CONFIG} names {config.base_model_name_or_path!r}); pass that "
            "model's registry URI as --base"
        ]
    return []


def spec_of(adapter_dir: str | Path) -> dict:
    """The adapter's rank, α and target modules (for an artifact's metadata)."""
    import json

    cfg = json.loads((Path(adapter_dir) / CONFIG).read_text())
    targets = cfg.get("target_modules")
    return {
        "r": cfg.get("r"),
        "alpha": cfg.get("lora_alpha"),
        "target_modules": sorted(targets) if isinstance(targets, list) else targets,
    }


def merge(adapter_dir: str | Path, base_dir: str | Path, out_dir: str | Path) -> str:
    """The base with the adapter merged into its weights (W + (α / r) · B A), written as a plain HF
    folder with the base's tokenizer and a generation config that stops where raypai does: what
    `AutoModelForCausalLM.from_pretrained` loads and raypai serves."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from raypai.chat import ChatFormat, copy_tokenizer_files, write_generation_stops

    base = AutoModelForCausalLM.from_pretrained(str(base_dir))
    model = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer_files(str(base_dir), out)
    write_generation_stops(out, ChatFormat.from_pretrained(str(base_dir)).stop_ids)
    return str(out)
