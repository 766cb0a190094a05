"""Output assembly: a request's sampled tokens -> text deltas, tool calls, finish reasons and usage.

The engine loop (``llm_engine.py``) schedules and runs steps; for each token a step samples, it asks
:meth:`ChoiceState.emit` for the choice's delta, which detokenises, holds back partial stop strings,
finds tool calls, and decides whether the choice ends (a stop token, a stop string, a complete
grammar, its token budget). Each of a request's ``n`` choices has its own state here; the request's
usage is summed over them when the last one ends.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.core.outputs import ChoiceDelta, EngineRequest, FinishReason, Logprob, RequestUsage
from engine.core.sampler import SampledToken
from engine.core.sequence import Sequence
from engine.core.stopping import StopStringMatcher
from engine.structured.grammar import grammar_complete
from engine.structured.reasoning import ReasoningParser
from engine.structured.tool_calls import ToolCallParser
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(eq=False)
class ChoiceState:
    """Output-side state of one choice: text assembly and the finish reason."""

    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    tools: ToolCallParser | None = None
    reasoning: ReasoningParser | None = None
    seq: Sequence | None = None
    finish_reason: FinishReason | None = None
    num_tokens: int = 0

    def emit(self, seq: Sequence, token: SampledToken, eos_token_ids: Collection[int]) -> ChoiceDelta:
        """Turn one sampled token into a delta; its ``finish_reason`` says whether the choice is done
        (the caller then ends the choice: :meth:`RequestState.finish` and the scheduler)."""
        sampling = seq.sampling
        token_id = token.token_id
        self.num_tokens += 1
        reason: FinishReason | None = None
        text = ""
        if token_id in sampling.stop_token_ids or (not sampling.ignore_eos and token_id in eos_token_ids):
            reason = "stop"
        else:
            text = self.stop.feed(self.detokenizer.push(token_id))
            if self.stop.stopped:
                reason = "stop"
        if reason is None and seq.matcher is not None and grammar_complete(seq.matcher, token_id):
            reason = "stop"
        if reason is None and self.num_tokens >= seq.max_tokens:  # counted as emitted: drafts run ahead
            reason = "length"
        if reason is not None and not self.stop.stopped:
            # Ending for another reason: release held-back text (a UTF-8 tail, a partial stop string).
            text += self.stop.feed(self.detokenizer.flush())
            text += self.stop.flush()
            if self.stop.stopped:
                reason = "stop"
        thought, text = self._split_reasoning(text, ended=reason is not None)
        tool_calls = None
        if self.tools is not None:
            text = self.tools.feed(text)
            if reason is not None:
                rest, tool_calls = self.tools.finish()
                text += rest
                if tool_calls and reason == "stop":
                    reason = "tool_calls"
        delta = ChoiceDelta(
            index=seq.index,
            token_ids=[token_id],
            text=text,
            reasoning=thought,
            tool_calls=tool_calls or None,
            finish_reason=reason,
        )
        if token.logprob is not None:
            delta.logprobs = [Logprob(token_id, token.logprob, list(token.top_logprobs or []))]
        return delta

    def _split_reasoning(self, text: str, *, ended: bool) -> tuple[str, str]:
        """(reasoning, content) of one token's text; tool calls are looked for in the content only."""
        if self.reasoning is None:
            return "", text
        thought, content = self.reasoning.feed(text)
        if ended:
            more_thought, more_content = self.reasoning.finish()
            thought, content = thought + more_thought, content + more_content
        return thought, content

    @property
    def reasoning_tokens(self) -> int:
        return 0 if self.reasoning is None else self.reasoning.reasoning_tokens


@dataclass(eq=False)
class RequestState:
    """One request in flight: its choices' output state, in choice order."""

    request: EngineRequest
    choices: list[ChoiceState]
    arrival_time: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, request: EngineRequest, tokenizer: Tokenizer) -> RequestState:
        """Fresh output state for each of the request's ``n`` choices (their sequences come later)."""
        prompt, sampling = request.prompt_token_ids, request.sampling
        choices = [
            ChoiceState(
                IncrementalDetokenizer(tokenizer, prompt_ids=prompt),
                StopStringMatcher(list(sampling.stop)),
                tools=request.tool_parser() if request.tool_parser else None,
                reasoning=request.reasoning_parser() if request.reasoning_parser else None,
            )
            for _ in range(sampling.n)
        ]
        return cls(request, choices)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> RequestUsage:
        """The finished request's usage: every choice's tokens, the first choice's cache hit."""
        first = self.choices[0].seq
        return RequestUsage(
            finish_reasons=[c.finish_reason or "abort" for c in self.choices],
            prompt_tokens=len(self.request.prompt_token_ids),
            cached_tokens=first.num_cached_tokens if first else 0,
            completion_tokens=sum(c.num_tokens for c in self.choices),
            reasoning_tokens=sum(c.reasoning_tokens for c in self.choices),
        )
