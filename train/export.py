"""The final model as a Hugging Face folder plus `raypai.json` (lineage, training config, metrics).

AutoModelForCausalLM.from_pretrained(out_dir)   # plain transformers, no raypai needed
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from raypai.errors import TrainError

MANIFEST = "raypai.json"


def export_model(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    tokenizer_dir: str | Path | None,
    eos_id: int | None,
    pad_id: int | None,
    training: dict,
    plan: dict,
    metrics: dict,
    lineage: dict,
) -> Path:
    """Copy the trained weights (`save_pretrained` output in `hf_dir`), the tokenizer files and a
    generation config into `out_dir`, and describe where the model came from in `raypai.json`."""
    from transformers import GenerationConfig

    hf_dir, out = Path(hf_dir), Path(out_dir)
    if not (hf_dir / "config.json").exists():
        raise TrainError(f"{hf_dir} holds no exported model (no config.json); the final checkpoint is incomplete")
    shutil.copytree(hf_dir, out, dirs_exist_ok=True)
    stops = [eos_id] if eos_id is not None else []
    if tokenizer_dir:
        from raypai.chat import ChatFormat, copy_tokenizer_files

        copy_tokenizer_files(tokenizer_dir, out)  # the one way tokenizer files enter a model folder
        stops = list(ChatFormat.from_pretrained(tokenizer_dir).stop_ids)  # EOS + the template's end-of-turn
    # Greedy by default so a served model answers deterministically; callers override per request.
    GenerationConfig(
        max_new_tokens=64, do_sample=False, eos_token_id=stops or None, pad_token_id=pad_id, bos_token_id=eos_id
    ).save_pretrained(out)
    numeric = {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    (out / MANIFEST).write_text(
        json.dumps({"lineage": lineage, "training": training, "plan": plan, "metrics": numeric}, indent=1, default=str)
    )
    return out
