"""The family registry: every family is reachable by its names, loads into model code, and a
refusal names what is supported."""

from __future__ import annotations

import pytest

from engine.families import FAMILIES, family_for_gguf, family_for_hf, supported_line
from engine.models import MODEL_CLASSES


def test_every_family_is_found_by_its_names_and_has_model_code() -> None:
    for family in FAMILIES:
        assert family.model in MODEL_CLASSES
        for name in family.hf_architectures:
            assert family_for_hf(name) is family
        if family.gguf_architecture is not None:
            assert family_for_gguf(family.gguf_architecture) is family


def test_refusals_are_one_line_naming_what_loads() -> None:
    for refuse, name in ((family_for_hf, "GPT2LMHeadModel"), (family_for_gguf, "gpt2")):
        with pytest.raises(ValueError) as refused:
            refuse(name)
        message = str(refused.value)
        assert "\n" not in message and message.endswith(supported_line())
        assert "Qwen3ForCausalLM" in message and "smollm3" in message
