"""Tokenization (the `tokenizers` library), chat templates and UTF-8-safe streaming detokenization.

A `Tokenizer` comes from a Hugging Face directory (`tokenizer.json`, `tokenizer_config.json`)
or from a GGUF file's metadata: GPT-2-style byte-level BPE (``tokenizer.ggml.model`` "gpt2": tokens,
merges, token types) or SentencePiece BPE with byte fallback ("llama": tokens, scores, token types;
Llama 2, Mistral, Phi-3, Gemma 3), rebuilt as a `tokenizers` BPE whose merges follow the scores.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from engine.chat_template import render_chat

_log = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type; 5 is unused, 6 a byte).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_GGUF_TOKENIZERS = "'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)"
SPACE = "\u2581"
"""SentencePiece's spelling of a space inside its tokens."""

_GPT4O_SPLIT = (  # Phi-4-mini's, o200k's (llama.cpp's "gpt-4o" pre-tokenizer)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GGUF `tokenizer.ggml.pre` -> the split regex its merges were learned with (None: GPT-2's own).
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
}
# Pre-tokenizers that split every digit on its own before GPT-2's regex (llama.cpp's "smollm").
_DIGIT_SPLITTING = {"smollm"}
# Pre-tokenizers whose merges were learned on GPT-2's own split. Any other name is warned about and split
# so too: llama.cpp refuses such a file; its text may still tokenize well enough to serve.
_GPT2_SPLITTING = {"default", "gpt-2", "gpt2", "phi-2"}

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(
        self,
        backend: Backend,
        *,
        special_tokens: Mapping[str, str | None],
        chat_template: str | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.special_tokens = {name: special_tokens.get(name) for name in _SPECIAL_TOKEN_NAMES}
        self.chat_template = chat_template
        eos_ids = list(eos_token_ids)
        if self.eos_token_id is not None and self.eos_token_id not in eos_ids:
            eos_ids.append(self.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)
        """Ids that end generation: the model config's (generation_config.json / GGUF) and eos_token."""

    # -- construction -----------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """`tokenizer.json`, plus special tokens and chat template from `tokenizer_config.json`."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.exists():
            raise FileNotFoundError(
                f"{path} has no tokenizer.json (a sentencepiece-only tokenizer.model is not supported)"
            )
        backend = Backend.from_file(str(tokenizer_file))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        special = {name: _token_content(config.get(name)) for name in _SPECIAL_TOKEN_NAMES}
        return cls(
            backend,
            special_tokens=special,
            chat_template=_hf_chat_template(path, config),
            eos_token_ids=eos_token_ids,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Rebuild the tokenizer described by `tokenizer.ggml.*`: byte-level BPE or SentencePiece BPE."""
        kind = metadata.get("tokenizer.ggml.model")
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if kind == "gpt2":
            backend = _byte_level_bpe(
                tokens, metadata.get("tokenizer.ggml.merges", []), metadata.get("tokenizer.ggml.pre")
            )
        elif kind == "llama":
            backend = _sentencepiece_bpe(
                tokens,
                metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens),
                token_types,
                # llama.cpp's default for a SentencePiece vocabulary; Gemma's files say False
                add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
            )
        else:
            raise ValueError(f"GGUF tokenizer {kind!r} is not supported; supported: {_GGUF_TOKENIZERS}")
        _add_gguf_added_tokens(backend, tokens, token_types)

        def token(key: str) -> str | None:
            index = metadata.get(f"tokenizer.ggml.{key}")
            return tokens[index] if index is not None and index < len(tokens) else None

        special = {
            "bos_token": token("bos_token_id"),
            "eos_token": token("eos_token_id"),
            "unk_token": token("unknown_token_id"),
            "pad_token": token("padding_token_id"),
        }
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
        _add_bos_eos(
            backend,
            special["bos_token"] if add_bos else None,
            special["eos_token"] if metadata.get("tokenizer.ggml.add_eos_token") else None,
        )
        return cls(
            backend,
            special_tokens=special,
            chat_template=metadata.get("tokenizer.chat_template"),
            eos_token_ids=eos_token_ids,
        )

    # -- special tokens ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of("pad_token")

    def _id_of(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    # -- text <-> ids -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation (`[{"role": ..., "content": ...}, ...]`)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use a plain completion prompt instead")
        return render_chat(
            self.chat_template,
            messages,
            special_tokens=self.special_tokens,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **kwargs,
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered conversation (the template writes its own special tokens)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never end inside a UTF-8 character.

    Each push decodes a short window of recent tokens; while the window's text ends in U+FFFD
    (bytes of a character still to come) nothing is emitted. Usage::

        detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
        for token_id in generated:
            send(detok.push(token_id))
        send(detok.flush())   # at the end; whatever is left, even if incomplete

    The concatenation of all deltas equals `tokenizer.decode(generated)`.
    """

    # Prompt tokens kept as left context, so tokenizers that drop a leading space decode correctly.
    _CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self._CONTEXT_TOKENS :])
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = len(self._ids)  # tokens before this have been emitted
        self.text = ""
        """All text emitted so far."""

    def push(self, token_id: int) -> str:
        """Add one generated token; return the new text that is now complete ("" if none)."""
        self._ids.append(token_id)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit any held-back text at the end of the stream."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)


def _add_gguf_added_tokens(backend: Backend, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens (and SentencePiece's unknown token) as special tokens; user-defined ones as
    plain added tokens. llama.cpp matches both whole in the raw text before the model's own split."""
    special = {_CONTROL, _UNKNOWN}
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, token_types, strict=True)
            if k in special
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, token_types, strict=True)
            if k == _USER_DEFINED
        ]
    )


def _add_bos_eos(backend: Backend, bos: str | None, eos: str | None) -> None:
    """Encoding with special tokens puts ``bos`` before the text and ``eos`` after it (None: not)."""
    before, after = [t for t in (bos,) if t is not None], [t for t in (eos,) if t is not None]
    if before or after:
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join([*before, "$A", *after]),
            pair=" ".join([*before, "$A", *after, *before, "$B", *after]),
            special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(before + after)],
        )


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], token_types: list[int], *, add_space_prefix: bool
) -> Backend:
    """llama.cpp's SentencePiece tokenizer (``llm_tokenizer_spm``) as a `tokenizers` BPE.

    llama.cpp turns spaces into U+2581, puts one before the text (and after each special token)
    when ``add_space_prefix`` says so, then merges, among all adjacent pairs whose concatenation is a
    token, the one of the highest score, until none is left; a character no token holds becomes its
    UTF-8 bytes' ``<0xXX>`` tokens. A BPE whose merges are every split of each normal token, ranked
    by that token's score, merges in the same order (byte fallback does the rest). Decoding turns
    U+2581 back into spaces, ``<0xXX>`` tokens into their bytes, and drops the prefix space.
    """
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    ranked: list[tuple[float, int, str, str]] = []
    for index, (token, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if kind != _NORMAL or vocab[token] != index:
            continue  # control, user-defined, byte and unused tokens are never formed by merging
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], index, left, right))
    ranked.sort()
    unknown = next((t for t, k in zip(tokens, token_types, strict=True) if k == _UNKNOWN), None)
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for _, _, left, right in ranked],
            unk_token=unknown,
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    spaces = normalizers.Replace(" ", SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if add_space_prefix else spaces
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> Backend:
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    byte_chars = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:  # a token stored as raw text: respell it in the byte alphabet
            token = "".join(byte_chars[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [cast(tuple[str, str], tuple(merge.split(" ", 1))) for merge in merges]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGIT_SPLITTING:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        if pre not in _GPT2_SPLITTING:
            _log.warning("GGUF pre-tokenizer %r is unknown: split with GPT-2's regex, tokens may differ", pre)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _token_content(value: str | Mapping[str, Any] | None) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """The default template: `chat_template.jinja`, else tokenizer_config.json's (string or named list)."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default", next(iter(named.values()), None))
    return template
