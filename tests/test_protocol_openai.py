"""protocol/openai/: request validation, conversion to RPC, and frame formatting."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol.openai.errors import OpenAIRequestError, error_body
from protocol.openai.requests import ChatCompletionRequest, CompletionRequest, parse_request
from protocol.openai.responses import SSE_DONE, ResponseAccumulator, StreamFormatter
from protocol.rpc import DeltaFrame, ErrorFrame, FinalFrame, TokenLogprob, ToolCall, TopLogprob

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields: Any) -> bytes:
    return json.dumps(CHAT | fields).encode()


def refused(request_cls: type, raw: bytes | str) -> OpenAIRequestError:
    with pytest.raises(OpenAIRequestError) as info:
        parse_request(request_cls, raw)
    assert info.value.status == 400
    body = info.value.body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    return info.value


def sse_payloads(data: bytes) -> list[Any]:
    """Split SSE bytes into decoded JSON payloads ('[DONE]' kept as a string)."""
    events = [e for e in data.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events)
    return [e[6:].decode() if e == SSE_DONE.strip() else json.loads(e[6:]) for e in events]


def test_error_body_shape_and_default_types() -> None:
    assert error_body("x", status=400) == {
        "error": {"message": "x", "type": "invalid_request_error", "param": None, "code": None}
    }
    assert error_body("x", status=503)["error"]["type"] == "server_error"
    assert error_body("x", status=429, code="c")["error"] == {
        "message": "x",
        "type": "rate_limit_error",
        "param": None,
        "code": "c",
    }


def test_chat_conversion_maps_openai_and_vllm_parameters() -> None:
    req = parse_request(
        ChatCompletionRequest,
        chat(
            max_tokens=5,
            max_completion_tokens=7,
            temperature=0,
            top_p=0.5,
            n=2,
            stop="END",
            seed=3,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            logprobs=True,
            top_logprobs=2,
            top_k=-1,
            min_p=0.1,
            repetition_penalty=1.1,
            stop_token_ids=[7],
            ignore_eos=True,
            user="someone",
            messages=[
                {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
        ),
    )
    gen = req.to_generate_request(request_id="rid", cache_namespace="tenant-1")
    s = gen.sampling
    assert gen.request_id == "rid" and gen.model == "m" and gen.cache_namespace == "tenant-1"
    assert gen.messages is not None and gen.messages[0].content == "a\nb"
    assert s.max_tokens == 7  # max_completion_tokens wins over the deprecated max_tokens
    assert (s.temperature, s.top_p, s.n, s.stop, s.seed) == (0, 0.5, 2, ["END"], 3)
    assert (s.presence_penalty, s.frequency_penalty, s.logprobs, s.top_logprobs) == (0.5, -0.5, True, 2)
    assert (s.top_k, s.min_p, s.repetition_penalty, s.stop_token_ids, s.ignore_eos) == (
        0,
        0.1,
        1.1,
        [7],
        True,
    )


def test_defaults_leave_engine_defaults() -> None:
    gen = parse_request(ChatCompletionRequest, chat()).to_generate_request(request_id="r")
    assert gen.sampling.model_dump() == type(gen.sampling)().model_dump()


def test_completion_prompt_forms() -> None:
    for prompt, expected in [("abc", "abc"), ([1, 2], [1, 2]), (["abc"], "abc"), ([[4, 5]], [4, 5])]:
        req = parse_request(CompletionRequest, json.dumps({"model": "m", "prompt": prompt, "logprobs": 3}))
        gen = req.to_generate_request(request_id="r")
        assert gen.prompt == expected
        assert gen.sampling.logprobs and gen.sampling.top_logprobs == 3
    assert refused(CompletionRequest, '{"model": "m", "prompt": ["a", "b"]}').param == "prompt"
    assert refused(CompletionRequest, '{"model": "m", "prompt": ""}').param == "prompt"


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize(
    ("raw", "param", "fragment"),
    [
        (chat(foo=1), "foo", "Unrecognized request argument supplied: foo"),
        (b'{"model": "m", ', None, "valid JSON"),
        (b"[1, 2]", None, "JSON object"),
        (json.dumps({"model": "m"}).encode(), "messages", "Missing required parameter"),
        (chat(temperature=3), "temperature", "less than or equal to 2"),
        (chat(n=0), "n", "greater than or equal to 1"),
        (chat(functions=[{"name": "f"}]), "functions", "not supported"),
        (chat(logit_bias={"1": 5}), "logit_bias", "not supported"),
        (
            chat(response_format={"type": "xml"}),
            "response_format.type",
            "'text', 'json_object' or 'json_schema'",
        ),
        (
            chat(response_format={"type": "json_schema"}),
            "response_format.json_schema",
            "is required with type",
        ),
        (chat(tool_choice="required"), "tool_choice", "only allowed when 'tools' are specified"),
        (
            chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice=_named("g")),
            "tool_choice",
            "no function named 'g'",
        ),
        (
            chat(tools=[{"type": "function", "function": {"name": "bad name"}}]),
            "tools.0.function.name",
            "pattern",
        ),
        (chat(messages=[{"role": "tool", "content": "18C"}]), "messages", "tool_call_id"),
        (chat(stream_options={"include_usage": True}), "stream_options", "only allowed when 'stream'"),
        (chat(top_logprobs=2), "top_logprobs", "requires 'logprobs'"),
        (chat(stop=["ok", ""]), "stop", "non-empty"),
        (chat(messages=[{"role": "user", "content": "hi", "extra": 1}]), "messages.0.extra", "Unrecognized"),
        (chat(messages=[]), "messages", "at least 1"),
        (  # issue 18 defect 13: say what is unsupported, not pydantic's union path ("content.str")
            chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages.0.content",
            "'image_url' are not supported: this model takes text input only",
        ),
    ],
)
def test_bad_chat_requests_are_openai_shaped_400s(raw: bytes, param: str | None, fragment: str) -> None:
    err = refused(ChatCompletionRequest, raw)
    assert err.param == param
    assert fragment in err.message


def test_neutral_values_of_unsupported_fields_and_ignored_fields_are_accepted() -> None:
    req = parse_request(
        ChatCompletionRequest,
        chat(tools=[], logit_bias={}, response_format={"type": "text"}, user="u", store=False, metadata={}),
    )
    assert req.model == "m"
    assert refused(CompletionRequest, '{"model": "m", "prompt": "x", "echo": true}').param == "echo"
    assert refused(CompletionRequest, '{"model": "m", "prompt": "x", "best_of": 3}').param == "best_of"
    parse_request(CompletionRequest, '{"model": "m", "prompt": "x", "echo": false, "best_of": 1}')


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_structured_output_and_tools_reach_the_rpc_request() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    gen = parse_request(ChatCompletionRequest, chat(response_format=fmt)).to_generate_request(request_id="r")
    assert gen.json_schema == schema and gen.tools is None
    gen = parse_request(
        ChatCompletionRequest, chat(response_format={"type": "json_object"})
    ).to_generate_request(request_id="r")
    assert gen.json_schema == {"type": "object"}
    raw = chat(tools=[WEATHER_TOOL], tool_choice=_named("get_weather"), parallel_tool_calls=False)
    gen = parse_request(ChatCompletionRequest, raw).to_generate_request(request_id="r")
    assert gen.tools is not None and gen.tools[0].function.name == "get_weather"
    assert not isinstance(gen.tool_choice, str) and gen.tool_choice.function.name == "get_weather"
    assert gen.parallel_tool_calls is False
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    ]
    gen = parse_request(
        ChatCompletionRequest, chat(messages=history, tools=[WEATHER_TOOL])
    ).to_generate_request(request_id="r")
    assert gen.messages is not None and gen.messages[1].model_dump()["tool_calls"][0]["id"] == "c1"
    assert gen.messages[2].model_dump()["tool_call_id"] == "c1"


def _call(name: str) -> ToolCall:
    return ToolCall(id=f"call_{name}", name=name, arguments='{"city": "Paris"}')


def test_tool_calls_are_sent_in_openai_shape_streamed_and_whole() -> None:
    req = parse_request(ChatCompletionRequest, chat(stream=True, tools=[WEATHER_TOOL]))
    fmt = StreamFormatter(req, request_id="t", created=1)
    out = fmt.frame(
        DeltaFrame(text="", token_ids=[1], tool_calls=[_call("get_weather")], finish_reason="tool_calls")
    )
    out += fmt.frame(FinalFrame(finish_reason="tool_calls", prompt_tokens=4, completion_tokens=1))
    chunks = sse_payloads(out)[:-1]
    # As OpenAI streams a call: its id and name, then its arguments as a delta.
    assert chunks[0]["choices"][0]["delta"] == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_get_weather",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ]
    }
    assert chunks[1]["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]
    }
    assert chunks[2]["choices"][0]["finish_reason"] == "tool_calls"

    whole = ResponseAccumulator(
        parse_request(ChatCompletionRequest, chat(tools=[WEATHER_TOOL])), request_id="t"
    )
    whole.add(DeltaFrame(text="", tool_calls=[_call("get_weather")], finish_reason="tool_calls"))
    message = whole.response(FinalFrame(finish_reason="tool_calls", prompt_tokens=4, completion_tokens=1))
    choice = message["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def _lp(token: str, logprob: float) -> TokenLogprob:
    return TokenLogprob(token=token, logprob=logprob, top_logprobs=[TopLogprob(token=token, logprob=logprob)])


def test_chat_stream_chunks_role_content_finish_usage_done() -> None:
    req = parse_request(ChatCompletionRequest, chat(stream=True, stream_options={"include_usage": True}))
    fmt = StreamFormatter(req, request_id="abc", created=1)
    out = fmt.start()
    out += fmt.frame(DeltaFrame(text="Hel", token_ids=[1]))
    out += fmt.frame(DeltaFrame(text="lo", token_ids=[2], finish_reason="stop"))
    out += fmt.frame(FinalFrame(finish_reason="stop", prompt_tokens=4, cached_tokens=2, completion_tokens=2))
    events = sse_payloads(out)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["id"] == "chatcmpl-abc" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:3]] == ["Hel", "lo"]
    assert chunks[3]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert chunks[4]["choices"] == []
    assert chunks[4]["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 2},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def test_stream_without_include_usage_and_finish_from_final_frame() -> None:
    req = parse_request(ChatCompletionRequest, chat(stream=True, n=2))
    fmt = StreamFormatter(req, request_id="abc", created=1)
    out = fmt.start() + fmt.frame(DeltaFrame(index=1, text="x"))
    out += fmt.frame(
        FinalFrame(
            finish_reason="length", finish_reasons=["stop", "length"], prompt_tokens=1, completion_tokens=1
        )
    )
    events = sse_payloads(out)
    assert [c["index"] for c in events[0]["choices"]] == [0, 1]
    finishes = [c["choices"][0] for c in events[1:-1] if c["choices"][0]["finish_reason"]]
    assert [(c["index"], c["finish_reason"]) for c in finishes] == [(0, "stop"), (1, "length")]
    assert not any("usage" in e for e in events[:-1])


def test_stream_error_frame_becomes_error_event_then_done() -> None:
    req = parse_request(ChatCompletionRequest, chat(stream=True))
    fmt = StreamFormatter(req, request_id="abc")
    events = sse_payloads(fmt.frame(ErrorFrame(message="boom", status=500, completion_tokens=3)))
    assert events == [error_body("boom", status=500, code="engine_error"), "[DONE]"]


def test_completion_stream_chunks_and_logprob_offsets() -> None:
    req = parse_request(CompletionRequest, '{"model": "m", "prompt": "p", "stream": true, "logprobs": 1}')
    fmt = StreamFormatter(req, request_id="abc", created=1)
    assert fmt.start() == b""
    out = fmt.frame(DeltaFrame(text="ab", logprobs=[_lp("ab", -0.5)]))
    out += fmt.frame(DeltaFrame(text="c", logprobs=[_lp("c", -1.0)], finish_reason="length"))
    out += fmt.frame(FinalFrame(finish_reason="length", prompt_tokens=1, completion_tokens=2))
    events = sse_payloads(out)
    assert [e["object"] for e in events[:-1]] == ["text_completion"] * 2
    first, last = events[0]["choices"][0], events[1]["choices"][0]
    assert (first["text"], first["finish_reason"]) == ("ab", None)
    assert (last["text"], last["finish_reason"]) == ("c", "length")
    assert last["logprobs"] == {
        "tokens": ["c"],
        "token_logprobs": [-1.0],
        "top_logprobs": [{"c": -1.0}],
        "text_offset": [2],
    }


def test_non_streaming_chat_response_always_has_usage() -> None:
    req = parse_request(ChatCompletionRequest, chat(logprobs=True, top_logprobs=1))
    acc = ResponseAccumulator(req, request_id="abc", created=5)
    acc.add(DeltaFrame(text="Hel", logprobs=[_lp("Hel", -0.1)]))
    acc.add(DeltaFrame(text="lo", logprobs=[_lp("lo", -0.2)]))
    body = acc.response(FinalFrame(finish_reason="length", prompt_tokens=3, completion_tokens=2))
    assert body["id"] == "chatcmpl-abc" and body["object"] == "chat.completion" and body["created"] == 5
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello"}
    assert choice["finish_reason"] == "length"
    assert [c["token"] for c in choice["logprobs"]["content"]] == ["Hel", "lo"]
    assert body["usage"]["total_tokens"] == 5 and body["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0
    }


def test_non_streaming_completion_response() -> None:
    req = parse_request(CompletionRequest, '{"model": "m", "prompt": "p", "n": 2}')
    acc = ResponseAccumulator(req, request_id="abc")
    acc.add(DeltaFrame(index=0, text="a", finish_reason="stop"))
    acc.add(DeltaFrame(index=1, text="b"))
    body = acc.response(
        FinalFrame(
            finish_reason="length", finish_reasons=["stop", "length"], prompt_tokens=1, completion_tokens=2
        )
    )
    assert body["object"] == "text_completion" and body["id"] == "cmpl-abc"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "a", "stop"),
        (1, "b", "length"),
    ]


def test_reasoning_goes_out_apart_from_content_streamed_and_whole() -> None:
    frames = [
        DeltaFrame(reasoning="Think", token_ids=[1, 2]),
        DeltaFrame(reasoning="ing.", text="Paris", token_ids=[3]),
        DeltaFrame(text=".", token_ids=[4], finish_reason="stop"),
    ]
    final = FinalFrame(finish_reason="stop", prompt_tokens=5, completion_tokens=4, reasoning_tokens=3)
    req = parse_request(ChatCompletionRequest, chat(stream=True, stream_options={"include_usage": True}))
    fmt = StreamFormatter(req, request_id="t", created=1)
    chunks = sse_payloads(b"".join(fmt.frame(f) for f in [*frames, final]))[:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert [d.get("reasoning_content") for d in deltas if "reasoning_content" in d] == ["Think", "ing."]
    assert "".join(d.get("content", "") for d in deltas) == "Paris."
    assert all(not ("reasoning_content" in d and "content" in d) for d in deltas)
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}

    whole = ResponseAccumulator(parse_request(ChatCompletionRequest, chat()), request_id="t")
    for frame in frames:
        whole.add(frame)
    body = whole.response(final)
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Paris.",
        "reasoning_content": "Thinking.",
    }
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}


def test_thinking_switches_reach_the_template() -> None:
    kwargs = {"enable_thinking": True, "custom": 1}
    req = parse_request(ChatCompletionRequest, chat(chat_template_kwargs=kwargs, reasoning_effort="minimal"))
    gen = req.to_generate_request(request_id="r")
    assert gen.chat_template_kwargs == {"reasoning_effort": "minimal", "enable_thinking": True, "custom": 1}
    off = parse_request(ChatCompletionRequest, chat(reasoning_effort="none")).to_generate_request(
        request_id="r"
    )
    assert off.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    assert (
        parse_request(ChatCompletionRequest, chat()).to_generate_request(request_id="r").chat_template_kwargs
        is None
    )
    assert refused(ChatCompletionRequest, chat(reasoning_effort="max")).param == "reasoning_effort"
    assert refused(ChatCompletionRequest, chat(chat_template_kwargs=[1])).param == "chat_template_kwargs"
