"""SentencePiece vocabularies from GGUF files (Gemma 3's and Phi-3's, as llama.cpp's converter writes
them: tests/engine/sentencepiece_vocab.py) against SentencePiece itself, the library the converter
read them from: encode, decode, special and user-defined tokens, byte fallback, streaming; then a
random-weight Gemma 3 and Phi-3 GGUF with such a vocabulary served by the engine."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.loader import load_model
from engine.loader.gguf_file import open_gguf, read_metadata
from engine.serving.frames import generate_frames
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from protocol.rpc import DeltaFrame, GenerateRequest, SamplingParams
from tests.engine.families_gguf import tiny_family_model, write_family_gguf
from tests.engine.sentencepiece_vocab import (
    add_sentencepiece_vocabulary,
    train_sentencepiece,
    vocabulary_gguf,
)
from tests.engine.test_parity_hf import hf_greedy
from tests.engine.test_tokenizer import TEXTS

pytestmark = pytest.mark.usefixtures("one_thread")

STYLES = ("gemma3", "phi3")
# Beyond test_tokenizer's: runs of spaces (Gemma's user-defined pieces), leading blanks (the prefix
# space), characters the vocabulary lacks (byte fallback, some split across tokens).
MORE_TEXTS = [
    "  two spaces,    four spaces,   three",
    " one leading space",
    "\n\nparagraph\n\n\nbreaks",
    "Alice was beginning to get very tired of sitting by her sister on the bank",
    "ünïcödé ßtraße Ωmega ∑ 日本 🤖🎉 ok",
    "\x00\x7f control bytes",
]


@pytest.fixture(scope="module", params=STYLES)
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Any, Tokenizer]:
    """(style, SentencePiece's processor, our tokenizer from the GGUF written from it)."""
    style = request.param
    sp = train_sentencepiece(style)
    path = vocabulary_gguf(sp, style, tmp_path_factory.mktemp("spm") / f"{style}-vocab.gguf")
    return style, sp, Tokenizer.from_gguf_metadata(read_metadata(open_gguf(path)))


def _random_texts(count: int) -> list[str]:
    """Slices of the training text and strings of spaces, newlines, letters and unknown characters."""
    from engine.quantize import default_calibration_text

    text = default_calibration_text()
    rng = random.Random(0)
    alphabet = [*"abcde fgh\n\tXY.,;'\"é日🤖", "  ", "    "]
    out = []
    for i in range(count):
        if i % 2:
            start = rng.randrange(len(text))
            out.append(text[start : start + rng.randrange(1, 160)])
        else:
            out.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(30))))
    return out


@pytest.mark.parametrize("text", TEXTS + MORE_TEXTS)
def test_encode_and_decode_equal_sentencepiece(pair: tuple[str, Any, Tokenizer], text: str) -> None:
    _, sp, ours = pair
    expected = sp.encode(text)
    assert ours.encode(text, add_special_tokens=False) == expected
    assert ours.decode(expected) == sp.decode(expected)


def test_many_random_texts_encode_as_sentencepiece_does(pair: tuple[str, Any, Tokenizer]) -> None:
    _, sp, ours = pair
    texts = _random_texts(400)
    assert [ours.encode(t, add_special_tokens=False) for t in texts] == [sp.encode(t) for t in texts]
    assert [ours.decode(sp.encode(t)) for t in texts] == [sp.decode(sp.encode(t)) for t in texts]


def test_byte_fallback_spells_unknown_characters_in_bytes(pair: tuple[str, Any, Tokenizer]) -> None:
    _, sp, ours = pair
    ids = ours.encode("日🤖", add_special_tokens=False)
    pieces = [sp.id_to_piece(i) for i in ids]
    assert pieces[-7:] == ["<0xE6>", "<0x97>", "<0xA5>", "<0xF0>", "<0x9F>", "<0xA4>", "<0x96>"]
    assert ours.decode(ids) == "日🤖"


def test_bos_is_added_where_the_file_says(pair: tuple[str, Any, Tokenizer]) -> None:
    """Gemma's file asks for BOS, Phi-3's says no (llama.cpp's default for the vocabulary is yes)."""
    style, sp, ours = pair
    body = sp.encode("Hello there")
    expected = [sp.bos_id(), *body] if style == "gemma3" else body
    assert ours.encode("Hello there") == expected
    assert ours.bos_token_id == sp.bos_id() and ours.decode(expected) == "Hello there"


def test_special_and_user_defined_tokens_are_matched_whole(pair: tuple[str, Any, Tokenizer]) -> None:
    """Control tokens (the chat markers) and user-defined ones (Gemma's runs of spaces, spelled with
    real spaces in the file) are matched in the text before SentencePiece sees the rest, which gets
    its prefix space after each of them (llama.cpp's ``is_prev_special``)."""
    style, sp, ours = pair
    start, end = ("<start_of_turn>", "<end_of_turn>") if style == "gemma3" else ("<|user|>", "<|end|>")
    start_id, end_id = ours.backend.token_to_id(start), ours.backend.token_to_id(end)
    ids = ours.encode(f"{start}user\nhi there{end}\n", add_special_tokens=False)
    assert ids == [start_id, *sp.encode("user\nhi there"), end_id, *sp.encode("\n")]
    assert ours.decode(ids) == sp.decode(sp.encode("user\nhi there") + sp.encode("\n"))  # no markers
    if style == "gemma3":
        assert ours.encode("a    b", add_special_tokens=False) == sp.encode("a    b")
        assert sp.id_to_piece(ours.encode("    ", add_special_tokens=False)[0]) == "\u2581" * 4


def test_streamed_text_equals_the_decoded_text(pair: tuple[str, Any, Tokenizer]) -> None:
    """Byte-fallback characters arrive whole; the prefix space is dropped once, as decode drops it."""
    _, sp, ours = pair
    prompt = sp.encode("Say:")
    for text in ("naïve 日本 🤖 café", " spaced  out", "\n\nnew lines"):
        ids = sp.encode(text)
        detok = IncrementalDetokenizer(ours, prompt_ids=prompt)
        deltas = [detok.push(i) for i in ids] + [detok.flush()]
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == sp.decode(prompt + ids)[len(sp.decode(prompt)) :]


def test_an_unsupported_vocabulary_is_refused_in_one_line(tmp_path: Path) -> None:
    sp = train_sentencepiece("phi3")
    metadata = dict(read_metadata(open_gguf(vocabulary_gguf(sp, "phi3", tmp_path / "v.gguf"))))
    metadata["tokenizer.ggml.model"] = "bert"
    with pytest.raises(
        ValueError, match=r"^GGUF tokenizer 'bert' is not supported; supported: 'gpt2'.*'llama'"
    ):
        Tokenizer.from_gguf_metadata(metadata)


@pytest.mark.parametrize("architecture", STYLES)
def test_the_engine_serves_a_gguf_with_a_sentencepiece_vocabulary(architecture: str, tmp_path: Path) -> None:
    """Gemma 3 and Phi-3 as the converter writes them from a tokenizer.model: the prompt's ids are
    SentencePiece's, the engine's greedy tokens are transformers', its streamed text SentencePiece's
    decoding of them."""
    sp = train_sentencepiece(architecture)
    vocabulary = read_metadata(open_gguf(vocabulary_gguf(sp, architecture, tmp_path / "v.gguf")))
    hf_model = tiny_family_model(architecture, vocab_size=len(vocabulary["tokenizer.ggml.tokens"]))
    path = write_family_gguf(
        hf_model,
        architecture,
        tmp_path / f"tiny-{architecture}-spm.gguf",
        vocabulary=lambda writer: add_sentencepiece_vocabulary(writer, sp, architecture),
    )
    loaded = load_model(path, progress=False)
    text = "Alice was beginning to get very tired of sitting by her sister"
    prompt = loaded.tokenizer.encode(text)
    assert prompt == ([sp.bos_id()] if architecture == "gemma3" else []) + sp.encode(text)
    engine = LLMEngine(
        EngineConfig(device="cpu", block_size=16, num_kv_blocks=32, num_threads=1),
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        model_config=loaded.config,
        model_name=loaded.name,
    )
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    frames = generate_frames(engine, [GenerateRequest(request_id="r", prompt=prompt, sampling=sampling)])["r"]
    deltas = [f for f in frames if isinstance(f, DeltaFrame)]
    tokens = [t for f in deltas for t in f.token_ids]
    assert tokens == hf_greedy(hf_model, prompt, 8)
    assert "".join(f.text for f in deltas) == sp.decode(prompt + tokens)[len(sp.decode(prompt)) :]
