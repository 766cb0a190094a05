"""The model families the engine serves, one declarative module each (``engine/families/spec.py``).

Adding a Llama-shaped family: its module here and its line in ``FAMILIES``; one with layer code of
its own also adds its class to ``engine/models/__init__.py``.
"""

from __future__ import annotations

from engine.families import bitnet, gemma3, llama, phi3, qwen2, qwen3, smollm3
from engine.families.spec import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    smollm3.FAMILY,
    gemma3.FAMILY,
    phi3.FAMILY,
    bitnet.FAMILY,
)

_BY_HF = {name: family for family in FAMILIES for name in family.hf_architectures}
_BY_GGUF = {family.gguf_architecture: family for family in FAMILIES if family.gguf_architecture}

HF_ARCHITECTURES: tuple[str, ...] = tuple(_BY_HF)
GGUF_ARCHITECTURES: tuple[str, ...] = tuple(_BY_GGUF)


def supported_line() -> str:
    """The one line a refusal ends with: what the engine does load."""
    return f"supported: {', '.join(HF_ARCHITECTURES)} (Hugging Face); {', '.join(GGUF_ARCHITECTURES)} (GGUF)"


def family_for_hf(architecture: str) -> Family:
    family = _BY_HF.get(architecture)
    if family is None:
        raise ValueError(f"unsupported architecture {architecture!r}; {supported_line()}")
    return family


def family_for_gguf(architecture: str) -> Family:
    family = _BY_GGUF.get(architecture)
    if family is None:
        raise ValueError(f"unsupported GGUF architecture {architecture!r}; {supported_line()}")
    return family
