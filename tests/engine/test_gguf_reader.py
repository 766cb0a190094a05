"""The loader's GGUF header reader gives what ``gguf.GGUFReader`` gives, without its per-value objects."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.loader.gguf_reader import GgufFile
from engine.loader.load import default_model_path
from tests.engine.ggml_files import MIXED_TYPES, Q, write_mixed_gguf


def _assert_same(path: Path) -> None:
    ours, theirs = GgufFile(path, "r"), gguf.GGUFReader(path, "r")
    expected = {name: field.contents() for name, field in theirs.fields.items()}
    metadata = ours.metadata()
    assert list(metadata) == list(expected) and metadata == expected
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.n_bytes, mine.data_offset) == (
            reference.name,
            reference.tensor_type,
            reference.n_bytes,
            reference.data_offset,
        )
        assert mine.shape == tuple(int(n) for n in reference.shape)
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
        assert np.array_equal(mine.data, reference.data)


def test_a_mixed_file_reads_as_gguf_reads_it(tmp_path: Path) -> None:
    # K-quant, Q8_0 and Q5_0 blocks, float32 norms, a byte-level tokenizer's strings and numbers
    _assert_same(write_mixed_gguf(tmp_path / "mixed.gguf", MIXED_TYPES, Q.Q6_K, Q.Q8_0))


def test_the_default_model_reads_as_gguf_reads_it() -> None:
    _assert_same(default_model_path())


def test_opening_the_file_builds_no_object_per_vocabulary_entry() -> None:
    """gguf's reader holds several numpy views per token and merge (about 160 MB for the default
    model's 49,152 tokens); ours keeps the tensors' descriptions only, and the metadata it returns is
    one Python value per entry."""
    gc.collect()
    before = sys.getallocatedblocks()
    reader = GgufFile(default_model_path(), "r")
    held = sys.getallocatedblocks() - before
    assert held < 20_000, held  # about a dozen per tensor; gguf.GGUFReader: 1.1 million
    metadata = reader.metadata()
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GgufFile(path, "r")
