import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from pathlib import Path

import pytest
import torch

from raypai.alignment.tasks.tiny import _bpe, build_tiny_model


@pytest.fixture(scope="module")
def ray_align(shared_ray):
    """A local Ray with its dashboard (the state API behind `list_actors` lives there); yields the GCS
    address so state queries reach *this* instance even when colleagues run other Ray clusters. The
    test process's shared Ray (tests/conftest.py), started with the dashboard if it has none."""
    return shared_ray(num_cpus=8, dashboard=True)


@pytest.fixture(scope="module")
def ray_plain(shared_ray):
    """A local Ray for modules that never query the state API: the shared one (tests/conftest.py),
    started without the dashboard when none runs, whose processes take seconds of CPU to start."""
    return shared_ray(num_cpus=8)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random tiny Llama and a byte-level BPE tokenizer with the chat tokens, made here (no downloads)."""
    from raypai.alignment.tasks.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


# Phi-3-mini-instruct's template: every turn ends with <|end|>, and a conversation rendered without a
# generation prompt ends with EOS (<|endoftext|>)
PHI3_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ '<|system|>\n' + m['content'] + '<|end|>\n' }}"
    "{% elif m['role'] == 'user' %}{{ '<|user|>\n' + m['content'] + '<|end|>\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ '<|assistant|>\n' + m['content'] + '<|end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


def build_tiny_phi3(out: Path, hidden: int = 64, layers: int = 2, vocab_size: int = 300) -> str:
    """A random-init Phi3ForCausalLM and a byte-level BPE tokenizer with Phi-3's special tokens and
    template (tokens trained on the tiny models' corpus, `raypai.alignment.tasks.tiny`). Its generation
    config is the one `save_pretrained` writes (EOS only): <|end|> is found from the template."""
    from transformers import Phi3Config, Phi3ForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_bpe(vocab_size, specials),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
    )
    tok.chat_template = PHI3_TEMPLATE
    tok.save_pretrained(out)
    torch.manual_seed(0)
    cfg = Phi3Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        original_max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    Phi3ForCausalLM(cfg).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_family():
    """`tiny_family(family, out)` -> the folder of a tiny random model of `family` with its tokenizer
    conventions (llama3, qwen2 and gpt2 from `build_tiny_model`, phi3 from `build_tiny_phi3`)."""

    def make(family: str, out: Path, hidden: int = 64, layers: int = 2) -> str:
        if family == "phi3":
            return build_tiny_phi3(out, hidden=hidden, layers=layers)
        return build_tiny_model(out, family=family, hidden=hidden, layers=layers)

    return make
