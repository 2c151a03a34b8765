"""Text to token ids and back for the language models, the model's chat template, and
detokenization piece by piece for streaming.

The work is done by a HF `tokenizers.Tokenizer`, read from a `tokenizer.json` or built from
a GGUF file's metadata. A GGUF holds no `tokenizer.json`: it stores the vocabulary, merges,
token types and special token ids under llama.cpp's key names, and names the text-splitting
rule the merges were learned with (`tokenizer.ggml.pre`). We rebuild the tokenizer llama.cpp
runs from those, so a prompt gets the ids the model was trained on.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import gguf
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from ..errors import LLMError, WeightsError, summary

# Texts of the tokens that end a turn or a document in the common chat formats. One that is a
# special token of the vocabulary stops generation like EOS does (llama.cpp's end-of-generation
# list: an instruct model's EOS is often its end of turn, and it can still end the document).
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
               "<|end|>", "<end_of_turn>", "<EOT>")

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# The text-splitting regexes of llama.cpp's byte-level BPE pre-tokenizers (llm_tokenizer_bpe in
# src/llama-vocab.cpp). Each regex splits every piece the previous one left, keeping both the
# matches and the text between them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2)

# `tokenizer.ggml.pre` -> (its regexes, whether a piece that is itself a token skips the merges,
# whether BOS is added when the file does not say), as llama.cpp maps the names it knows.
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": (_DEFAULT, False, False),
    **{name: ((_GPT2,), False, False) for name in ("gpt-2", "phi-2", "mpt", "olmo")},
    **{name: (_DIGITS_THEN_GPT2, False, False)
       for name in ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b")},
    **{name: ((_QWEN2,), False, False) for name in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2")},
    **{name: ((_LLAMA3,), True, True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3")},
    **{name: ((_LLAMA3,), False, False) for name in ("dbrx", "smaug-bpe")},
}


class Tokenizer:
    """A model's tokenizer: `encode`/`decode`, its special tokens and its chat template.

    Build one with `from_file` (a `tokenizer.json`) or `from_gguf` (a GGUF file's metadata).
    `eos_token_ids` are all the ids that end generation: EOS, and the end-of-turn and
    end-of-text tokens the vocabulary marks special.
    """

    def __init__(self, backend: Backend, *, bos_token: str | None, eos_token: str | None,
                 chat_template: str | None, extra_eos_ids: Sequence[int] = ()):
        self._backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        eos_ids = {backend.token_to_id(eos_token)} if eos_token else set()
        special = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
        eos_ids |= {backend.token_to_id(text) for text in _END_TOKENS if text in special}
        self.eos_token_ids = frozenset(eos_ids - {None}) | frozenset(extra_eos_ids)
        self._template: jinja2.Template | None = None

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        """The tokenizer of an HF `tokenizer.json` (or of the folder holding one). BOS, EOS and
        the chat template come from `tokenizer_config.json` beside it, the template from
        `chat_template.jinja` where transformers saved it there instead."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            backend = Backend.from_file(str(path))
            config_path = path.with_name("tokenizer_config.json")
            config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        except Exception as err:  # tokenizers raises a bare Exception for a malformed file
            raise WeightsError(f"{path}: not a readable tokenizer: {summary(err)}") from err
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = path.with_name("chat_template.jinja")
        if template is None and jinja_path.exists():
            template = jinja_path.read_text(encoding="utf-8")
        return cls(backend, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")), chat_template=template)

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike | gguf.GGUFReader) -> Tokenizer:
        """The tokenizer a GGUF file describes, as llama.cpp builds it. Supports byte-level BPE
        (`tokenizer.ggml.model` "gpt2": GPT-2, Llama 3, Qwen2, SmolLM and many more); pass an
        open `GGUFReader` to avoid parsing the file twice."""
        if isinstance(path_or_reader, gguf.GGUFReader):
            reader = path_or_reader
        else:
            try:
                reader = gguf.GGUFReader(path_or_reader)
            except (OSError, ValueError) as err:
                raise WeightsError(f"{path_or_reader}: not a readable GGUF file: {summary(err)}") from err
        name = str(reader.data.filename)

        def meta(key: str, default: Any = None) -> Any:
            field = reader.fields.get(key)
            return default if field is None else field.contents()

        model = meta("tokenizer.ggml.model")
        if model != "gpt2":
            raise WeightsError(f"{name}: tokenizer model {model!r} is not supported; supported: "
                               "'gpt2' (byte-level BPE)")
        pre = meta("tokenizer.ggml.pre", "default")
        if pre not in _PRE_TOKENIZERS:
            raise WeightsError(f"{name}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                               f"supported: {', '.join(sorted(_PRE_TOKENIZERS))}")
        splits, ignore_merges, add_bos_default = _PRE_TOKENIZERS[pre]

        tokens = meta("tokenizer.ggml.tokens")
        if not tokens:
            raise WeightsError(f"{name}: has no vocabulary (tokenizer.ggml.tokens)")
        merges = [tuple(merge.split(" ", 1)) for merge in meta("tokenizer.ggml.merges", [])]
        backend = Backend(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges,
                                     ignore_merges=ignore_merges))
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>) are special: matched whole in any text, skipped when
        # decoding asks. User-defined ones (<think>) are matched whole but are text.
        types = meta("tokenizer.ggml.token_type", [])
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t, kind in zip(tokens, types) if kind == _CONTROL])
        backend.add_tokens([AddedToken(t, normalized=False, special=False)
                            for t, kind in zip(tokens, types) if kind == _USER_DEFINED])

        def special(role: str) -> str | None:
            token_id = meta(f"tokenizer.ggml.{role}_token_id")
            return None if token_id is None else tokens[token_id]

        bos, eos = special("bos"), special("eos")
        add_bos = meta("tokenizer.ggml.add_bos_token", add_bos_default)
        add_eos = meta("tokenizer.ggml.add_eos_token", False)
        if (add_bos and bos is None) or (add_eos and eos is None):
            raise WeightsError(f"{name}: asks to add a BOS or EOS token to every text but names none")
        if add_bos or add_eos:
            pieces = [bos] * add_bos + ["$A"] + [eos] * add_eos
            backend.post_processor = processors.TemplateProcessing(
                single=pieces, special_tokens=[(t, backend.token_to_id(t)) for t in set(pieces) - {"$A"}])
        extra = [i for i in (meta("tokenizer.ggml.eot_token_id"), meta("tokenizer.ggml.eom_token_id"))
                 if i is not None]
        return cls(backend, bos_token=bos, eos_token=eos, chat_template=meta("tokenizer.chat_template"),
                   extra_eos_ids=extra)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`. Special tokens written in the text (`<|im_start|>`) become
        their ids; `add_special_tokens` adds what the model puts around every text (BOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of token ids; an incomplete UTF-8 character at the end reads U+FFFD."""
        size = self.vocab_size
        bad = next((i for i in ids if not 0 <= i < size), None)
        if bad is not None:
            raise LLMError(f"token id {bad} is outside the vocabulary (0..{size - 1})")
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A decoder to feed generated ids one at a time."""
        return StreamDecoder(self, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (`[{"role": "user", "content": "Hi"}, ...]`) in
        the model's chat format, rendered as transformers does; `add_generation_prompt` ends
        it with the opening of the assistant's turn."""
        if not self.chat_template:
            raise LLMError("this model has no chat template; give it plain text instead")
        if self._template is None:
            try:
                self._template = _template_environment().from_string(self.chat_template)
            except jinja2.TemplateError as err:
                raise WeightsError(f"the model's chat template does not compile: {summary(err)}") from err
        special = {name: token for name, token in (("bos_token", self.bos_token), ("eos_token", self.eos_token))
                   if token is not None}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **special)
        except jinja2.TemplateError as err:
            raise LLMError(f"chat template: {err.message or summary(err)}") from err


class StreamDecoder:
    """Text for token ids fed one at a time, for streaming: `push` returns the new text (often
    empty), never half a character, so that `"".join(pushes) + finish()` equals `decode(ids)`.

    Each step decodes a short window (from the token before the last piece given out), not
    the whole sequence, and holds the text back while it ends in U+FFFD: a character whose
    UTF-8 bytes are spread over tokens waits for its last byte.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer, self._skip = tokenizer, skip_special_tokens
        self._ids: list[int] = []
        self._prefix = self._read = 0  # window start; end of the ids whose text was given out

    def push(self, token_id: int) -> str:
        """The text `token_id` completes, or "" while a character is unfinished."""
        self._ids.append(token_id)
        given, text = self._window()
        if len(text) <= len(given) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(given):]

    def finish(self) -> str:
        """The text still held back when generation ends (an unfinished character as U+FFFD)."""
        given, text = self._window()
        self._prefix = self._read = len(self._ids)
        return text[len(given):]

    def _window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        return (decode(self._ids[self._prefix:self._read], self._skip),
                decode(self._ids[self._prefix:], self._skip))


def _token_text(token: str | dict | None) -> str | None:
    """A special token from `tokenizer_config.json`: a string or an AddedToken's fields."""
    return token.get("content") if isinstance(token, dict) else token


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """jinja's `tojson` escapes HTML characters; chat templates expect plain JSON."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _template_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in: sandboxed (templates come with
    downloaded checkpoints), blocks trimmed, and the helpers templates call."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
