"""SmolLM3: Llama whose every ``no_rope_layer_interval``-th layer applies no rotary (NoPE).

transformers lists the layers in ``no_rope_layers`` (1: rope, 0: none); llama.cpp's ``smollm3``
architecture writes no such key and fixes the interval at 4 (``src/models/smollm3.cpp``). Its
converter is Llama's, q/k permuted. YaRN, when the config asks for it, is the common rope code's.
"""

from collections.abc import Mapping
from typing import Any

from engine.families.spec import Family

GGUF_NOPE_INTERVAL = 4


def hf_nope_layers(config: Mapping[str, Any]) -> tuple[int, ...]:
    layers = config["num_hidden_layers"]
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config.get("no_rope_layer_interval", GGUF_NOPE_INTERVAL)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


def gguf_nope_layers(num_layers: int) -> tuple[int, ...]:
    return tuple(i for i in range(num_layers) if (i + 1) % GGUF_NOPE_INTERVAL == 0)


FAMILY = Family(
    hf_architectures=("SmolLM3ForCausalLM",),
    gguf_architecture="smollm3",
    gguf_qk_permuted=True,
    hf_nope_layers=hf_nope_layers,
    gguf_nope_layers=gguf_nope_layers,
)
