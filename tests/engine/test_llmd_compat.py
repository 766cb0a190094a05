"""What a Gateway API Inference Extension endpoint picker (llm-d's router) reads from a Tern engine:
vLLM's metric names on the serving port's ``/metrics``, and the render routes' prompt token ids.

Metrics are parsed with prometheus_client's own parser, which is how a scraper sees them (type and
labels included). Render is checked against what the engine then prefills for the same request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.llm_engine import LLMEngine
from engine.core.outputs import EngineRequest
from engine.serving.server import create_app
from protocol.rpc import GenerateRequest, SamplingParams
from tests.engine.tiny_engine import add_wire_request, make_byte_tokenizer, make_tiny_engine
from tests.gateway.live_server import ServerThread

GIE_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def families(text: str | bytes) -> dict[str, Any]:
    text = text.decode() if isinstance(text, bytes) else text
    return {family.name: family for family in text_string_to_metric_families(text)}


def gauge(parsed: dict[str, Any], name: str) -> float:
    (sample,) = parsed[name].samples
    return float(sample.value)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, LLMEngine]]:
    engine = make_tiny_engine(max_model_len=128)
    server = ServerThread(create_app(engine)).start()
    yield server.url, engine
    server.stop()


def test_serving_port_has_the_gauges_with_gie_types_and_labels(served: tuple[str, LLMEngine]) -> None:
    url, engine = served
    parsed = families(httpx.get(f"{url}/metrics").text)
    for name in (*GIE_GAUGES, "vllm:cache_config_info", "vllm:lora_requests_info"):
        assert parsed[name].type == "gauge", name
    for name in GIE_GAUGES:
        (sample,) = parsed[name].samples
        assert sample.labels == {"model_name": "tiny", "engine": "0"}
    (info,) = parsed["vllm:cache_config_info"].samples
    assert info.value == 1
    assert int(info.labels["block_size"]) == engine.config.block_size == 4
    assert int(info.labels["num_gpu_blocks"]) == engine.runner.num_blocks
    (lora,) = parsed["vllm:lora_requests_info"].samples
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert "tern_engine_requests_waiting" in parsed  # Tern's own names stay


def test_the_gauges_move_with_load() -> None:
    """Two sequences fit a step (max_num_seqs=2), five are sent: the gauges read the queue, the batch
    and the blocks they hold, then fall back to zero; cached blocks no request holds count as free."""
    engine = make_tiny_engine(make_byte_tokenizer(), max_num_seqs=2, num_kv_blocks=64)
    idle = families(engine.metrics.render())
    assert [gauge(idle, name) for name in GIE_GAUGES] == [0, 0, 0]
    for i in range(5):
        sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        add_wire_request(
            engine, GenerateRequest(request_id=f"r{i}", prompt=f"load {i} " * 6, sampling=sampling)
        )
    for _ in range(3):  # the scheduler may admit one prompt a step
        engine.step()
        busy = families(engine.metrics.render())
        if gauge(busy, "vllm:num_requests_running") == 2:
            break
    assert gauge(busy, "vllm:num_requests_running") == 2
    assert gauge(busy, "vllm:num_requests_waiting") == 3
    held = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    usage = gauge(busy, "vllm:kv_cache_usage_perc")
    assert 0 < usage <= 1 and usage == pytest.approx(
        (held - engine.block_manager.num_reclaimable_blocks()) / 64
    )
    while engine.has_unfinished_requests():
        engine.step()
    done = families(engine.metrics.render())
    assert [gauge(done, name) for name in GIE_GAUGES] == [0, 0, 0]
    assert engine.prefix_cache().stats().tree_blocks > 0  # type: ignore[union-attr]  # cached, yet "free"


def test_the_flag_turns_the_vllm_names_off() -> None:
    engine = make_tiny_engine(make_byte_tokenizer(), vllm_metrics=False)
    parsed = families(engine.metrics.render())
    assert not [name for name in parsed if name.startswith("vllm:")]
    assert "tern_engine_requests_running" in parsed


def prefilled(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Records the prompt ids of every request the engine admits (the real add_request runs)."""
    seen: list[list[int]] = []
    add = engine.add_request

    def recording(request: EngineRequest) -> None:
        seen.append(list(request.prompt_token_ids))
        add(request)

    monkeypatch.setattr(engine, "add_request", recording)
    return seen


CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "héllo, wörld"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "again"},
    ],
    "max_tokens": 2,
}


def test_chat_render_returns_exactly_what_the_engine_prefills(
    served: tuple[str, LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, engine = served
    seen = prefilled(engine, monkeypatch)
    rendered = httpx.post(f"{url}/v1/chat/completions/render", json=CHAT).json()
    assert seen == []  # rendering admits nothing
    assert isinstance(rendered, dict) and rendered["model"] == "tiny" and rendered["features"] is None
    assert rendered["sampling_params"]["max_tokens"] == 2
    answer = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60)
    assert answer.status_code == 200
    assert seen == [rendered["token_ids"]]
    assert answer.json()["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    # Through the chat template: the role markers are special tokens, the text is bytes.
    text = engine.tokenizer.decode(rendered["token_ids"], skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith(
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("prompt", ["Once upon a time", [5, 6, 7, 258]])
def test_completions_render_is_a_list_of_one_with_the_prefilled_ids(
    served: tuple[str, LLMEngine], monkeypatch: pytest.MonkeyPatch, prompt: str | list[int]
) -> None:
    url, engine = served
    seen = prefilled(engine, monkeypatch)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    rendered = httpx.post(f"{url}/v1/completions/render", json=body).json()
    assert isinstance(rendered, list) and len(rendered) == 1
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    assert seen == [rendered[0]["token_ids"]]
    if isinstance(prompt, list):
        assert rendered[0]["token_ids"] == prompt


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/chat/completions/render", b"{not json", 400, "JSON"),
        ("/v1/chat/completions/render", b'{"model": "tiny"}', 400, "messages"),
        ("/v1/completions/render", b'{"model": "other", "prompt": "x"}', 404, "does not exist"),
        ("/v1/completions/render", b'{"model": "tiny", "prompt": ""}', 400, "empty"),
    ],
)
def test_render_refuses_bad_requests_in_openai_shape(
    served: tuple[str, LLMEngine], path: str, body: bytes, status: int, fragment: str
) -> None:
    url, _ = served
    response = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and fragment in error["message"]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
