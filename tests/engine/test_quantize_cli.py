"""``tern quantize``: a float model -> an INT4 checkpoint directory that ``load_model`` reads
straight into ``Int4Linear`` modules (the AutoAWQ GEMM layout, padded where AutoAWQ cannot hold a
layer), then served by ``LLMEngine``.

Tiny random-weight models keep this quick; the real AWQ quality is tests/engine/test_int4_quality.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.layers.quant import Int4Linear
from engine.layers.quant.formats import awq_gemm_from_int4, int4_from_awq_gemm
from engine.layers.quant.quantizers import rtn_quantize
from engine.loader import LoadedModel, load_model
from engine.quantize import default_calibration_text, main, quantize_model, write_checkpoint
from engine.serving.frames import generate_frames
from protocol.rpc import GenerateRequest, SamplingParams
from tests.engine.test_awq_convert import autoawq_pack
from tests.engine.test_loader_gguf import BYTE_TOKENS, write_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

# Tied embeddings, GQA (4 query heads per KV head), biases on attention and MLP; hidden 64, so at
# group 128 every layer but down_proj (K = 128) has one ragged group.
VARIANT = "llama_tied_gqa"
PROMPT = [1, 200, 3000, 42, 7, 999, 12, 31, 5000, 77]
SHORT_TEXT = "The quick brown fox jumps over the lazy dog. " * 12
# Relative logit error of a 4-bit copy of these random-weight models (measured 0.24-0.32; an
# unrelated model is near 1.4): quantization noise, not a wrong layout.
MAX_RELATIVE_ERROR = 0.4


def logits(loaded: LoadedModel | nn.Module, ids: list[int] = PROMPT) -> torch.Tensor:
    model = loaded.model if isinstance(loaded, LoadedModel) else loaded
    tokens = torch.tensor(ids)
    with torch.no_grad():
        return model.compute_logits(model(tokens, torch.arange(len(ids))))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.fixture(scope="module")
def float_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir(VARIANT)


@pytest.fixture(scope="module")
def float_model(float_dir: Path) -> LoadedModel:
    return load_model(float_dir, "cpu", torch.float32, progress=False)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_cli_checkpoint_loads_into_int4_linears(
    method: str, group_size: int, float_dir: Path, float_model: LoadedModel, tmp_path: Path
) -> None:
    out = tmp_path / "int4"
    argv = ["--model", str(float_dir), "--method", method, "--group-size", str(group_size), "--out", str(out)]
    if method == "awq" and group_size != 128:  # g128 calibrates on the text shipped in the package
        (tmp_path / "calib.txt").write_text(SHORT_TEXT)
        argv += ["--calib-file", str(tmp_path / "calib.txt")]
    assert main([*argv, "--device", "cpu"]) == 0

    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    loaded = load_model(out, "cpu", torch.float32, progress=False)
    int4 = {name: m for name, m in loaded.model.named_modules() if isinstance(m, Int4Linear)}
    assert len(int4) == 7 * float_model.config.num_hidden_layers
    assert {m.group_size for m in int4.values()} == {group_size}
    dense = [name for name, m in loaded.model.named_modules() if isinstance(m, nn.Linear)]
    assert dense == ["lm_head"]
    assert not [name for name in loaded.model.state_dict() if name.endswith("_proj.weight")]
    # 4-bit weights move the logits, but not far: the float model's, within a few percent
    error = relative_error(logits(loaded), logits(float_model))
    assert error < MAX_RELATIVE_ERROR, error


@torch.no_grad()
def test_rtn_checkpoint_holds_exactly_the_round_to_nearest_weights(
    float_dir: Path, float_model: LoadedModel, tmp_path: Path
) -> None:
    """The loaded model computes with the RTN weights of the float model (ragged groups included)."""
    assert (
        main(["--model", str(float_dir), "--method", "rtn", "--group-size", "128", "--out", str(tmp_path)])
        == 0
    )
    loaded = load_model(tmp_path, "cpu", torch.float32, progress=False)
    reference = float_model.model
    state = {}
    for name, param in reference.state_dict().items():
        module = name.removesuffix(".weight")
        if name.endswith("_proj.weight"):
            state[name] = rtn_quantize(param, 128).dequantize()
            torch.testing.assert_close(
                loaded.model.get_submodule(module).dequantized_weight(torch.float32),
                state[name],
                rtol=0,
                atol=2e-3 * state[name].abs().max().item(),  # scales and mins are kept in fp16
            )
        else:
            state[name] = param.half().float()  # the checkpoint stores float tensors in fp16
    fake_quantized = load_model(float_dir, "cpu", torch.float32, progress=False).model
    fake_quantized.load_state_dict(state)
    expected = logits(fake_quantized)
    torch.testing.assert_close(logits(loaded), expected, rtol=1e-3, atol=2e-3 * expected.abs().max().item())


@pytest.mark.parametrize("distill_sequences", [0, 3])
@torch.no_grad()
def test_awq_checkpoint_equals_the_model_it_was_written_from(
    distill_sequences: int, float_dir: Path, tmp_path: Path
) -> None:
    """AWQ's folded scales (in norms and linears), clipped weights and distilled scales all reach
    the checkpoint."""
    quantized = quantize_model(
        float_dir,
        method="awq",
        group_size=64,
        device="cpu",
        calibration_text=SHORT_TEXT,
        distill_sequences=distill_sequences,
    )
    write_checkpoint(quantized, tmp_path, method="awq", group_size=64, distill_sequences=distill_sequences)
    made_by = safe_open(tmp_path / "model.safetensors", "pt").metadata()["quantized_by"]
    assert made_by.endswith("--distill 3" if distill_sequences else "--group-size 64")
    loaded = load_model(tmp_path, "cpu", torch.float32, progress=False)
    # The checkpoint stores float tensors in fp16, and zero points: min = -zero * (fp16 scale).
    for tensor in quantized.model.state_dict().values():
        if tensor.dtype == torch.float32:
            tensor.copy_(tensor.half())
    for module in quantized.model.modules():
        if isinstance(module, Int4Linear):
            zeros = (-module.mins.float() / module.scales.float()).round()
            module.mins.copy_(-zeros * module.scales.float())
    expected = logits(quantized)
    torch.testing.assert_close(logits(loaded), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_quantized_checkpoint_serves_greedy_generation(float_dir: Path, tmp_path: Path) -> None:
    assert main(["--model", str(float_dir), "--method", "rtn", "--out", str(tmp_path / "q")]) == 0
    engine = LLMEngine.from_config(
        EngineConfig(
            model=str(tmp_path / "q"), device="cpu", dtype="float32", num_kv_blocks=64, num_threads=1
        )
    )
    assert isinstance(engine.runner.model.model.layers[0].mlp.down_proj, Int4Linear)
    request = GenerateRequest(
        request_id="r",
        prompt=PROMPT,
        sampling=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    )
    frames = generate_frames(engine, [request])["r"]
    generated = [t for f in frames if f.type == "delta" for t in f.token_ids]
    assert len(generated) == 12
    # paged, step-by-step decoding picks what one full forward of the same model ranks first
    full = logits(engine.runner.model, PROMPT + generated[:-1])
    assert full[len(PROMPT) - 1 :].argmax(dim=-1).tolist() == generated


def test_gguf_source_keeps_config_tokenizer_and_chat_template(tmp_path: Path) -> None:
    """A GGUF has no tokenizer.json: it is written from the GGUF's metadata and reads back the same."""
    from tests.engine.test_loader_gguf import tiny_hf_model

    source = tmp_path / "tiny-llama.Q4_1.gguf"
    write_gguf(tiny_hf_model("mistral"), "llama", source)
    out = tmp_path / "int4"
    assert main(["--model", str(source), "--method", "rtn", "--group-size", "32", "--out", str(out)]) == 0
    original = load_model(source, "cpu", torch.float32, progress=False)
    loaded = load_model(out, "cpu", torch.float32, progress=False)
    assert loaded.config == original.config
    text = "".join(BYTE_TOKENS[:40]) + " héllo <|im_start|>user\n"
    assert loaded.tokenizer.encode(text) == original.tokenizer.encode(text)
    assert loaded.tokenizer.special_tokens == original.tokenizer.special_tokens
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.tokenizer.apply_chat_template(messages) == original.tokenizer.apply_chat_template(messages)
    assert (
        relative_error(logits(loaded, [5, 9, 200, 31]), logits(original, [5, 9, 200, 31]))
        < MAX_RELATIVE_ERROR
    )


@pytest.mark.parametrize("architecture", ["gemma3", "phi3"])
def test_gemma3_and_phi3_gguf_sources_write_checkpoints_that_read_back(
    architecture: str, tmp_path: Path
) -> None:
    """Their config.json (layer types, window, query scalar; LongRoPE, partial rotary) reads back to
    the GGUF's config, and the weights to the same model: Gemma's norms written as ``w`` (the model
    holds ``1 + w``), Phi-3's fused projections under their own names."""
    from tests.engine.families_gguf import tiny_family_model, write_family_gguf

    source = write_family_gguf(
        tiny_family_model(architecture), architecture, tmp_path / f"{architecture}.gguf"
    )
    out = tmp_path / "int4"
    assert main(["--model", str(source), "--method", "rtn", "--group-size", "32", "--out", str(out)]) == 0
    original = load_model(source, "cpu", torch.float32, progress=False)
    loaded = load_model(out, "cpu", torch.float32, progress=False)
    assert loaded.config == original.config
    assert json.loads((out / "config.json").read_text())["architectures"] == [original.config.architecture]
    ids = [5, 9, 200, 31, 77, 12, 140, 3] * 3  # past Gemma's window of 6
    assert relative_error(logits(loaded, ids), logits(original, ids)) < MAX_RELATIVE_ERROR


def test_sharded_qwen2_source(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """q/k/v biases; the source's shards and index are not copied, one model.safetensors is written."""
    source = tiny_model_dir("qwen2")
    assert (source / "model.safetensors.index.json").exists()
    assert (
        main(["--model", str(source), "--method", "rtn", "--group-size", "32", "--out", str(tmp_path)]) == 0
    )
    assert sorted(p.name for p in tmp_path.glob("*.safetensors*")) == ["model.safetensors"]
    loaded = load_model(tmp_path, "cpu", torch.float32, progress=False)
    original = load_model(source, "cpu", torch.float32, progress=False)
    assert loaded.config == original.config
    assert (
        sum(isinstance(m, Int4Linear) for m in loaded.model.modules()) == 7 * loaded.config.num_hidden_layers
    )
    assert relative_error(logits(loaded), logits(original)) < MAX_RELATIVE_ERROR


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_int4_linear_gives_back_its_weight(backend: str) -> None:
    """What the checkpoint writer reads from a layer, whichever layout the layer packed it in."""
    weight = rtn_quantize(torch.randn(24, 100, generator=torch.Generator().manual_seed(1)), 32)
    held = Int4Linear(weight, backend=backend).int4_weight()
    assert torch.equal(held.codes, weight.codes)
    torch.testing.assert_close(held.scales, weight.scales.half().float(), rtol=0, atol=0)
    torch.testing.assert_close(held.mins, weight.mins.half().float(), rtol=0, atol=0)


def test_cli_refuses_bad_requests(
    float_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(SystemExit):
        main(["--model", str(float_dir), "--out", str(tmp_path / "busy")])
    with pytest.raises(SystemExit):
        main(["--method", "rtn", "--calib-file", "x.txt", "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit):
        main(["--group-size", "96", "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit):
        main(["--distill", "-1", "--out", str(tmp_path / "a")])
    assert (
        main(
            ["--model", str(float_dir), "--method", "rtn", "--group-size", "32", "--out", str(tmp_path / "q")]
        )
        == 0
    )
    assert main(["--model", str(tmp_path / "q"), "--method", "rtn", "--out", str(tmp_path / "qq")]) == 1
    assert "already int4-quantized" in capsys.readouterr().err


def test_tern_dispatches_quantize(capsys: pytest.CaptureFixture[str]) -> None:
    from tern_cli import main as tern

    with pytest.raises(SystemExit) as exit_info:
        tern(["quantize", "--help"])
    assert exit_info.value.code == 0
    assert "tern quantize" in capsys.readouterr().out


def test_calibration_text_ships_with_the_engine() -> None:
    assert len(default_calibration_text()) > 5000


@pytest.mark.parametrize(("n", "k", "group_size"), [(40, 64, 32), (37, 100, 64), (16, 576, 128)])
def test_awq_gemm_writer_is_autoawqs_layout(n: int, k: int, group_size: int) -> None:
    weight = rtn_quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(n)), group_size)
    qweight, qzeros, scales = awq_gemm_from_int4(weight)
    if n % 8 == 0 and k % group_size == 0:  # AutoAWQ's own layout, bit for bit
        zeros = torch.round(-weight.mins / weight.scales).to(torch.int32)
        assert torch.equal(qweight, autoawq_pack(weight.codes.t().to(torch.int32)))
        assert torch.equal(qzeros, autoawq_pack(zeros.t()))
    back = int4_from_awq_gemm(qweight, qzeros, scales, group_size, (n, k))
    assert torch.equal(back.codes, weight.codes)
    # scales are stored in fp16: codes (up to 15) times their rounding
    atol = 16 * 2**-11 * weight.scales.max().item()
    torch.testing.assert_close(back.dequantize(), weight.dequantize(), rtol=0, atol=atol)
