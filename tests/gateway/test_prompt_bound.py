"""The prompt bound reserved for ``openai``-kind upstreams holds against the default model's real
tokenizer and template for every kind of prompt in ``prompt_mix`` (and the estimate reserved for
Tern engines covers a short chat, so the common case needs no top-up)."""

from __future__ import annotations

import random

from prompt_mix import draw_body, engine_tokenizer, exact_prompt_tokens

from gateway.limits.admission import estimate_prompt_tokens
from gateway.proxy.token_count import prompt_upper_bound
from protocol.openai.requests import ChatCompletionRequest


def test_the_bound_covers_every_prompt_and_the_estimate_a_short_chat() -> None:
    overhead = len(engine_tokenizer().encode_chat([{"role": "user", "content": ""}]))
    rng = random.Random(47)
    for i in range(100):
        body = draw_body(rng, i)
        request = ChatCompletionRequest.model_validate(body)
        exact = exact_prompt_tokens(body)
        assert exact <= prompt_upper_bound(request, overhead), body
        if len(body["messages"]) == 1 and "tools" not in body and body["messages"][0]["content"].isascii():
            assert exact <= estimate_prompt_tokens(request) + overhead, body


def test_the_bound_takes_any_valid_request() -> None:
    """JSON allows integers of any size (schemathesis sends them in tool schemas): still a count."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"maximum": 10**30}}}],
    }
    request = ChatCompletionRequest.model_validate(body)
    assert prompt_upper_bound(request, 5) > len('{"maximum":1000000000000000000000000000000}') + 5
