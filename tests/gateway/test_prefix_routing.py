"""The prefix table and the cache-aware policy on their own (no servers): matching, load slack,
tenant isolation, eviction. Real engines: tests/gateway/test_prefix_routing_e2e.py."""

from __future__ import annotations

from gateway.proxy.prefix_routing import (
    ID_BLOCK_TOKENS,
    TEXT_BLOCK_CHARS,
    PrefixTable,
    RoutingParams,
    prefix_keys,
)
from protocol.openai.requests import ChatCompletionRequest, CompletionRequest

SYSTEM = "You are a careful assistant. " * 20


def chat(system: str, question: str, model: str = "m") -> ChatCompletionRequest:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return ChatCompletionRequest.model_validate({"model": model, "messages": messages})


def test_keys_share_a_prefix_exactly_as_far_as_the_prompts_do() -> None:
    a = prefix_keys(chat(SYSTEM, "What is two plus two?" * 4), namespace=None)
    b = prefix_keys(chat(SYSTEM, "Name a colour, any colour." * 4), namespace=None)
    shared = len(SYSTEM) // TEXT_BLOCK_CHARS
    assert a[:shared] == b[:shared] and a[-1] != b[-1]
    assert prefix_keys(chat(SYSTEM, "q", model="other"), namespace=None)[0] != a[0]
    ids = CompletionRequest.model_validate({"model": "m", "prompt": list(range(1, 3 * ID_BLOCK_TOKENS + 5))})
    assert len(prefix_keys(ids, namespace=None)) == 3  # whole blocks only


def test_a_tenant_never_matches_another_tenants_prefixes() -> None:
    table = PrefixTable()
    request = chat(SYSTEM, "hello")
    mine, theirs = prefix_keys(request, namespace="tenant-a"), prefix_keys(request, namespace="tenant-b")
    table.insert(mine, "engine-1")
    assert table.match(mine, ["engine-1", "engine-2"]) == {"engine-1": len(mine)}
    assert table.match(theirs, ["engine-1", "engine-2"]) == {}
    # With nothing to match, the prompt goes to the engine holding the fewest prefixes.
    assert table.choose(theirs, ["engine-1", "engine-2"], [0, 0]) == "engine-2"


def test_the_engine_holding_the_prefix_wins_within_the_load_slack_only() -> None:
    table = PrefixTable(RoutingParams(load_slack=2))
    keys = prefix_keys(chat(SYSTEM, "first"), namespace=None)
    follow_up = prefix_keys(chat(SYSTEM, "second question"), namespace=None)
    table.insert(keys, "hot")
    assert table.choose(follow_up, ["cold", "hot"], [0, 2]) == "hot"
    assert table.choose(follow_up, ["cold", "hot"], [0, 3]) == "cold"  # a hot prefix spills over


def test_a_short_match_does_not_outweigh_load_and_forget_drops_an_engine() -> None:
    table = PrefixTable(RoutingParams(min_match=0.5))
    long_prompt = prefix_keys(chat(SYSTEM[:200], "x" * 2000), namespace=None)
    table.insert(long_prompt[:2], "a")
    table.insert([*long_prompt[:2], 1, 2, 3], "b")  # "b" holds more entries: "a" is the one to spare
    assert table.choose(long_prompt, ["a", "b"], [0, 0]) == "a"
    table.forget("a")
    assert table.match(long_prompt, ["a", "b"]) == {"b": 2}


def test_each_engine_remembers_a_bounded_number_of_prefix_blocks() -> None:
    table = PrefixTable(RoutingParams(max_keys_per_engine=8))
    old = prefix_keys(chat(SYSTEM, "old"), namespace=None)
    new = prefix_keys(chat("Another system prompt entirely. " * 20, "new"), namespace=None)
    table.insert(old, "e")
    table.insert(new, "e")
    assert table.size("e") == 8
    assert table.match(old, ["e"]) == {} and table.match(new, ["e"]) == {"e": 8}
