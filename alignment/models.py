"""Model folders for alignment: any local HF causal-LM folder or a registered model URI
(`models:/name@alias`, `models:/name/3`), checked before any actor starts."""

from __future__ import annotations

import json
from pathlib import Path

from raypai.errors import ConfigError


def check_causal_lm(model_dir: str | Path, role: str = "policy") -> str:
    """The folder, if transformers can build a causal LM from it; else one ConfigError with the fix."""
    path = Path(model_dir)
    cfg_file = path / "config.json"
    if not cfg_file.is_file() and (path / "adapter_config.json").is_file():
        raise ConfigError(
            [
                f"{role} model {str(model_dir)!r} is a LoRA adapter, not a model: pass the merged model written "
                "beside it (OUT for OUT-adapter), or merge it into its base with `raypai model import ADAPTER_DIR "
                "--base models:/NAME@ALIAS --name NAME --merge`"
            ],
            what="model",
        )
    if not cfg_file.is_file():
        raise ConfigError(
            [
                f"{role} model {str(model_dir)!r} is not a Hugging Face model folder (no config.json); pass "
                "a folder written by save_pretrained, or a registered model URI (models:/NAME@ALIAS) "
                "— `raypai model import DIR --name NAME` registers an existing folder"
            ],
            what="model",
        )
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - transformers raises several types for unknown configs
        raise ConfigError(
            [f"{role} model {str(model_dir)!r}: transformers cannot read its config.json ({e})"], what="model"
        ) from e
    archs = json.loads(cfg_file.read_text()).get("architectures") or []
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (archs and not causal & set(archs)):
        raise ConfigError(
            [
                f"{role} model {str(model_dir)!r} is a {config.model_type!r} model ({archs}), not a causal "
                "language model; alignment needs an AutoModelForCausalLM folder (Llama, Qwen2, GPT-2, "
                "Mistral, ...)"
            ],
            what="model",
        )
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ConfigError(
            [
                f"{role} model {str(model_dir)!r} has no tokenizer files; save the tokenizer into the same "
                "folder (tokenizer.save_pretrained(folder))"
            ],
            what="model",
        )
    return str(path)


def resolve_model(
    model: str | Path, tracking_uri: str | None = None, role: str = "policy", cache_dir: str | Path | None = None
) -> str:
    """A local folder for `model`: the folder itself, or a registry URI downloaded through MLflow."""
    m = str(model)
    if m.startswith("models:/"):
        from raypai.tracking import Tracker

        if tracking_uri is None:
            raise ConfigError(
                [f"{role} model {m!r} is a registry URI; pass tracking_uri (the CLI and steps do)"], what="model"
            )
        name, sep, ref = _split_uri(m)
        return check_causal_lm(Tracker(tracking_uri).download_model(name, ref, cache_dir=cache_dir), role)
    return check_causal_lm(m, role)


def _split_uri(uri: str) -> tuple[str, str, str]:
    body = uri[len("models:/") :]
    if "@" in body:
        name, alias = body.split("@", 1)
        return name, "@", alias
    name, _, version = body.rpartition("/")
    return name, "/", version


def format_and_limit(model_dir: str, cfg):
    """(ChatFormat, Truncation) for a model folder and an algorithm config (max_length 0 = the
    model's own context length)."""
    from transformers import AutoConfig

    from raypai.chat import ChatFormat, Truncation, context_length

    limit = getattr(cfg, "max_length", 0) or context_length(AutoConfig.from_pretrained(model_dir))
    return ChatFormat.from_pretrained(model_dir), Truncation(limit, getattr(cfg, "truncation", "refuse"))


def check_prompts(fmt, prompts, trunc, max_new_tokens: int, name: str = "prompt") -> None:
    """Every prompt plus max_new_tokens fits the context (or the run is refused, naming the prompt);
    conversational prompts on a model without a chat template fail here, before any actor starts."""
    from raypai.errors import DataError

    for i, p in enumerate(prompts):
        n = len(fmt.prompt_ids(p.prompt if hasattr(p, "prompt") else p))
        if n + max_new_tokens > trunc.max_length:
            raise DataError(
                f"{name} {i} is {n} tokens; with max_new_tokens={max_new_tokens} it exceeds the context of "
                f"{trunc.max_length}: shorten it, drop it, or lower max_new_tokens"
            )
