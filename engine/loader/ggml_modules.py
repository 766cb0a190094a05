"""The loader's side of GGUF tensors kept as their own blocks (``Form.GGML_BLOCKS`` in the load plan,
``engine/loader/plan.py``): holds them by module, then puts the modules that run them in the model
(``engine/layers/ggml_linear.py``): a ``GgmlLinear`` for each decoder linear and output head, a
``GgmlEmbedding`` for the embedding (on the head's blocks where tied).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cpu.ggml_kernels import GGMLType, kernel_format
from engine.layers.ggml_linear import GgmlEmbedding, GgmlLinear
from engine.layers.packed_linear import Q4CpuLinear

EMBEDDING = "model.embed_tokens"
HEAD = "lm_head"


class GgmlBlocks:
    """Holds the blocks the load plan keeps for their own kernels, by module name."""

    def __init__(self) -> None:
        self.tensors: dict[str, tuple[torch.Tensor, GGMLType]] = {}
        self.q4: dict[str, Q4CpuLinear] = {}
        """Q4_0/Q4_1 linears already in the C kernel's layout (``Form.Q4_KERNEL``), bias to come."""

    def keep(self, module: str, blocks: torch.Tensor, ggml_type: GGMLType) -> None:
        self.tensors[module] = (blocks, ggml_type)

    def keep_q4(self, module: str, blocks: torch.Tensor, ggml_type: GGMLType) -> None:
        """Lay out a Q4_0/Q4_1 linear's blocks now: they may be views the reader hands back next."""
        self.q4[module] = Q4CpuLinear.from_gguf_blocks(blocks, ggml_type.name)

    def parameter_names(self, tied: bool) -> set[str]:
        """The float parameters the blocks stand in for (absent from the stream); a tied head's too."""
        names = {module + ".weight" for module in (*self.tensors, *self.q4)}
        if tied and EMBEDDING in self.tensors:
            names.add(HEAD + ".weight")
        return names

    def install(self, model: nn.Module, tied: bool) -> int:
        """Swap in the modules on the blocks; returns how many. Biases (Qwen2's q/k/v) move over."""
        installed = 0
        for module, q4 in self.q4.items():
            linear = model.get_submodule(module)
            if not isinstance(linear, nn.Linear) or linear.in_features != q4.in_features:
                raise ValueError(f"{module}: Q4 blocks of width {q4.in_features} do not fit {linear}")
            q4.bias = None if linear.bias is None else linear.bias.detach().float()
            model.set_submodule(module, q4)
            installed += 1
        for module, (blocks, ggml_type) in self.tensors.items():
            if module == EMBEDDING:
                continue
            linear = model.get_submodule(module)
            if not isinstance(linear, nn.Linear):
                raise ValueError(
                    f"{module}: GGML blocks for {type(linear).__name__}, which is not a linear layer"
                )
            kept = GgmlLinear(blocks, ggml_type, linear.in_features, linear.bias, head=module == HEAD)
            model.set_submodule(module, kept)
            installed += 1
        if EMBEDDING in self.tensors:
            blocks, ggml_type = self.tensors[EMBEDDING]
            embedding = model.get_submodule(EMBEDDING)
            if not isinstance(embedding, nn.Embedding):
                raise ValueError(f"{EMBEDDING}: GGML blocks for {type(embedding).__name__}, not an embedding")
            width = embedding.embedding_dim
            if tied and kernel_format(ggml_type, width) is not None:
                head = GgmlLinear(blocks, ggml_type, width, rows_looked_up=True, head=True)
                model.set_submodule(HEAD, head)
                model.set_submodule(EMBEDDING, GgmlEmbedding(head, width))
                installed += 2
            else:  # untied (gguf_file keeps a tied one only where its type has a kernel)
                model.set_submodule(EMBEDDING, GgmlEmbedding((blocks, ggml_type), width))
                installed += 1
        return installed
