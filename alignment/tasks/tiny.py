"""Tiny random-init causal LMs of real transformers families, each with its own tokenizer
conventions, built in seconds with no download: the starting point of tests, benchmarks and demos.

    from raypai.alignment.tasks.tiny import build_tiny_model
    build_tiny_model("tiny/")                     # Llama + raypai's own tokenizer and chat format
    build_tiny_model("q/", family="qwen2")        # Qwen2 + a ChatML template (<|im_start|>/<|im_end|>), EOS <|endoftext|>
    build_tiny_model("l/", family="llama3")       # Llama + a Llama-3-style template (<|eot_id|>), no pad token
    build_tiny_model("g/", family="gpt2")         # GPT-2 + no chat template (completion format), no pad token
"""

from __future__ import annotations

import tempfile
from pathlib import Path

FAMILIES = ("raypai", "llama3", "qwen2", "gpt2")

# Chat templates written for these tiny models in the style of each family's published format.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    sums = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    words = [
        "The quick brown fox jumps over the lazy dog.",
        "user assistant system",
        "Say hello. Hello there!",
        "What is the capital of France? Paris.",
        "Answer briefly: yes or no.",
    ]
    return sums + words * 5


def _bpe(vocab_size: int, specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _corpus(),
        trainer=trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=1,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


def _tokenizer(family: str, out: Path, vocab_size: int):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    if family == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        tok = _bpe(vocab_size, specials)
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
        )
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<|begin_of_text|>",
            eos_token="<|end_of_text|>",
            additional_special_tokens=specials[2:],
        )
        fast.chat_template = LLAMA3_TEMPLATE
    elif family == "qwen2":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        fast = PreTrainedTokenizerFast(
            tokenizer_object=_bpe(vocab_size, specials),
            eos_token="<|endoftext|>",
            pad_token="<|endoftext|>",
            additional_special_tokens=specials[1:],
        )
        fast.chat_template = CHATML_TEMPLATE
    elif family == "gpt2":
        fast = PreTrainedTokenizerFast(
            tokenizer_object=_bpe(vocab_size, ["<|endoftext|>"]), bos_token="<|endoftext|>", eos_token="<|endoftext|>"
        )
    else:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    fast.save_pretrained(out)
    return fast


def build_tiny_model(
    out_dir: str | Path,
    *,
    family: str = "raypai",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = 300,
    context: int = 128,
    seed: int = 0,
) -> str:
    """Writes an HF folder (config, safetensors, tokenizer, generation config) to `out_dir`."""
    import torch
    from transformers import (
        GenerationConfig,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if family == "raypai":
        import pyarrow as pa
        import pyarrow.parquet as pq
        from transformers import AutoTokenizer

        from raypai.data.tokenizer import train_tokenizer

        texts = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)] + ["The quick brown fox."] * 5
        with tempfile.TemporaryDirectory() as tmp:  # a one-shard dataset artifact for the tokenizer trainer
            pq.write_table(
                pa.table(
                    {"doc_id": [str(i) for i in range(len(texts))], "text": texts, "source": ["tiny"] * len(texts)}
                ),
                Path(tmp) / "part-00000.parquet",
            )
            train_tokenizer(tmp, out, vocab_size=vocab_size, min_frequency=1)
        tok = AutoTokenizer.from_pretrained(out)
    else:
        tok = _tokenizer(family, out, vocab_size)
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    if family in ("raypai", "llama3"):
        model = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                max_position_embeddings=context,
                tie_word_embeddings=True,
                **common,
            )
        )
    elif family == "qwen2":
        model = Qwen2ForCausalLM(
            Qwen2Config(
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                max_position_embeddings=context,
                tie_word_embeddings=True,
                **common,
            )
        )
    else:
        model = GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=context, **common))
    model.save_pretrained(out)
    if family == "llama3":  # as Llama 3 Instruct ships it: generation stops at end-of-text or end-of-turn
        GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")]
        ).save_pretrained(out)
    return str(out)
