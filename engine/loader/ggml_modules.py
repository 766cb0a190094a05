"""The loader's side of GGUF tensors kept as their own blocks (``iter_tensors(keep_blocks=True)``):
takes them out of the tensor stream, then puts the modules that run them in the model
(``engine/layers/ggml_linear.py``): a ``GgmlLinear`` for each decoder linear and output head, a
``GgmlEmbedding`` for the embedding (on the head's blocks where tied).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.cpu.ggml_kernels import GGMLType, kernel_format
from engine.layers.ggml_linear import GgmlEmbedding, GgmlLinear
from engine.loader.gguf_file import BLOCKS_SUFFIX

EMBEDDING = "model.embed_tokens"
HEAD = "lm_head"


class GgmlBlocks:
    """Keeps the ``<module>.ggml_blocks_<type>`` tensors of a stream aside, by module name."""

    def __init__(self) -> None:
        self.tensors: dict[str, tuple[torch.Tensor, GGMLType]] = {}

    def filter(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            module, suffix, type_name = name.partition(BLOCKS_SUFFIX)
            if suffix:
                self.tensors[module] = (tensor, GGMLType.__members__[type_name])
            else:
                yield name, tensor

    def parameter_names(self, tied: bool) -> set[str]:
        """The float parameters the blocks stand in for (absent from the stream); a tied head's too."""
        names = {module + ".weight" for module in self.tensors}
        if tied and EMBEDDING in self.tensors:
            names.add(HEAD + ".weight")
        return names

    def install(self, model: nn.Module, tied: bool) -> int:
        """Swap in the modules on the blocks; returns how many. Biases (Qwen2's q/k/v) move over."""
        installed = 0
        for module, (blocks, ggml_type) in self.tensors.items():
            if module == EMBEDDING:
                continue
            linear = model.get_submodule(module)
            bias: torch.Tensor | None = linear.bias  # type: ignore[assignment]
            model.set_submodule(module, GgmlLinear(blocks, ggml_type, int(linear.in_features), bias))  # type: ignore[arg-type]
            installed += 1
        if EMBEDDING in self.tensors:
            blocks, ggml_type = self.tensors[EMBEDDING]
            width = int(model.get_submodule(EMBEDDING).embedding_dim)  # type: ignore[arg-type]
            if tied and kernel_format(ggml_type, width) is not None:
                head = GgmlLinear(blocks, ggml_type, width, rows_looked_up=True)
                model.set_submodule(HEAD, head)
                model.set_submodule(EMBEDDING, GgmlEmbedding(head, width))
                installed += 2
            else:  # untied (gguf_file keeps a tied one only where its type has a kernel)
                model.set_submodule(EMBEDDING, GgmlEmbedding((blocks, ggml_type), width))
                installed += 1
        return installed
