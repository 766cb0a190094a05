"""Tiny SentencePiece BPE vocabularies, trained at test time (offline, in well under a second), written
into a GGUF the way llama.cpp's converter writes a ``tokenizer.model``
(``TextModel._create_vocab_sentencepiece``, ``Phi3MiniModel.set_vocab``, ``Gemma3Model.set_vocab``):

- ``tokenizer.ggml.model`` "llama", ``pre`` "default", each piece's text, score and type (NORMAL,
  UNKNOWN, CONTROL, UNUSED, BYTE from the model's own flags);
- then the added tokens of ``tokenizer_config.json``: CONTROL where they are special, else
  USER_DEFINED with U+2581 spelled as a space (the base converter's "pre-normalize user-defined
  spaces"; Phi-3's own writer keeps it), score -1000, appended past the model's pieces if new;
- bos / eos / unk / pad ids and ``add_bos_token`` (``SpecialVocab``); Gemma 3 ``add_space_prefix``
  False (its model adds no dummy prefix).

Two styles: "gemma3" (no dummy prefix; ``<start_of_turn>``/``<end_of_turn>`` and runs of spaces as
user-defined pieces, the first two special) and "phi3" (Llama 2's: a dummy prefix, ``<unk> <s> </s>``,
chat tokens appended as added tokens, no BOS added).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import gguf

SPACE = "\u2581"
# gguf-py's SentencePieceTokenTypes
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class Style:
    trainer: dict[str, Any]
    added: tuple[tuple[str, bool], ...]
    """tokenizer_config.json's added tokens: (content, special)."""
    add_bos: bool
    space_prefix_key: bool
    """Whether the converter writes ``add_space_prefix`` False (Gemma 3's)."""
    respell_spaces: bool


STYLES = {
    "gemma3": Style(
        trainer=dict(
            add_dummy_prefix=False,
            pad_id=0,
            eos_id=1,
            bos_id=2,
            unk_id=3,
            pad_piece="<pad>",
            eos_piece="<eos>",
            bos_piece="<bos>",
            user_defined_symbols=["<start_of_turn>", "<end_of_turn>", SPACE * 2, SPACE * 4, "\n\n"],
        ),
        added=(
            ("<start_of_turn>", True),
            ("<end_of_turn>", True),
            (SPACE * 2, False),
            (SPACE * 4, False),
            ("\n\n", False),
        ),
        add_bos=True,
        space_prefix_key=True,
        respell_spaces=True,
    ),
    "phi3": Style(
        trainer=dict(add_dummy_prefix=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1),
        added=(("<|endoftext|>", True), ("<|user|>", True), ("<|assistant|>", True), ("<|end|>", True)),
        add_bos=False,
        space_prefix_key=False,
        respell_spaces=False,
    ),
}


def train_sentencepiece(style: str, vocab_size: int = 512) -> Any:
    """A SentencePiece BPE model with byte fallback, trained on the engine's calibration text."""
    import sentencepiece

    text = resources.files("engine").joinpath("data", "calibration.txt").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip()]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
        **STYLES[style].trainer,
    )
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


def gguf_vocabulary(sp: Any, style: str) -> dict[str, Any]:
    """``tokenizer.ggml.*`` as the converter writes them for ``sp`` (keys without the prefix)."""
    spec = STYLES[style]
    tokens, scores, types = [], [], []
    for index in range(sp.get_piece_size()):
        kind = NORMAL
        if sp.is_unknown(index):
            kind = UNKNOWN
        elif sp.is_control(index):
            kind = CONTROL
        elif sp.is_unused(index):
            kind = UNUSED
        elif sp.is_byte(index):
            kind = BYTE
        tokens.append(sp.id_to_piece(index))
        scores.append(sp.get_score(index))
        types.append(kind)
    for content, special in spec.added:
        index = tokens.index(content) if content in tokens else len(tokens)
        if index == len(tokens):
            tokens.append(content)
            scores.append(0.0)
            types.append(NORMAL)
        text = content if special or not spec.respell_spaces else content.replace(SPACE, " ")
        tokens[index], scores[index], types[index] = text, -1000.0, CONTROL if special else USER_DEFINED
    vocabulary: dict[str, Any] = {"tokens": tokens, "scores": scores, "types": types}
    vocabulary["bos"] = sp.bos_id()
    vocabulary["eos"] = tokens.index("<|endoftext|>") if style == "phi3" else sp.eos_id()
    vocabulary["unk"] = sp.unk_id()
    vocabulary["pad"] = sp.pad_id() if sp.pad_id() >= 0 else None
    return vocabulary


def add_sentencepiece_vocabulary(writer: gguf.GGUFWriter, sp: Any, style: str) -> None:
    vocabulary = gguf_vocabulary(sp, style)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocabulary["tokens"])
    writer.add_token_scores(vocabulary["scores"])
    writer.add_token_types(vocabulary["types"])
    writer.add_bos_token_id(vocabulary["bos"])
    writer.add_eos_token_id(vocabulary["eos"])
    writer.add_unk_token_id(vocabulary["unk"])
    if vocabulary["pad"] is not None:
        writer.add_pad_token_id(vocabulary["pad"])
    writer.add_add_bos_token(STYLES[style].add_bos)
    writer.add_add_eos_token(False)
    if STYLES[style].space_prefix_key:
        writer.add_add_space_prefix(False)


def vocabulary_gguf(sp: Any, style: str, path: Path) -> Path:
    """A GGUF holding only the vocabulary (no tensors): what the loader's tokenizer reads."""
    writer = gguf.GGUFWriter(path, "llama")
    add_sentencepiece_vocabulary(writer, sp, style)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
