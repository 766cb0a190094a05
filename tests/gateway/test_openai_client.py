"""The official ``openai`` Python client, pointed at a live gateway with an inference key."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import openai
import pytest
from fake_engine import REPLY, FakeEngine
from live_server import ServerThread, create_inference_key

from gateway.app import create_app
from gateway.config import Settings

MESSAGES = [{"role": "user", "content": "say hello"}]

pytestmark = pytest.mark.fake_engines


@pytest.fixture
def client(gateway_settings: Settings) -> Iterator[openai.OpenAI]:
    server = ServerThread(create_app(gateway_settings)).start()
    assert gateway_settings.admin_key is not None
    secret = create_inference_key(server.url, gateway_settings.admin_key.get_secret_value())
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=secret, max_retries=0, timeout=30) as client:
            yield client
    finally:
        server.stop()


def test_non_streaming_chat_completion(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=3)
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == "".join(REPLY[:3])
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (2, 3)
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_chat_completion(client: openai.OpenAI, fake_engine: FakeEngine) -> None:
    fake_engine.gate = threading.Event()
    stream = client.chat.completions.create(
        model="fake-model", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            fake_engine.gate.set()  # let the engine go on only once the first token reached the client
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(REPLY)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(REPLY)


def test_models_and_errors_through_the_client(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["fake-model"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="fake-model", messages=MESSAGES, extra_body={"bogus": 1})
    assert bad.value.code is None and "bogus" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=MESSAGES)
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="not-a-key").models.list()
