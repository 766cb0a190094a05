"""Token counts for usage an ``openai`` engine did not report (the row is then marked estimated).

With a ``tokenizer.json`` for the model (``TERN_ENGINE_TOKENIZERS``) the text is counted with the
``tokenizers`` package (installed with the engine extra; imported only when a count is needed, so
a gateway without it still starts). Without one, :func:`estimate_tokens` says ~4 UTF-8 bytes per
token, the usual rate of English text under BPE vocabularies. Only message contents are counted,
never a chat template's own tokens: an estimate errs towards billing less than was served, never
more. This runs only in a request's cleanup, never per chunk.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Protocol

from protocol.openai.requests import ChatCompletionRequest, OpenAIRequest

log = logging.getLogger(__name__)

BYTES_PER_TOKEN = 4


class _Encoding(Protocol):
    @property
    def ids(self) -> list[int]: ...


class _Tokenizer(Protocol):
    def encode(
        self, sequence: Any, pair: Any = ..., is_pretokenized: bool = ..., add_special_tokens: bool = ...
    ) -> _Encoding: ...


def estimate_tokens(text: str) -> int:
    """Tokens in ``text`` at :data:`BYTES_PER_TOKEN` bytes each, rounded up."""
    return math.ceil(len(text.encode()) / BYTES_PER_TOKEN)


class TokenCounter:
    """Counts tokens with each model's tokenizer where one is configured, else estimates."""

    def __init__(self, tokenizer_paths: Mapping[str, str] | None = None) -> None:
        self._paths = dict(tokenizer_paths or {})
        self._loaded: dict[str, _Tokenizer | None] = {}

    def has_tokenizer(self, model: str) -> bool:
        return self._tokenizer(model) is not None

    def count(self, model: str, text: str) -> int:
        if not text:
            return 0
        tokenizer = self._tokenizer(model)
        if tokenizer is None:
            return estimate_tokens(text)
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    def _tokenizer(self, model: str) -> _Tokenizer | None:
        if model not in self._loaded:
            self._loaded[model] = self._load(model)
        return self._loaded[model]

    def _load(self, model: str) -> _Tokenizer | None:
        path = self._paths.get(model)
        if path is None:
            return None
        try:
            from tokenizers import Tokenizer

            tokenizer: _Tokenizer = Tokenizer.from_file(path)
        except Exception as exc:  # no tokenizers package, or a bad file: estimate, and say so once
            log.warning("tokenizer for %s unavailable (%s); estimating its token counts", model, exc)
            return None
        return tokenizer


def prompt_text(body: Mapping[str, Any]) -> tuple[str, int]:
    """What a request's prompt says: its text, and a count of prompt token ids given as ids."""
    prompt = body.get("prompt")
    if prompt is not None:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a list of one prompt
        if isinstance(prompt, list):
            return "", len(prompt)
        return str(prompt), 0
    parts: list[str] = []
    for message in body.get("messages") or ():
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "\n".join(parts), 0


def prompt_upper_bound(request: OpenAIRequest, overhead: int) -> int:
    """At most how many tokens an ``openai`` upstream prefills for ``request``: what admission reserves
    for engines that cannot check a reservation themselves.

    A byte-level BPE token (GPT-2, Llama 3, Qwen, SmolLM: the usual) covers at least one UTF-8 byte
    of the text it encodes, and a chat template writes each message's fields and the tool
    definitions as text (JSON for tools and calls, no more compact than pydantic's). So the tokens
    are at most the bytes of the messages and tools as JSON (keys, quotes and braces cover each
    message's role markers) plus ``overhead``: the template's tokens around one empty user message
    (its default system prompt included), measured once per model. Token-id prompts count exactly."""
    if isinstance(request, ChatCompletionRequest):
        # pydantic's own JSON: UTF-8 as is (no escapes), and any int (a schema's, say) serializes.
        size = sum(len(m.model_dump_json(exclude_none=True)) for m in request.messages)
        size += sum(len(t.model_dump_json(exclude_none=True)) for t in request.tools or ())
        return size + overhead
    prompt = request.prompt
    if isinstance(prompt, str):
        return len(prompt.encode()) + overhead
    if prompt and isinstance(prompt[0], int):
        return len(prompt)
    return sum(len(p) if isinstance(p, list) else len(str(p).encode()) + overhead for p in prompt)
