"""``/v1/responses`` on the wire: the request as the chat request it amounts to, and frames as events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol.openai.errors import OpenAIRequestError
from protocol.openai.responses_events import ChatChunkFrames, ResponseBuilder, ResponsesStream
from protocol.openai.responses_request import parse_responses_request
from protocol.rpc import DeltaFrame, ErrorFrame, FinalFrame, ToolCall

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}


def parse(**body: Any) -> Any:
    return parse_responses_request(json.dumps({"model": "m"} | body))


def test_input_items_become_the_chat_conversation() -> None:
    request = parse(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Weather in Paris and Rome?"},
            # the SDK's own output items, sent back with their ids, statuses and parsed echoes
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": "{}",
                "status": "completed",
                "parsed_arguments": None,
            },
            {
                "type": "function_call",
                "id": "fc_2",
                "call_id": "c2",
                "name": "get_weather",
                "arguments": "{}",
            },
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": "rain"},
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": "Sunny and rain.", "annotations": [], "logprobs": []}
                ],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        max_output_tokens=50,
        store=False,
    )
    chat = request.to_chat()
    roles = [(m.role, m.tool_call_id) for m in chat.messages]
    assert roles == [
        ("system", None),
        ("user", None),
        ("assistant", None),
        ("tool", "c1"),
        ("tool", "c2"),
        ("assistant", None),
    ]
    assert [c.id for c in chat.messages[2].tool_calls or []] == ["c1", "c2"], "consecutive calls: one turn"
    assert chat.messages[-1].content == "Sunny and rain."
    assert chat.max_tokens == 50 and chat.json_schema() == {"type": "object"}
    assert chat.tools and chat.tools[0].function.name == "get_weather"
    assert chat.tool_choice is not None and not isinstance(chat.tool_choice, str)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "store": True}, "store"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIRequestError) as refused:
        parse(**body).to_chat()
    assert refused.value.status == 400 and refused.value.param == param


def test_reasoning_effort_reaches_the_chat_request_and_reasoning_items_sent_back_are_dropped() -> None:
    request = parse(
        input=[
            {"role": "user", "content": "hi"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "x"}],
            },
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
        ],
        reasoning={"effort": "none"},
    )
    chat = request.to_chat()
    assert chat.reasoning_effort == "none" and len(chat.messages) == 3
    assert chat.to_generate_request(request_id="r").chat_template_kwargs == {
        "reasoning_effort": "none",
        "enable_thinking": False,
    }


def test_built_in_tools_and_images_are_refused_by_name() -> None:
    with pytest.raises(OpenAIRequestError, match="web_search"):
        parse(input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(OpenAIRequestError, match="input_image"):
        parse(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])


def events(stream: ResponsesStream, frames: list[Any]) -> list[dict[str, Any]]:
    raw = stream.start() + b"".join(stream.frame(f) for f in frames)
    out = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        out.append(payload)
    return out


def test_a_stream_of_text_then_a_call_follows_the_documented_sequence() -> None:
    request = parse(input="hi", tools=[WEATHER], stream=True)
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    frames = [
        DeltaFrame(text="Let me check."),
        DeltaFrame(text="", tool_calls=[call], finish_reason="tool_calls"),
        FinalFrame(finish_reason="tool_calls", prompt_tokens=7, cached_tokens=3, completion_tokens=9),
    ]
    sent = events(ResponsesStream(request, request_id="r1"), frames)
    assert [e["type"] for e in sent] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    final = sent[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["call_id"] == "call_1"
    assert sent[8]["output_index"] == 1 and final["usage"] == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 3},
        "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 16,
    }


def test_cut_by_max_output_tokens_is_incomplete_and_an_engine_error_failed() -> None:
    request = parse(input="hi", max_output_tokens=2)
    builder = ResponseBuilder(request, request_id="r2")
    builder.add(DeltaFrame(text="Hello"))
    cut = builder.response(FinalFrame(finish_reason="length", prompt_tokens=1, completion_tokens=2))
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["content"][0]["text"] == "Hello" and cut["store"] is False
    error = ErrorFrame(message="boom", code="engine_error", status=500, completion_tokens=1)
    sent = events(ResponsesStream(request, request_id="r3"), [DeltaFrame(text="Hi"), error])
    assert sent[-1]["type"] == "response.failed" and sent[-1]["response"]["error"]["message"] == "boom"


def test_an_openai_servers_streamed_calls_are_put_together_by_index() -> None:
    reader = ChatChunkFrames()
    pieces = [
        {"choices": [{"index": 0, "delta": {"content": "Checking."}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_a",
                                "function": {"name": "get_weather", "arguments": '{"ci'},
                            }
                        ]
                    },
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 1, "id": "call_b", "function": {"name": "get_time", "arguments": "{}"}}
                        ]
                    },
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}]},
                }
            ]
        },
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    frames = [frame for chunk in pieces for frame in reader.frames(chunk)]
    assert [f.text for f in frames] == ["Checking.", ""] and reader.finish_reason == "tool_calls"
    calls = frames[-1].tool_calls or []
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("call_a", "get_weather", '{"city": "Rome"}'),
        ("call_b", "get_time", "{}"),
    ]
    whole = {
        "choices": [
            {
                "message": {
                    "content": None,
                    "tool_calls": [
                        {"id": "call_c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ]
    }
    frame = ChatChunkFrames().answer(whole)
    assert frame.text == "" and [c.id for c in frame.tool_calls or []] == ["call_c"]


def test_reasoning_is_an_item_of_its_own_before_the_message() -> None:
    frames = [
        DeltaFrame(reasoning="Hmm.", token_ids=[1]),
        DeltaFrame(text="Paris", token_ids=[2]),
        DeltaFrame(text=".", token_ids=[3], finish_reason="stop"),
        FinalFrame(finish_reason="stop", prompt_tokens=5, completion_tokens=3, reasoning_tokens=1),
    ]
    stream = ResponsesStream(parse(input="hi", stream=True), request_id="r", created=1)
    sent = events(stream, frames)
    kinds = [e["type"] for e in sent]
    assert kinds[2:6] == [
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
    ]
    assert sent[2]["item"]["type"] == "reasoning" and sent[3]["delta"] == "Hmm."
    added = [e for e in sent if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [(0, "reasoning"), (1, "message")]
    assert {e["output_index"] for e in sent if e["type"] == "response.output_text.delta"} == {1}
    final = sent[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Hmm."}]
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 1}

    whole = ResponseBuilder(parse(input="hi"), request_id="r")
    for frame in frames[:-1]:
        whole.add(frame)  # type: ignore[arg-type]
    body = whole.response(frames[-1])  # type: ignore[arg-type]
    assert body["output"] == final["output"]


def test_an_openai_servers_reasoning_content_becomes_reasoning_frames() -> None:
    frames = ChatChunkFrames().frames({"choices": [{"delta": {"reasoning_content": "x", "content": "y"}}]})
    assert [(f.reasoning, f.text) for f in frames] == [("x", ""), (None, "y")]
