"""The chat format, in one place: how a prompt, a conversation or a completion becomes token ids
for *any* Hugging Face tokenizer, which tokens end a turn, and raypai's own format (the default
for tokenizers raypai trains). Data, train, alignment and serving all import this module.

    fmt = ChatFormat.from_pretrained("my_model/")
    ids = fmt.prompt_ids([{"role": "user", "content": "2+3="}])   # template + assistant header
    ids, mask = fmt.encode("2+3=", "5")                              # completion format: prompt + completion + EOS
    fmt.stop_ids                                                      # EOS, generation_config EOS, end-of-turn tokens

Conventions follow TRL's dataset formats: a prompt that is a *string* is "standard" (no template,
the completion ends with EOS); a prompt that is a *list of messages* is "conversational" (the
tokenizer's chat template renders it; the assistant turn ends with the template's end-of-turn
token). A conversational example on a tokenizer without a chat template is an error.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from raypai.errors import ConfigError, DataError

log = logging.getLogger(__name__)

# ---- raypai's own format (tokenizers trained by raypai.data.tokenizer) -------------------------
EOS = "<|endoftext|>"
PAD = "<|pad|>"
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = [EOS, PAD, "<|user|>", "<|assistant|>", END_OF_TURN]
# A turn: "<|user|>\n{content}<|end|>\n<|assistant|>\n{content}<|end|>\n"; a system turn is "<|system|>"-less
# plain text followed by a newline (the tiny demo models never see one).
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>\n{{ m['content'] }}<|end|>\n"
    "{% elif m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}<|end|>\n"
    "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# End-of-turn tokens of widely used templates (ChatML, Llama 3, Phi-3 and raypai: END_OF_TURN, Gemma, Llama 4,
# Mistral).
# One is a stop token when the tokenizer knows it as a single token AND its chat template writes it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", END_OF_TURN, "<end_of_turn>", "<|eot|>", "</s>", "<|endoftext|>")

# Files of an HF folder that describe the tokenizer and generation (copied with exported weights).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def is_conversational(x) -> bool:
    """A list of {role, content} messages (TRL's conversational format)."""
    return isinstance(x, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in x) and bool(x)


def text_of(x) -> str:
    """The text of a completion in either format (a string, or the assistant messages' contents)."""
    if isinstance(x, str):
        return x
    return "".join(str(m.get("content", "")) for m in x)


_pad_warned: set[str] = set()


def ensure_pad_token(tokenizer) -> None:
    """A tokenizer without a pad token pads with EOS (attention masks hide it); said once per tokenizer."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ConfigError(
                [
                    f"tokenizer {tokenizer.name_or_path!r} has neither a pad nor an EOS token: add one "
                    "(tokenizer.add_special_tokens({'pad_token': ...})) and save it with the model"
                ],
                what="tokenizer",
            )
        tokenizer.pad_token = tokenizer.eos_token
        if tokenizer.name_or_path not in _pad_warned:
            _pad_warned.add(tokenizer.name_or_path)
            log.warning(
                "tokenizer %s has no pad token; padding with EOS %r", tokenizer.name_or_path, tokenizer.eos_token
            )


@dataclass
class Truncation:
    """What happens to an example longer than the context: 'refuse' (DataError naming it) or
    'truncate' (the completion is cut; counted in `truncated`)."""

    max_length: int
    policy: str = "refuse"
    truncated: int = 0

    def __post_init__(self):
        if self.policy not in ("refuse", "truncate"):
            raise ConfigError([f"truncation must be 'refuse' or 'truncate' (got {self.policy!r})"], what="chat format")


class ChatFormat:
    """Encoding rules for one tokenizer (+ its generation config)."""

    def __init__(self, tokenizer, generation_config=None):
        ensure_pad_token(tokenizer)
        self.tok = tokenizer
        self.conversational = bool(getattr(tokenizer, "chat_template", None))
        self.stop_ids = tuple(self._stop_ids(generation_config))
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else self.stop_ids[0]

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, tokenizer=None) -> "ChatFormat":
        from transformers import AutoTokenizer, GenerationConfig

        tok = tokenizer or AutoTokenizer.from_pretrained(str(model_dir))
        gen = None
        if (Path(model_dir) / "generation_config.json").exists():
            gen = GenerationConfig.from_pretrained(str(model_dir))
        return cls(tok, gen)

    def _stop_ids(self, generation_config) -> list[int]:
        ids: list[int] = []
        if self.tok.eos_token_id is not None:
            ids.append(self.tok.eos_token_id)
        gen_eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
        ids += list(gen_eos) if isinstance(gen_eos, (list, tuple)) else ([gen_eos] if gen_eos is not None else [])
        template = (
            self.tok.chat_template
            if isinstance(self.tok.chat_template, str)
            else json.dumps(self.tok.chat_template or "")
        )
        vocab = self.tok.get_vocab()
        ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and t in template]
        if not ids:
            raise ConfigError(
                [
                    f"tokenizer {self.tok.name_or_path!r} has no EOS token, no generation_config "
                    "eos_token_id and no known end-of-turn token: set tokenizer.eos_token"
                ],
                what="tokenizer",
            )
        return list(dict.fromkeys(int(i) for i in ids))

    # ---- prompts ---------------------------------------------------------------------------
    def _check_conversational(self, x, what: str) -> None:
        if not self.conversational:
            raise DataError(
                f"{what} is conversational (a list of messages) but tokenizer {self.tok.name_or_path!r} "
                "has no chat template: give plain-text prompts/completions (standard format), or use a "
                "model whose tokenizer has a chat template"
            )

    def render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        self._check_conversational(messages, "a conversation")
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja2's TemplateError, raise_exception(...) in the template, a KeyError
            roles = [m.get("role") for m in messages] if all(isinstance(m, dict) for m in messages) else messages
            raise DataError(
                f"the chat template of {self.tok.name_or_path!r} refused a conversation with roles "
                f"{roles}: {type(exc).__name__}: {exc}. Reshape the data to what the template accepts "
                "(e.g. fold a system message into the first user turn where the template has no system "
                "role; alternate user/assistant turns where it requires that)"
            ) from None

    def prompt_text(self, prompt) -> str:
        """The text the model continues: a string as is, messages through the template + assistant header."""
        if isinstance(prompt, str):
            return prompt
        return self.render(list(prompt), add_generation_prompt=True)

    def _ids(self, text: str, *, first: bool) -> list[int]:
        if not first:
            return self.tok(text, add_special_tokens=False)["input_ids"]
        ids = self.tok(text, add_special_tokens=True)["input_ids"]  # a BOS where the tokenizer adds one
        if ids and ids[-1] == self.tok.eos_token_id and not text.endswith(self.tok.eos_token or "\0"):
            ids = ids[:-1]  # tokenizers that also append EOS: not at the end of a prompt
        return ids

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self._ids(prompt, first=True)
            # an empty prompt starts from the document boundary, as GPT-2-style models were trained
            return ids or [self.tok.bos_token_id if self.tok.bos_token_id is not None else self.eos_id]
        return self._ids(self.prompt_text(prompt), first=False)  # templates write their own BOS

    # ---- training examples -----------------------------------------------------------------
    def encode(self, prompt, completion) -> tuple[list[int], list[int]]:
        """Token ids of prompt + completion and a 0/1 mask over them (1 = completion token, learned).
        Standard format: the completion ends with EOS. Conversational: the template's assistant turn
        (its end-of-turn token included; anything the template writes after it is not learned)."""
        if isinstance(prompt, str) and isinstance(completion, str):
            p = self.prompt_ids(prompt)
            c = self._ids(completion, first=False) + [self.eos_id]
            return p + c, [0] * len(p) + [1] * len(c)
        if isinstance(prompt, str) or isinstance(completion, str):
            raise DataError(
                "prompt and completion must both be strings (standard format) or both lists of messages "
                f"(conversational); got {type(prompt).__name__} and {type(completion).__name__}"
            )
        return self.encode_messages(list(prompt) + list(completion), learn_from=len(prompt))

    def encode_messages(self, messages: list[dict], learn_from: int = 0) -> tuple[list[int], list[int]]:
        """A multi-turn conversation: every assistant turn at index ≥ learn_from is learned, the rest
        (system, user, tool turns, headers) is context. The conversation is rendered once; each learned
        turn is the span of that text between where the template's rendering up to the turn (with the
        assistant header) leaves off and where its rendering ending with that turn stops agreeing with
        the whole. So any template works, including ones that write something only at the very end
        of a conversation (Phi-3's EOS) or ignore add_generation_prompt (Mistral's)."""
        self._check_conversational(messages, "a conversation")
        full = self.render(messages, add_generation_prompt=False)
        spans: list[tuple[int, int]] = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant" or i < learn_from:
                continue
            start = _agreeing(self.render(messages[:i], add_generation_prompt=True), full) if i else 0
            end = _agreeing(self.render(messages[: i + 1], add_generation_prompt=False), full)
            content = text_of(m.get("content")).strip()
            if end <= start or (content and content not in full[start:end]) or (spans and start < spans[-1][1]):
                raise DataError(
                    f"the chat template of {self.tok.name_or_path!r} renders assistant turn {i} "
                    "differently once later turns follow (it rewrites earlier turns), so the turn "
                    "cannot be located in the conversation; use the prompt/completion format, with the "
                    "turn to learn as the completion"
                )
            spans.append((start, end))
        if not spans:
            raise DataError(
                "the conversation has no assistant turn to learn from; SFT data needs at least one "
                "{'role': 'assistant', ...} message"
            )
        ids: list[int] = []
        mask: list[int] = []
        pos = 0
        for start, end in spans:
            self._append(ids, mask, full[pos:start], learn=False)
            self._append(ids, mask, full[start:end], learn=True)
            pos = end
        self._append(ids, mask, full[pos:], learn=False)
        return ids, mask

    def _append(self, ids: list[int], mask: list[int], piece: str, *, learn: bool) -> None:
        if not piece:
            return
        new = self._ids(piece, first=False)  # templates write their own BOS
        m = [int(learn)] * len(new)
        if learn:  # learn up to and including the last stop token; template text after it is context
            last = max((j for j, t in enumerate(new) if t in self.stop_ids), default=None)
            if last is not None:
                m = [1] * (last + 1) + [0] * (len(new) - last - 1)
        ids += new
        mask += m

    def fit(self, ids: list[int], mask: list[int], trunc: Truncation | None, where: str) -> tuple[list[int], list[int]]:
        """Apply the context-length policy to one encoded example."""
        if trunc is None or len(ids) <= trunc.max_length:
            return ids, mask
        if trunc.policy == "refuse":
            raise DataError(
                f"{where} is {len(ids)} tokens, longer than the context of {trunc.max_length}: shorten it, "
                "drop it, or pass truncation='truncate' to cut completions to fit"
            )
        trunc.truncated += 1
        return ids[: trunc.max_length], mask[: trunc.max_length]


def _agreeing(a: str, b: str) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def context_length(model_config) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(model_config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return 2048


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer and generation files of HF folder `src` into `dst` (never the weights)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (name == "generation_config.json" and (dst / name).exists()):
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def write_generation_stops(model_dir: str | Path, stop_ids) -> None:
    """Make plain `transformers` generation stop where raypai's does: every stop id in generation_config."""
    from transformers import GenerationConfig

    path = Path(model_dir)
    gen = (
        GenerationConfig.from_pretrained(str(path))
        if (path / "generation_config.json").exists()
        else GenerationConfig()
    )
    gen.eos_token_id = list(stop_ids)
    gen.save_pretrained(str(path))
