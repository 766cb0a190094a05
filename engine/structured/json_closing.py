"""The shortest text that closes a JSON answer: how ``json_object`` ends within ``max_tokens``.

Without a schema nothing bounds an answer's size, and a small model asked for "a JSON object about
cats" sometimes nests and lists until ``max_tokens`` cuts it, unparseable. A ``json_object`` answer
can always be closed (any JSON value will do), so when the tokens left are about what closing it
takes, its matcher forces the closing (``BoundedMatcher.fill_mask``): the open string ends, a key
gets ``: null``, a number gets its missing digit, and the open objects and arrays close. The
answer is shorter than the model meant, but it parses.
"""

from __future__ import annotations

_WORDS = (b"true", b"false", b"null")
_NUMBER_BYTES = frozenset(b"0123456789.eE+-")


def closing_text(prefix: bytes) -> bytes:
    """What completes ``prefix`` (JSON as Tern's grammar writes it: ``", "`` and ``": "``) to one
    JSON object; an empty prefix gets ``{}``."""
    stack: list[int] = []  # the open brackets, b"{" or b"["
    expect = b"value"  # value | key | key_or_close | value_or_close | colon | after
    in_string = escaped = is_key = False
    hex_left = 0  # the hex digits a \u escape still needs
    number = word = b""
    for byte in prefix:
        if in_string:
            if hex_left:
                hex_left -= 1
            elif escaped:
                escaped, hex_left = False, 4 if byte == 0x75 else 0
            elif byte == 0x5C:
                escaped = True
            elif byte == 0x22:
                in_string, expect = False, b"colon" if is_key else b"after"
            continue
        if number:
            if byte in _NUMBER_BYTES:
                number += bytes([byte])
                continue
            number, expect = b"", b"after"
        if word:
            word += bytes([byte])
            if word in _WORDS:
                word, expect = b"", b"after"
            continue
        if byte in b" \t\r\n":
            continue
        if byte == 0x22:
            in_string, is_key = True, expect in (b"key", b"key_or_close")
        elif byte in b"{[":
            stack.append(byte)
            expect = b"key_or_close" if byte == 0x7B else b"value_or_close"
        elif byte in b"}]":
            if stack:
                stack.pop()
            expect = b"after"
        elif byte == 0x3A:
            expect = b"value"
        elif byte == 0x2C:
            expect = b"key" if stack and stack[-1] == 0x7B else b"value"
        elif byte in b"-0123456789":
            number = bytes([byte])
        elif byte in b"tfn":
            word = bytes([byte])
    if not prefix.strip():
        return b"{}"
    out = _utf8_completion(prefix)
    if in_string:
        out += b"0" * hex_left + (b'n"' if escaped else b'"')
        expect = b"colon" if is_key else b"after"
    elif number:
        if number[-1:] in (b"-", b".", b"e", b"E", b"+"):
            out += b"0"
        expect = b"after"
    elif word:
        out += next(w[len(word) :] for w in _WORDS if w.startswith(word))
        expect = b"after"
    if expect == b"colon":
        out += b": null"
    elif expect == b"key":
        out += b'"": null'
    elif expect == b"value" and stack:
        out += b"null"
    return out + b"".join(b"}" if bracket == 0x7B else b"]" for bracket in reversed(stack))


def _utf8_completion(prefix: bytes) -> bytes:
    """The bytes that finish a character cut inside its UTF-8 encoding (a token can end there)."""
    for back in range(1, min(4, len(prefix)) + 1):
        byte = prefix[-back]
        if byte & 0xC0 != 0x80:  # the character's lead byte
            length = (
                2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
            )
            missing = length - back
            if missing <= 0:
                return b""
            # The smallest continuation valid after this lead byte (E0 and F0 forbid overlong forms).
            second = {0xE0: b"\xa0", 0xF0: b"\x90"}.get(byte, b"\x80") if back == 1 else b"\x80"
            return (second + b"\x80" * (missing - 1))[:missing]
    return b""
