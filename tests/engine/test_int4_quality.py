"""INT4 g128 quality on the real default model (SmolLM2-135M-Instruct): perplexity and generation.

The float baseline is the model as the engine loads it: its Q4_1 GGUF weights dequantized to
float32, the only SmolLM2 weights available offline. AWQ calibrates on one public-domain text
(Alice's Adventures in Wonderland, ch. I: the engine's own calibration text, engine/data/) and
perplexity is measured on another (Pride and Prejudice, ch. 1, tests/data).

This test checks the methods, not the headline figure. Distillation here learns from the
calibration text alone (about 20 s): the same code path as ``tern quantize --distill N``, whose
N generated sequences take ten minutes and belong to the benchmark (``tern bench int4-quality
--distill 128``; figures per CPU in docs/quantization.md). Float results differ between the Intel
and AMD machines CI runs on, so each bound below sits well beyond the spread measured across
machines and seeds.
"""

import pytest
from torch import nn

from bench.engine.int4_quality import distilled_copy, perplexity, quantized_copy
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.layers.quant import Int4Linear
from engine.loader.load import LoadedModel
from engine.quantize import calibration_ids, default_calibration_text
from engine.serving.frames import generate_frames
from protocol.rpc import ChatMessage, GenerateRequest, SamplingParams
from tests.engine.conftest import evaluation_ids

pytestmark = pytest.mark.slow

CALIBRATION_SEQUENCES = 10  # the chapter's 2730 tokens in whole sequences of 256
CALIBRATION_SEQUENCE_LENGTH = 256
GROUP_SIZE = 128
# Measured perplexity increases over float (docs/quantization.md, "Across machines"):
#   RTN   +26.7% (Intel and AMD)
#   AWQ   +7.8% (Intel Xeon), +9.2% and +9.8% (two AMD EPYC hosts); +8.7% to +11.3% with other
#         amounts of calibration text
#   AWQ + distilled on the calibration text: +7.2% (AMD host B; seeds 0 and 1 give the same model,
#         since nothing random is drawn without generated sequences), +7.5% and +8.0% (AMD host A)
#   (with 128 generated sequences, the benchmark's setting, seeds 0 and 1 differ by 0.7 points)
# AWQ's bound leaves 5 points over the worst figure measured; the distilled bound 4 points over its
# worst. Both still fail when the method breaks (RTN is +27%). That distillation beats AWQ
# (by 1.8 to 2.3 points measured) is the method's own claim and is asserted without a margin.
AWQ_MAX_PPL_INCREASE = 0.15
DISTILLED_MAX_PPL_INCREASE = 0.12


@pytest.fixture(scope="module")
def quantized(default_model: LoadedModel) -> dict[str, nn.Module]:
    """RTN, AWQ and distilled AWQ copies of the shared model (the shared instance stays float)."""
    calibration = calibration_ids(
        default_model.tokenizer, default_calibration_text(), CALIBRATION_SEQUENCE_LENGTH
    )
    assert calibration.shape[0] == CALIBRATION_SEQUENCES
    models = {
        method: quantized_copy(default_model, method, GROUP_SIZE, calibration) for method in ("rtn", "awq")
    }
    models["awq+distill"] = distilled_copy(default_model, models["awq"], calibration, generated=())
    return models


def test_int4_perplexity_close_to_float_and_awq_not_worse_than_rtn(
    default_model: LoadedModel, quantized: dict[str, nn.Module], float32_perplexity: float
) -> None:
    eval_ids = evaluation_ids(default_model)
    window = default_model.config.max_position_embeddings
    baseline = float32_perplexity
    ppl = {method: perplexity(model, eval_ids, window) for method, model in quantized.items()}
    print(
        f"\nperplexity on {len(eval_ids)} tokens: float {baseline:.3f}, "
        + ", ".join(f"{m} g{GROUP_SIZE} {p:.3f} (+{100 * (p / baseline - 1):.1f}%)" for m, p in ppl.items())
    )

    for model in quantized.values():
        linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
        assert len(linears) == 7 * default_model.config.num_hidden_layers
    assert ppl["rtn"] > baseline  # the quantization really happened
    assert ppl["awq"] < ppl["rtn"]
    assert ppl["awq+distill"] < ppl["awq"]
    assert ppl["awq"] <= baseline * (1 + AWQ_MAX_PPL_INCREASE)
    assert ppl["awq+distill"] <= baseline * (1 + DISTILLED_MAX_PPL_INCREASE)


@pytest.mark.parametrize("method", ["awq", "awq+distill"])
def test_awq_int4_model_generates_coherent_text(
    method: str, default_model: LoadedModel, quantized: dict[str, nn.Module]
) -> None:
    """Through the real engine (scheduler, paged KV cache, sampler), greedy."""
    engine = LLMEngine(
        EngineConfig(device="cpu", num_kv_blocks=64),
        model=quantized[method],
        tokenizer=default_model.tokenizer,
        model_config=default_model.config,
        model_name="smollm2-awq-int4",
    )
    request = GenerateRequest(
        request_id="paris",
        messages=[ChatMessage(role="user", content="What is the capital of France?")],
        sampling=SamplingParams(temperature=0.0, max_tokens=16),
    )
    text = "".join(
        frame.text for frame in generate_frames(engine, [request])["paris"] if frame.type == "delta"
    )
    print(f"\n{method} INT4 answer: {text!r}")
    assert "Paris" in text, text
