"""BitNet b1.58 (``microsoft/bitnet-b1.58-2B-4T``, transformers' ``BitNetForCausalLM``).

A Llama-shaped decoder with three differences: an RMSNorm on the attention output before
``o_proj`` (``attn_sub_norm``), a squared-ReLU gated MLP with an RMSNorm before ``down_proj``
(``ffn_sub_norm``; SiLU instead in a GGUF of architecture ``bitnet``, as llama.cpp computes it), and
every projection a ternary ``BitLinear`` (weights in {-1, 0, 1} times a
per-tensor scale, activations quantized to int8 per token).

The projections are built as plain ``nn.Linear`` with Hugging Face names, like the Llama model,
and become ``TernaryLinear`` once weights are in: :func:`ternary_weights_from_checkpoint` turns the
checkpoint's packed ``uint8`` weights and ``weight_scale`` into ternary weights for
``install_quantized_weights``; a float checkpoint is ternarized with absmean
(``quantize_linears(model, "bitnet")``, transformers' "online" mode). ``lm_head`` stays float.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.norm import RMSNorm
from engine.layers.quant.formats import ternary_from_bitnet
from engine.layers.quant.weights import TernaryWeight
from engine.model_config import ModelConfig
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

PACKED_WEIGHT_SUFFIX = ".weight"
WEIGHT_SCALE_SUFFIX = ".weight_scale"


class BitNetAttention(LlamaAttention):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.attn_sub_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = self.attn(*self.rotated_qkv(hidden, cos, sin))
        return self.o_proj(self.attn_sub_norm(out.reshape(hidden.shape[0], self.num_heads * self.head_dim)))


class BitNetMLP(LlamaMLP):
    """Llama's gated MLP (gate and up stacked when served) with an RMSNorm before ``down_proj`` and
    squared ReLU for SiLU (SiLU where the config says so: a GGUF of architecture ``bitnet``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.ffn_sub_norm = RMSNorm(config.intermediate_size, config.rms_norm_eps)
        self.relu2 = config.hidden_act == "relu2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        # the C decoder layer's relu2_mul computes the same (gated_rows.c)
        activated = F.relu(gate).square() * up if self.relu2 else self.act(gate, up)
        return self.down_proj(self.ffn_sub_norm(activated))


class BitNetDecoderLayer(LlamaDecoderLayer):
    attention_cls = BitNetAttention
    mlp_cls = BitNetMLP


class BitNetModel(LlamaModel):
    layer_cls = BitNetDecoderLayer


class BitNetForCausalLM(LlamaForCausalLM):
    """Same interface as the Llama model: ``forward(input_ids[T], positions[T]) -> hidden[T, H]``."""

    model_cls = BitNetModel


def is_packed_bitnet_tensor(name: str, tensor: torch.Tensor) -> bool:
    """A tensor of a packed ``BitLinear``: its uint8 weight or its ``weight_scale``."""
    return name.endswith(WEIGHT_SCALE_SUFFIX) or (
        name.endswith(PACKED_WEIGHT_SUFFIX) and tensor.dtype == torch.uint8
    )


def ternary_weights_from_checkpoint(
    model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, TernaryWeight]:
    """Packed ``BitLinear`` tensors (see :func:`is_packed_bitnet_tensor`) -> ternary weights by module."""
    packed: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(WEIGHT_SCALE_SUFFIX):
            scales[name.removesuffix(WEIGHT_SCALE_SUFFIX)] = tensor
        else:
            packed[name.removesuffix(PACKED_WEIGHT_SUFFIX)] = tensor
    if packed.keys() != scales.keys():
        raise ValueError(
            f"packed BitNet weights without a weight_scale: {sorted(packed.keys() ^ scales.keys())[:3]}"
        )
    return {
        module: ternary_from_bitnet(weight, scales[module], _out_features(model, module))
        for module, weight in packed.items()
    }


def _out_features(model: nn.Module, name: str) -> int:
    linear = model.get_submodule(name)
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"packed BitNet weights for {name!r}, which is not a linear layer")
    return linear.out_features
