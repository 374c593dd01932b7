"""raypai.chat on chat templates shaped like published ones that the family tests do not use:
Phi-3 (EOS written only at the very end of a conversation), Mistral (no generation prompt, the
assistant turn ends with EOS), Gemma (role 'model', no system role). Negatives: a template that
rewrites earlier turns, and one that refuses a system message, each with one clear error."""

import pytest
from transformers import PreTrainedTokenizerFast

from raypai.alignment.tasks.tiny import _bpe
from raypai.chat import ChatFormat
from raypai.errors import DataError

PHI3 = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
# Earlier assistant turns lose their reasoning once a later turn follows (as reasoning models' templates do)
REWRITES = (
    "{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{% set c = c.split('</think>')[-1] %}{% endif %}{{ '<|' + m['role'] + '|>' + c + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

SPECIALS = {
    "phi3": ["<unk>", "<s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"],
    "mistral": ["<unk>", "<s>", "</s>"],
    "gemma": ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
}
CHAT = [
    {"role": "user", "content": "1+2="},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "2+2="},
    {"role": "assistant", "content": "4"},
]


def _fmt(specials, template, **tokens) -> ChatFormat:
    tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(300, specials), **tokens)
    tok.chat_template = template
    return ChatFormat(tok)


def _learned(fmt, ids, mask) -> list[str]:
    """The learned tokens as runs of text."""
    runs, cur = [], []
    for t, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(fmt.tok.decode(cur))
            cur = []
    return runs


def test_phi3_style_template_with_an_eos_only_at_the_end():
    fmt = _fmt(
        SPECIALS["phi3"],
        PHI3,
        bos_token="<s>",
        eos_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS["phi3"][3:],
    )
    assert set(fmt.stop_ids) == {
        fmt.tok.convert_tokens_to_ids("<|endoftext|>"),
        fmt.tok.convert_tokens_to_ids("<|end|>"),
    }
    ids, mask = fmt.encode_messages(CHAT)
    assert _learned(fmt, ids, mask) == ["3<|end|>", "4<|end|>\n<|endoftext|>"]
    assert fmt.tok.decode(ids) == fmt.render(CHAT, add_generation_prompt=False)  # nothing lost or doubled
    ids, mask = fmt.encode_messages(CHAT, learn_from=2)  # the first answer is context
    assert _learned(fmt, ids, mask) == ["4<|end|>\n<|endoftext|>"]


def test_mistral_style_template_without_a_generation_prompt():
    fmt = _fmt(SPECIALS["mistral"], MISTRAL, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    ids, mask = fmt.encode_messages(CHAT)
    assert _learned(fmt, ids, mask) == ["3</s>", "4</s>"]
    assert fmt.tok.decode(ids) == fmt.render(CHAT, add_generation_prompt=False)
    assert fmt.tok.decode(fmt.prompt_ids(CHAT[:1])) == "<s>[INST] 1+2= [/INST]"


def test_gemma_style_template_and_its_refusal_of_a_system_turn():
    fmt = _fmt(
        SPECIALS["gemma"],
        GEMMA,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        additional_special_tokens=SPECIALS["gemma"][3:],
    )
    ids, mask = fmt.encode_messages(CHAT)
    assert _learned(fmt, ids, mask) == ["3<end_of_turn>", "4<end_of_turn>"]
    with pytest.raises(
        DataError,
        match=r"refused a conversation with roles \['system', 'user', 'assistant'\]: "
        r"TemplateError: System role not supported\. .*fold a system message",
    ):
        fmt.encode_messages([{"role": "system", "content": "be brief"}] + CHAT[:2])


def test_a_template_that_rewrites_earlier_turns_is_refused_with_the_fix():
    fmt = _fmt(
        SPECIALS["phi3"],
        REWRITES,
        bos_token="<s>",
        eos_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS["phi3"][3:],
    )
    plain = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    assert _learned(fmt, *fmt.encode_messages(plain)) == ["3<|end|>"]  # one turn: nothing rewritten
    thinking = [
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "<think>one and two</think>3"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
    ]
    with pytest.raises(
        DataError, match="renders assistant turn 1 differently once later turns follow.*prompt/completion"
    ):
        fmt.encode_messages(thinking)
