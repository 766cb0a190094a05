"""Bounded JSON: numbers a small model cannot run on with forever.

llguidance's JSON grammar lets an integer or a number take any number of digits, and a small model
at temperature 0.7 sometimes takes that road (a 190-digit population, written until ``max_tokens``,
that never parses). Two bounds close it, unless the schema bounds the value itself:

- **integers** stay within int64: a schema ``integer`` without its own ``minimum``/``maximum`` gets
  ``±INT64_BOUND`` (:func:`with_integer_bounds`), so the grammar itself allows at most 19 digits;
- **numbers** stay within double precision: at most :data:`MAX_INT_DIGITS` digits before the point,
  :data:`MAX_SIGNIFICANT` significant digits (and as many fraction digits in all) once it has a
  fraction, :data:`MAX_EXPONENT_DIGITS` exponent digits. llguidance's number lexeme cannot be
  bounded from the schema, so :class:`BoundedMatcher` follows the JSON being written, character by
  character, and clears the tokens that would break a bound from the grammar's mask.

Whitespace needs no guard here: Tern's JSON grammar allows none between tokens
(``grammar.JSON_OPTIONS``). The bounds never make an answer impossible: where they would forbid
everything the grammar allows (a schema ``const`` of 30 digits), the grammar's mask stands alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.structured.json_closing import closing_text

if TYPE_CHECKING:
    import llguidance  # the matchers and tokenizers passed in are llguidance's (grammar.py imports it)

INT64_BOUND = 2**63 - 1024
"""The largest double below 2**63: llguidance reads schema bounds as doubles, so this is the widest
int64 range it can hold exactly (int64's own ends round up past it)."""
MAX_INT_DIGITS = 19
MAX_SIGNIFICANT = 17
MAX_EXPONENT_DIGITS = 3

_NOT_SCHEMAS = frozenset({"const", "enum", "default", "examples", "x-guidance"})
"""Keys whose values are data, not subschemas: left exactly as given."""


def with_integer_bounds(schema: Any) -> Any:
    """``schema`` with every ``integer`` that lacks a bound given ``±INT64_BOUND`` on that side."""
    if isinstance(schema, list):
        return [with_integer_bounds(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _NOT_SCHEMAS else with_integer_bounds(v) for k, v in schema.items()}
    types = out.get("type")
    if types == "integer" or (isinstance(types, list) and "integer" in types):
        low = out.get("minimum", out.get("exclusiveMinimum"))
        high = out.get("maximum", out.get("exclusiveMaximum"))
        if low is None and (high is None or _number(high) >= -INT64_BOUND):
            out["minimum"] = -INT64_BOUND
        if high is None and (low is None or _number(low) <= INT64_BOUND):
            out["maximum"] = INT64_BOUND
    return out


def _number(value: Any) -> float:
    return value if isinstance(value, int | float) else 0.0


# -- following the JSON as it is written --------------------------------------------------------

# A lexical state: (mode, integer digits, fraction digits, significant digits, exponent digits).
_OUT, _STRING, _ESCAPE, _INT, _FRACTION, _EXP_START, _EXP = range(7)
State = tuple[int, int, int, int, int]
START: State = (_OUT, 0, 0, 0, 0)
_DIGITS = frozenset(b"0123456789")


def advance(state: State, data: bytes) -> tuple[State, bool]:
    """The state after ``data``, and whether ``data`` kept within the bounds (a point after the last
    significant digit allowed does not: no digit could follow it)."""
    mode, whole, fraction, significant, exponent = state
    within = True
    for byte in data:
        if mode == _STRING:
            mode = _OUT if byte == 0x22 else _ESCAPE if byte == 0x5C else _STRING
            continue
        if mode == _ESCAPE:
            mode = _STRING
            continue
        if byte in _DIGITS:
            if mode == _OUT:
                mode, whole, fraction, significant, exponent = _INT, 1, 0, int(byte != 0x30), 0
            elif mode in (_INT, _FRACTION):
                significant += int(significant > 0 or byte != 0x30)
                if mode == _INT:
                    whole += 1
                else:
                    fraction += 1
                if whole > MAX_INT_DIGITS or (
                    mode == _FRACTION and max(significant, fraction) > MAX_SIGNIFICANT
                ):
                    within = False
            else:  # an exponent
                mode, exponent = _EXP, exponent + 1
                within = within and exponent <= MAX_EXPONENT_DIGITS
            continue
        if mode == _INT and byte == 0x2E:  # the point: only with room for a digit after it
            within = within and significant < MAX_SIGNIFICANT
            mode = _FRACTION
        elif mode in (_INT, _FRACTION) and byte in (0x65, 0x45):
            mode = _EXP_START
        elif mode == _EXP_START and byte in (0x2B, 0x2D):
            pass
        elif mode == _OUT and byte == 0x2D:  # a minus sign starts a number
            mode, whole, fraction, significant, exponent = _INT, 0, 0, 0, 0
        else:
            mode = _STRING if byte == 0x22 else _OUT
    return (mode, whole, fraction, significant, exponent), within


class NumberBounds:
    """The vocabulary's view of the bounds: which tokens each lexical state forbids (cached by state),
    and how text is tokenized (to force the closing of a ``json_object`` answer, json_closing)."""

    def __init__(self, token_bytes: Sequence[bytes], tokenize: Callable[[bytes], list[int]]) -> None:
        self.token_bytes = token_bytes
        self.tokenize = tokenize
        # Only tokens with a digit or a point can break a bound.
        self._candidates = [
            (i, b) for i, b in enumerate(token_bytes) if b"." in b or any(c in _DIGITS for c in b)
        ]
        self._forbidden: dict[State, np.ndarray] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> NumberBounds:
        token_bytes = [
            b"" if tokenizer.is_special_token(i) else tokenizer.decode_bytes([i]) for i in range(vocab_size)
        ]
        return cls(token_bytes, tokenizer.tokenize_bytes)

    def forbidden(self, state: State) -> np.ndarray:
        """The token ids that would break a bound from ``state`` (usually none)."""
        found = self._forbidden.get(state)
        if found is None:
            found = np.array([i for i, b in self._candidates if not advance(state, b)[1]], dtype=np.int64)
            self._forbidden[state] = found
        return found


CLOSING_HORIZON = 48
"""Tokens left below which a closing answer (``closes``) checks whether it must start closing."""
CLOSING_SPARE = 4


class BoundedMatcher:
    """An llguidance matcher whose masks also keep numbers within :class:`NumberBounds`, and, for a
    ``json_object`` answer (``closes``), close it in time for its token budget (json_closing)."""

    __slots__ = ("_bounds", "_closes", "_ends", "_matcher", "_states", "_text")

    def __init__(self, matcher: llguidance.LLMatcher, bounds: NumberBounds, *, closes: bool = False) -> None:
        self._matcher = matcher
        self._bounds = bounds
        self._closes = closes
        self._states: list[State] = [START]
        """The state before each token consumed, then the current one (rollback pops them)."""
        self._text = bytearray()
        self._ends: list[int] = []
        """The text's length after each token consumed (rollback cuts it back)."""

    @property
    def inner(self) -> llguidance.LLMatcher:
        """The llguidance matcher wrapped (the benchmark's baseline)."""
        return self._matcher

    def fill_mask(self, words: np.ndarray, budget: int | None = None) -> None:
        """Write the allowed-token bitmask (llguidance's layout: a bit per token) into ``words``;
        ``budget`` is how many tokens the answer may still take, this one included."""
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        forbidden = self._bounds.forbidden(self._states[-1])
        if forbidden.size:
            kept = words.copy()
            np.bitwise_and.at(words, forbidden >> 5, ~(1 << (forbidden & 31)).astype(np.int32))
            if not words.any():  # the bounds would leave nothing: the grammar alone decides
                words[:] = kept
        if self._closes and budget is not None and budget <= CLOSING_HORIZON:
            self._force_closing(words, budget)

    def _force_closing(self, words: np.ndarray, budget: int) -> None:
        """Allow only the closing's next token once the closing takes about all the tokens left
        (:data:`CLOSING_SPARE` to spare: one token can open more than one token closes)."""
        closing = self._bounds.tokenize(closing_text(bytes(self._text)))
        if not closing or len(closing) + CLOSING_SPARE < budget:
            return
        token = closing[0]
        if words[token >> 5] >> (token & 31) & 1:  # the grammar allows it (it always should)
            words[:] = 0
            words[token >> 5] = np.int32(1 << (token & 31)) if token & 31 != 31 else np.int32(-(2**31))

    def _push(self, token_id: int) -> None:
        self._states.append(self._advance(self._states[-1], token_id)[0])
        if self._closes:
            token_bytes = self._bounds.token_bytes
            self._text += token_bytes[token_id] if token_id < len(token_bytes) else b""
            self._ends.append(len(self._text))

    def _advance(self, state: State, token_id: int) -> tuple[State, bool]:
        token_bytes = self._bounds.token_bytes
        return advance(state, token_bytes[token_id] if token_id < len(token_bytes) else b"")

    def consume_token(self, token_id: int) -> bool:
        if not self._matcher.consume_token(token_id):
            return False
        self._push(token_id)
        return True

    def consume_tokens(self, token_ids: list[int]) -> bool:
        return all(self.consume_token(t) for t in token_ids)

    def try_consume_tokens(self, token_ids: list[int]) -> int:
        """Consume the longest prefix both the grammar and the bounds allow; how many that was."""
        allowed = self.validate_tokens(token_ids)
        consumed = self._matcher.try_consume_tokens(token_ids[:allowed]) if allowed else 0
        for token_id in token_ids[:consumed]:
            self._push(token_id)
        return consumed

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` could be consumed in a row (nothing is consumed)."""
        valid = self._matcher.validate_tokens(token_ids)
        state = self._states[-1]
        for n, token_id in enumerate(token_ids[:valid]):
            state, within = self._advance(state, token_id)
            if not within:
                return n
        return valid

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)
        del self._states[len(self._states) - num_tokens :]
        if self._closes and num_tokens:
            del self._ends[len(self._ends) - num_tokens :]
            del self._text[self._ends[-1] if self._ends else 0 :]

    def compute_ff_tokens(self) -> list[int]:
        return self._matcher.compute_ff_tokens()

    def is_stopped(self) -> bool:
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    def get_error(self) -> str | None:
        return self._matcher.get_error()
