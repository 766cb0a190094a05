"""Quantized checkpoints through the engine's loader (``load_model``, ``--quant``).

An AutoAWQ-format directory and a packed BitNet directory are written from small random-weight
transformers models; the engine must load them into Int4Linear / TernaryLinear modules and give
the logits of the float model with the same (dequantized) weights.
"""

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from engine.config import EngineConfig
from engine.layers.quant import Int4Linear, TernaryLinear
from engine.layers.quant.checkpoint import resolve_quant
from engine.layers.quant.quantizers import rtn_quantize
from engine.loader.load import load_model
from tests.engine.test_awq_convert import autoawq_pack
from tests.engine.test_bitnet_parity import eager_transformers, hf_bitnet_model  # noqa: F401

GROUP = 32
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def save_dir(path: Path, config: transformers.PretrainedConfig, tensors: dict, tokenizer_dir: Path) -> Path:
    config.save_pretrained(path)
    save_file({n: t.contiguous() for n, t in tensors.items()}, path / "model.safetensors")
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, path / item.name)
    return path


@torch.no_grad()
def test_autoawq_checkpoint_loads_into_int4_linears(hf_tokenizer_dir: Path, tmp_path: Path) -> None:
    vocab = len(transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir))
    config = transformers.LlamaConfig(vocab_size=vocab, num_key_value_heads=2, **SMALL)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    tensors = {}
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            q = rtn_quantize(module.weight, GROUP)
            scales = q.scales.half()
            zeros = torch.round(-q.mins / q.scales).to(torch.int32)
            tensors[name + ".qweight"] = autoawq_pack(q.codes.t().to(torch.int32))
            tensors[name + ".qzeros"] = autoawq_pack(zeros.t())
            tensors[name + ".scales"] = scales.t()
            # the float reference holds exactly what the checkpoint stands for
            per_column = scales.float().repeat_interleave(GROUP, 1), zeros.repeat_interleave(GROUP, 1)
            module.weight.copy_((q.codes.float() - per_column[1]) * per_column[0])
    tensors |= {n: t for n, t in reference.state_dict().items() if not n.endswith("proj.weight")}
    config.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm"}
    path = save_dir(tmp_path / "awq", config, tensors, hf_tokenizer_dir)

    loaded = load_model(path, "cpu", torch.float32, progress=False)

    assert sum(isinstance(m, Int4Linear) for m in loaded.model.modules()) == 7 * 2
    ids = torch.tensor([1, 200, 3000, 42, 7, 999, 12])
    expected = reference(ids[None]).logits[0]
    logits = loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids))))
    # the engine keeps min = -zero * scale in fp16: a rounding of about 1e-3 of a step
    torch.testing.assert_close(logits, expected, rtol=1e-3, atol=2e-3 * expected.abs().max().item())
    with pytest.raises(ValueError, match="int4-quantized"):
        load_model(path, "cpu", torch.float32, progress=False, quant="bitnet")


@torch.no_grad()
def test_packed_bitnet_checkpoint_loads_into_ternary_linears(
    hf_tokenizer_dir: Path,
    tmp_path: Path,
    eager_transformers: None,  # noqa: F811
) -> None:
    hf_model = hf_bitnet_model()
    config = hf_model.config
    config.architectures = ["BitNetForCausalLM"]
    config.quantization_config = {
        "quant_method": "bitnet",
        "linear_class": "bitlinear",
        "quantization_mode": "offline",
    }
    path = save_dir(tmp_path / "bitnet", config, dict(hf_model.state_dict()), hf_tokenizer_dir)

    loaded = load_model(path, "cpu", torch.float32, progress=False)

    assert sum(isinstance(m, TernaryLinear) for m in loaded.model.modules()) == 7 * 2
    ids = torch.tensor([1, 20, 30, 42, 7, 9, 12]) % config.vocab_size
    expected = hf_model(ids[None]).logits[0]
    logits = loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids))))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def test_float_checkpoint_quantized_on_request(tiny_model_dir: Callable[[str], Path]) -> None:
    path = tiny_model_dir("llama3")
    int4 = load_model(path, "cpu", torch.float32, progress=False, quant="int4").model
    assert any(isinstance(m, Int4Linear) for m in int4.modules())
    plain = load_model(path, "cpu", torch.float32, progress=False).model
    assert not any(isinstance(m, Int4Linear) for m in plain.modules())


def test_quant_choice_validation() -> None:
    assert resolve_quant("auto", "int4") == "int4"
    assert resolve_quant("int4", "none") == "int4"
    with pytest.raises(ValueError, match="bitnet-quantized"):
        resolve_quant("none", "bitnet")
    with pytest.raises(ValueError, match="quant must be"):
        EngineConfig(quant="fp8")
