"""Reasoning and tool calls in recorded token streams, as the engine's output assembly feeds them:
one token's text at a time, the think block split off first, tool calls looked for in the answer.

The streams are what the models write (Qwen3's ``<think>`` is one token; SmolLM2's tokenizer splits
it), so each case is one a small model on the test machine cannot be made to write on demand.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.structured.grammar import GrammarCompiler, lark_json
from engine.structured.reasoning import ReasoningParser, ThinkingMode, after_thinking, thinking_mode
from engine.structured.tool_calls import ToolCall, ToolCallFormat, ToolCallParser
from engine.tokenizer import Tokenizer

QWEN3_ANSWER = ["<think>", "\n", "The", " user", " asks", ".", "\n", "</think>", "\n\n", "Paris", "."]
QWEN3_CALL = [
    *["<think>", "\n", "I", " should", " use", " <tool_call>", " here", ".\n", "</think>", "\n\n"],
    *[
        "<tool_call>",
        "\n",
        '{"name": "get_weather", ',
        '"arguments": {"city": ',
        '"Paris"}}',
        "\n",
        "</tool_call>",
    ],
]
LLAMA3_CALL = ['{"', "name", '":', ' "', "get", "_weather", '",', ' "parameters', '":', ' {"city": "Paris"}}']


def run(
    texts: list[str], mode: ThinkingMode | None, tools: ToolCallParser | None = None
) -> tuple[str, str, list[ToolCall], int]:
    """(reasoning, content, calls, reasoning tokens), fed as ``ChoiceState.emit`` feeds them."""
    parser = ReasoningParser(mode) if mode is not None else None
    reasoning, content = [], []
    calls: list[ToolCall] = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        thought, answer = ("", text) if parser is None else parser.feed(text)
        if parser is not None and last:
            more = parser.finish()
            thought, answer = thought + more[0], answer + more[1]
        if tools is not None:
            answer = tools.feed(answer)
            if last:
                rest, calls = tools.finish()
                answer += rest
        reasoning.append(thought)
        content.append(answer)
    return "".join(reasoning), "".join(content), calls, parser.reasoning_tokens if parser else 0


FREE = ThinkingMode(opened=False)


def test_qwen3_answer_splits_into_reasoning_and_content() -> None:
    reasoning, content, _, tokens = run(QWEN3_ANSWER, FREE)
    assert (reasoning, content) == ("The user asks.", "Paris.")
    assert tokens == 8  # <think> through </think>: the answer's tokens are not reasoning


def test_markers_split_across_tokens_never_leak() -> None:
    texts = ["<", "th", "ink", ">", "Hmm", " ok", "</", "think", ">", "\n", "Yes", " <", "b>"]
    reasoning, content, _, tokens = run(texts, FREE)
    assert (reasoning, content) == ("Hmm ok", "Yes <b>")
    assert tokens == 9


def test_without_a_think_block_everything_is_content() -> None:
    reasoning, content, _, tokens = run(["\n", "<", "b", ">", "Paris", "</think>"], FREE)
    assert (reasoning, content, tokens) == ("", "\n<b>Paris</think>", 0)


def test_a_template_that_opens_the_block_starts_in_reasoning() -> None:
    prompt = "<｜Assistant｜><think>\n"
    mode = thinking_mode("{{ '<think>' }}{{ '</think>' }}", prompt)
    assert mode == ThinkingMode(opened=True)
    reasoning, content, _, tokens = run(["Let", " me", " see", ".", "</think>", "\n\n", "4"], mode)
    assert (reasoning, content, tokens) == ("Let me see.", "4", 5)


def test_an_unclosed_block_cut_by_max_tokens_is_all_reasoning() -> None:
    reasoning, content, _, tokens = run(["<think>", "\n", "Still", " going", " </thi"], FREE)
    assert (reasoning, content, tokens) == ("Still going </thi", "", 5)


def test_no_thinking_markers_or_thinking_off_means_no_parser() -> None:
    assert thinking_mode("{{ messages }}", "<|im_start|>assistant\n") is None
    assert thinking_mode("<think></think>", "<|im_start|>assistant\n<think>\n\n</think>\n\n") is None
    assert thinking_mode("<think></think>", "<|im_start|>assistant\n") == FREE


def test_hermes_call_after_thinking_and_not_inside_it() -> None:
    tools = ToolCallParser(["get_weather"], ToolCallFormat.HERMES)
    reasoning, content, calls, tokens = run(QWEN3_CALL, FREE, tools)
    assert reasoning == "I should use <tool_call> here."  # mentioned while thinking: not a call
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert tokens == 9


def test_llama3_json_call() -> None:
    tools = ToolCallParser(["get_weather"], ToolCallFormat.LLAMA3_JSON)
    reasoning, content, calls, _ = run(LLAMA3_CALL, None, tools)
    assert (reasoning, content) == ("", "")
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    _, text, none, _ = run(["The", " weather", " is", ' {"name": "x"}'], None, tools)
    assert (text, none) == ('The weather is {"name": "x"}', [])  # prose first: not a call


def test_streamed_pieces_add_up_to_the_whole() -> None:
    parser = ReasoningParser(FREE)
    pieces = [parser.feed(t) for t in QWEN3_ANSWER]
    assert pieces[0] == ("", "") and pieces[2] == ("The", "")  # markers and layout held, text flows
    assert "".join(r for r, _ in pieces) == "The user asks."
    assert "".join(c for _, c in pieces) + parser.finish()[1] == "Paris."


# -- the grammar behind a think block -----------------------------------------------------------


def allowed(matcher: object, vocab: int) -> np.ndarray:
    bits = np.zeros((vocab + 31) // 32, dtype=np.int32)
    matcher.fill_mask(bits, None)  # type: ignore[attr-defined]
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool)


@pytest.fixture(scope="module")
def grammars(default_tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(default_tokenizer, vocab_size=default_tokenizer.vocab_size)


def test_thinking_is_free_then_the_answer_is_constrained(
    grammars: GrammarCompiler, default_tokenizer: Tokenizer
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = grammars.compile(after_thinking(lark_json(schema), FREE, 40), param="response_format")
    tok, vocab = default_tokenizer, default_tokenizer.vocab_size
    matcher = grammar.matcher()
    text = '<think>\nhello {"a": 1} </thi then</think>\n\n{"a": 5}'
    for token in tok.encode(text, add_special_tokens=False):
        assert allowed(matcher, vocab)[token], tok.decode([token])
        matcher.consume_token(token)
    assert matcher.is_stopped()

    # 40 characters of thinking, then only the closing marker may follow.
    matcher = grammar.matcher()
    for token in tok.encode("<think>", add_special_tokens=False):
        matcher.consume_token(token)
    (a,) = tok.encode("a", add_special_tokens=False)
    written = 0
    while allowed(matcher, vocab)[a]:
        matcher.consume_token(a)
        written += 1
    assert written == 40
    after = {tok.decode([t]) for t in np.flatnonzero(allowed(matcher, vocab))}
    assert after and all("</think>".startswith(t) or t.startswith("</think>") for t in after), after
    matcher = grammar.matcher()
    for token in tok.encode("<think>x</think>\n", add_special_tokens=False):
        matcher.consume_token(token)
    assert not allowed(matcher, vocab)[tok.encode("The", add_special_tokens=False)[0]]


def test_opened_block_grammar_has_no_opening_marker(
    grammars: GrammarCompiler, default_tokenizer: Tokenizer
) -> None:
    grammar = grammars.compile(
        after_thinking(lark_json({"type": "object"}), ThinkingMode(opened=True), 40), param="x"
    )
    matcher = grammar.matcher()
    for token in default_tokenizer.encode('ok</think>{"b": 2}', add_special_tokens=False):
        assert allowed(matcher, default_tokenizer.vocab_size)[token]
        matcher.consume_token(token)
    assert matcher.is_stopped()
