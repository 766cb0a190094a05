"""Reasoning in a model's output: the ``<think>…</think>`` block hybrid reasoning models (Qwen3,
SmolLM3, DeepSeek-R1 distills) write before their answer, told apart from the answer itself.

Pure text, like ``tool_calls.py``: the engine core runs one :class:`ReasoningParser` per choice, and
the answer (``content``) is what the tool-call parser and the client see; the reasoning goes out
on its own (``reasoning_content``). Where the template shows no thinking markers there is no parser
and every token is content.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class ThinkingMode:
    """How a rendered prompt leaves the model: inside an open think block, or free to open one."""

    opened: bool
    """The template already wrote the opening marker (the model starts by thinking)."""


def template_thinks(chat_template: str | None) -> bool:
    """Whether a chat template shows thinking markers (so the model writes them)."""
    template = chat_template or ""
    return THINK_OPEN in template and THINK_CLOSE in template


def thinking_mode(chat_template: str | None, prompt: str) -> ThinkingMode | None:
    """The reasoning a rendered ``prompt`` leaves room for: None where the template has no thinking
    markers, or where it closed an empty think block itself (Qwen3's ``enable_thinking: false``,
    SmolLM3's ``/no_think``): then the model answers at once."""
    if not template_thinks(chat_template):
        return None
    tail = prompt.rstrip()
    if tail.endswith(THINK_CLOSE):
        return None
    return ThinkingMode(opened=tail.endswith(THINK_OPEN))


class _State(enum.Enum):
    START = "start"  # nothing decided: the text so far could still open a think block
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningParser:
    """Splits one choice's text into reasoning and content, as it streams.

    Text that could still be the start of a marker is held back until it is decided, so no marker
    ever reaches either side. :attr:`reasoning_tokens` counts the tokens (one :meth:`feed` each)
    spent thinking, markers included: OpenAI's ``completion_tokens_details.reasoning_tokens``."""

    def __init__(self, mode: ThinkingMode) -> None:
        self._state = _State.REASONING if mode.opened else _State.START
        self._held = ""
        self._pending = 0  # tokens fed while START was undecided
        self._trim = mode.opened  # newlines right after a marker are layout, not text
        self.reasoning_tokens = 0

    @property
    def thinking(self) -> bool:
        return self._state is _State.REASONING

    def feed(self, text: str) -> tuple[str, str]:
        """One token's text in; (reasoning, content) that is now certain out."""
        was_thinking = self._state is _State.REASONING
        if self._state is _State.START:
            self._pending += 1
        reasoning, content = self._split(self._held + text)
        if self._state is not _State.START and self._pending:
            if self._state is _State.REASONING or reasoning:
                self.reasoning_tokens += self._pending
            self._pending = 0
        elif was_thinking:
            self.reasoning_tokens += 1
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The choice ended: what is still held (a partial marker is text after all)."""
        held, self._held = self._held, ""
        if self._state is _State.REASONING:
            return held, ""
        return "", held

    def _split(self, text: str) -> tuple[str, str]:
        self._held = ""
        if self._state is _State.START:
            stripped = text.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._state, self._trim = _State.REASONING, True
                text = stripped[len(THINK_OPEN) :]
            elif THINK_OPEN.startswith(stripped):
                self._held = text  # whitespace or a partial marker: not decided yet
                return "", ""
            else:
                self._state = _State.CONTENT
                return "", text
        if self._state is _State.CONTENT:
            return "", self._content(text)
        return self._reasoning(text)

    def _reasoning(self, text: str) -> tuple[str, str]:
        if self._trim:
            text = text.lstrip("\n")
            self._trim = bool(not text)
        end = text.find(THINK_CLOSE)
        if end >= 0:
            self._state, self._trim = _State.CONTENT, True
            return text[:end].rstrip("\n"), self._content(text[end + len(THINK_CLOSE) :])
        # Held back: what may be the marker's start, and the newlines before it (layout, if it comes).
        keep = partial_suffix(text, THINK_CLOSE)
        sure = text[: len(text) - keep].rstrip("\n")
        self._held = text[len(sure) :]
        return sure, ""

    def _content(self, text: str) -> str:
        if self._trim:  # the blank line between the think block and the answer
            text = text.lstrip()
            self._trim = not text
        return text


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


THINKING_BUDGET_CHARS = 2048
"""Most characters of thinking before a constrained answer: then the grammar closes the think block.
Without a bound the grammar would wait on a model that never writes the closing marker; the bound
is in characters because that is what a regular expression can count (llguidance compiles 2,048 in
about 0.4 s, once per grammar; 8,192 exhausts its budget)."""


def after_thinking(lark: str, mode: ThinkingMode, budget_chars: int = THINKING_BUDGET_CHARS) -> str:
    """A Lark grammar (``start: ...``) behind a think block: the thinking is free text up to the first
    closing marker (or ``budget_chars``), the answer is held to ``lark``. The think block is forced
    only where the template left the model room to think, as a reasoning model then always does."""
    body = lark.replace("start:", "answer:", 1)
    opening = "" if mode.opened else f'"{THINK_OPEN}" '
    close = THINK_CLOSE.replace("/", "\\/")
    # One lexeme, marker included, that ends at the first marker: a free-text lexeme followed by the
    # marker as a literal would swallow the marker's first bytes (llguidance does not backtrack).
    thought = f"/(?s:.{{0,{budget_chars}}}){close}/ & ~/(?s:.*){close}(?s:.+)/"
    return f"start: {opening}THOUGHT /[ \\t\\n]*/ answer\nTHOUGHT: {thought}\n{body}"
