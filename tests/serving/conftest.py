"""Serving fixtures: a tiny random Llama with a BPE tokenizer (chat template included), built in code."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def build_tiny_model(folder, *, hidden: int = 32, layers: int = 1, context: int = 64, init_std: float = 0.3):
    """An HF folder (safetensors + config + tokenizer). `init_std` well above the usual 0.02 makes the
    random model's logits peaked, so greedy decoding has no near-ties that float noise could flip."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from raypai.data.tokenizer import train_tokenizer

    (folder / "ds").mkdir(parents=True)
    texts = ["the quick brown fox jumps over the lazy dog"] * 20 + [
        f"{a}+{b}={a + b}" for a in range(10) for b in range(10)
    ]
    pq.write_table(
        pa.table({"doc_id": [str(i) for i in range(len(texts))], "text": texts, "source": ["t"] * len(texts)}),
        folder / "ds" / "part-00000.parquet",
    )
    train_tokenizer(folder / "ds", folder / "m", vocab_size=300, min_frequency=1)
    tok = AutoTokenizer.from_pretrained(folder / "m")
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=context,
        initializer_range=init_std,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder / "m")
    return folder / "m"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def slow_model_dir(tmp_path_factory):
    """The tiny Llama with a 4096-position context and two faults built in: its stop tokens' output rows
    are zero (greedy decoding never ends a sequence early, so a 2000-token request keeps its engine
    row for seconds), and its embedding is one row short of the tokenizer (a prompt holding the last
    token id fails its forward pass, as a tokenizer/model mismatch would). BAD_PROMPT is that token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raypai.chat import ChatFormat

    # 256 wide, 4 layers: ~5 ms a token on a CPU, ~10 s for 2000 (past test_limits' 5-s request timeout)
    path = build_tiny_model(tmp_path_factory.mktemp("slow-llama"), hidden=256, layers=4, context=4096)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(len(tok) - 1)  # the last id has no embedding (nor output row)
    with torch.no_grad():
        model.lm_head.weight[list(ChatFormat.from_pretrained(path, tokenizer=tok).stop_ids)] = 0.0
    model.save_pretrained(path)
    assert tok(BAD_PROMPT)["input_ids"] == [len(tok) - 1]
    return path


BAD_PROMPT = "16"  # slow_model_dir's tokenizer encodes it as its last id, which the model lacks
