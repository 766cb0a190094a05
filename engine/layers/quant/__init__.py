"""Quantized drop-in replacements for ``nn.Linear`` and the conversions that feed them.

- :mod:`.weights`: the canonical in-memory forms (:class:`Int4Weight`, :class:`TernaryWeight`).
- :mod:`.formats`: checkpoint layouts (AutoAWQ GEMM, GGUF Q4_0/Q4_1, transformers' BitNet) -> canonical.
- :mod:`.quantizers`: RTN, AWQ and absmean quantizers for experiments.
- :mod:`.linear`: :class:`Int4Linear` and :class:`TernaryLinear`, which pack the canonical form once
  for their backend (Triton kernels on CUDA, torch CPU kernels otherwise).
- :mod:`.swap`: replace a model's ``nn.Linear`` modules after load, like gpt-fast.
"""

from engine.layers.quant.linear import Int4Linear, TernaryLinear
from engine.layers.quant.weights import Int4Weight, TernaryWeight

__all__ = ["Int4Linear", "Int4Weight", "TernaryLinear", "TernaryWeight"]
