"""A tiny random Llama plus the data package's byte-level BPE tokenizer (with the chat tokens and
template), built in seconds with no download: the starting point of tests, benchmarks and
`raypai align` demos on the arithmetic task.

    from raypai.alignment.tasks.tiny import build_tiny_model
    model_dir = build_tiny_model("tiny/")       # then: run_sft(model_dir, ...)
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def build_tiny_model(out_dir: str | Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     vocab_size: int = 300, seed: int = 0) -> str:
    """Writes an HF folder (config, safetensors, tokenizer) to `out_dir` and returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from raypai.data.tokenizer import train_tokenizer

    out = Path(out_dir)
    texts = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)] + ["The quick brown fox."] * 5
    with tempfile.TemporaryDirectory() as tmp:  # a one-shard dataset artifact for the tokenizer trainer
        pq.write_table(pa.table({"doc_id": [str(i) for i in range(len(texts))], "text": texts,
                                 "source": ["tiny"] * len(texts)}), Path(tmp) / "part-00000.parquet")
        train_tokenizer(tmp, out, vocab_size=vocab_size, min_frequency=1)
    tok = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                 max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id, tie_word_embeddings=True)).save_pretrained(out)
    return str(out)
