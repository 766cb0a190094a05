"""Streaming detokenization never emits a broken UTF-8 sequence, and adds up to the full decode."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tokenizer import IncrementalDetokenizer, Tokenizer

MULTIBYTE = "🤖 robots 日本語 and 👩‍👩‍👧 families, ñ é ß"


def stream(tokenizer: Tokenizer, ids: list[int], prompt_ids: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids or [])
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def test_characters_split_across_tokens_are_held_back(default_tokenizer: Tokenizer) -> None:
    ids = default_tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    # The premise: some single tokens are only part of a character.
    assert any("\ufffd" in default_tokenizer.decode([i]) for i in ids)
    deltas = stream(default_tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE


def test_partial_character_emits_nothing_until_complete(default_tokenizer: Tokenizer) -> None:
    ids = default_tokenizer.encode("🤖", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(default_tokenizer)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🤖"


def test_truncated_stream_flushes_what_is_left(default_tokenizer: Tokenizer) -> None:
    ids = default_tokenizer.encode("ok 🤖", add_special_tokens=False)
    detok = IncrementalDetokenizer(default_tokenizer)
    emitted = "".join(detok.push(i) for i in ids[:-1])
    assert emitted == "ok"
    assert emitted + detok.flush() == default_tokenizer.decode(ids[:-1])


def test_prompt_context_does_not_leak_into_output(default_tokenizer: Tokenizer) -> None:
    prompt = default_tokenizer.encode("The capital of France is", add_special_tokens=False)
    answer = default_tokenizer.encode(" Paris. 🇫🇷", add_special_tokens=False)
    assert "".join(stream(default_tokenizer, answer, prompt)) == " Paris. 🇫🇷"


def test_special_tokens_are_skipped(default_tokenizer: Tokenizer) -> None:
    ids = default_tokenizer.encode("Paris<|im_end|>", add_special_tokens=False)
    assert "".join(stream(default_tokenizer, ids)) == "Paris"


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_stream_equals_full_decode(default_tokenizer: Tokenizer, text: str) -> None:
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(default_tokenizer, ids)
    full = default_tokenizer.decode(ids)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in d for d in deltas)
