"""Our BitNet b1.58 model against transformers' BitNetForCausalLM with packed BitLinear layers.

transformers builds those layers when it loads a checkpoint with a BitNet ``quantization_config``
(as microsoft/bitnet-b1.58-2B-4T has); here the same modules are put in place by hand on a small
random-weight config, filled with packed ternary weights, and both models run in float32 on CPU.
"""

from collections.abc import Iterator

import pytest
import torch
import transformers
from transformers.integrations.bitnet import BitLinear, pack_weights

from engine.layers.quant import TernaryLinear
from engine.layers.quant.quantizers import absmean_ternarize
from engine.layers.quant.swap import install_quantized_weights
from engine.model_config import ModelConfig
from engine.models.bitnet import BitNetForCausalLM, is_packed_bitnet_tensor, ternary_weights_from_checkpoint

HF_CONFIG = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


@pytest.fixture
def eager_transformers() -> Iterator[None]:
    """transformers' BitLinear wraps helpers in torch.compile; run them eagerly (no compiler needed)."""
    previous = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    yield
    torch._dynamo.config.disable = previous


def hf_bitnet_model() -> transformers.BitNetForCausalLM:
    torch.manual_seed(0)
    config = transformers.BitNetConfig(**HF_CONFIG)
    model = transformers.BitNetForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.modules():  # norms at 1.0 would hide a mixed-up norm
            if isinstance(module, transformers.models.bitnet.modeling_bitnet.BitNetRMSNorm):
                module.weight.uniform_(0.5, 1.5)
        for name, linear in list(model.named_modules()):
            if not isinstance(linear, torch.nn.Linear) or name == "lm_head":
                continue
            ternary = absmean_ternarize(linear.weight)
            packed = BitLinear(linear.in_features, linear.out_features, bias=False, dtype=torch.float32)
            packed.weight.copy_(pack_weights(ternary.values.clone()))
            packed.weight_scale.fill_(1.0 / ternary.scale)
            model.set_submodule(name, packed)
    return model


def engine_model_from(hf_model: transformers.BitNetForCausalLM, backend: str) -> BitNetForCausalLM:
    hf_dict = {**hf_model.config.to_dict(), "architectures": ["BitNetForCausalLM"]}
    model = BitNetForCausalLM(ModelConfig.from_hf_dict(hf_dict)).eval()
    tensors = list(hf_model.state_dict().items())
    packed = [(n, t) for n, t in tensors if is_packed_bitnet_tensor(n, t)]
    install_quantized_weights(model, ternary_weights_from_checkpoint(model, packed), backend=backend)
    floats = {n: t for n, t in tensors if not is_packed_bitnet_tensor(n, t)}
    missing, unexpected = model.load_state_dict(floats, strict=False)
    assert not unexpected
    # what is left are the buffers of the ternary layers, filled from the packed tensors above
    assert all(n.endswith((".values_t", ".weight_scale", ".qweight")) for n in missing)
    return model


@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton: interpreted on CPU
def test_engine_bitnet_logits_match_transformers(eager_transformers: None, backend: str) -> None:
    hf_model = hf_bitnet_model()
    model = engine_model_from(hf_model, backend)
    assert sum(isinstance(m, TernaryLinear) for m in model.modules()) == 2 * 7
    input_ids = torch.randint(0, HF_CONFIG["vocab_size"], (13,), generator=torch.Generator().manual_seed(1))

    with torch.no_grad():
        expected = hf_model(input_ids[None]).logits[0].float()
        logits = model.compute_logits(model(input_ids, torch.arange(13)))

    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
