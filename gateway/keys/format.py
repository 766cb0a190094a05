"""The API key format, modelled on GitHub's tokens.

``tern_sk_`` (inference) or ``tern_ak_`` (admin), then 32 base62 characters of randomness
(~190 bits), then a 6-character base62 CRC32 of everything before it. The checksum lets a
secret scanner recognise a Tern key offline, and lets the gateway reject typos before any
database work. Only ``HMAC-SHA256(TERN_SECRET, key)`` is stored.
"""

from __future__ import annotations

import hmac
import re
import secrets
import string
import zlib

BASE62 = string.digits + string.ascii_uppercase + string.ascii_lowercase
PREFIXES = {"inference": "tern_sk_", "admin": "tern_ak_"}
RANDOM_CHARS = 32
CHECKSUM_CHARS = 6  # 62**6 > 2**32, so any CRC32 fits
KEY_PATTERN = re.compile(rf"tern_(?:sk|ak)_[0-9A-Za-z]{{{RANDOM_CHARS + CHECKSUM_CHARS}}}")

# The bootstrap admin key (TERN_ADMIN_KEY) is any string of 32+ characters chosen by the operator.
BOOTSTRAP_MIN_CHARS = 32
BOOTSTRAP_MAX_CHARS = 512
_PRINTABLE = re.compile(r"[\x21-\x7e]+")


def _base62(number: int, width: int) -> str:
    chars = []
    for _ in range(width):
        number, digit = divmod(number, 62)
        chars.append(BASE62[digit])
    return "".join(reversed(chars))


def checksum(body: str) -> str:
    return _base62(zlib.crc32(body.encode()), CHECKSUM_CHARS)


def generate_key(kind: str) -> str:
    body = PREFIXES[kind] + "".join(secrets.choice(BASE62) for _ in range(RANDOM_CHARS))
    return body + checksum(body)


def has_valid_checksum(key: str) -> bool:
    """True for a well-formed Tern key whose checksum matches (offline, no secret needed)."""
    if not KEY_PATTERN.fullmatch(key):
        return False
    body, check = key[:-CHECKSUM_CHARS], key[-CHECKSUM_CHARS:]
    return hmac.compare_digest(checksum(body), check)


def is_plausible_key(key: str) -> bool:
    """Worth a database lookup: a Tern key with a valid checksum, or a possible bootstrap admin key."""
    if key.startswith("tern_"):
        return has_valid_checksum(key)
    return BOOTSTRAP_MIN_CHARS <= len(key) <= BOOTSTRAP_MAX_CHARS and bool(_PRINTABLE.fullmatch(key))


def bootstrap_key_problem(key: str) -> str | None:
    """Why ``key`` cannot be the bootstrap admin key (``TERN_ADMIN_KEY``), or None if it can.

    The same rules as :func:`is_plausible_key`, so a key accepted here always reaches the lookup.
    """
    if key.startswith("tern_"):
        if has_valid_checksum(key):
            return None
        return (
            "TERN_ADMIN_KEY starts with 'tern_' but is not a key Tern generated (its checksum does not "
            "match); choose a key that does not start with 'tern_'"
        )
    if not BOOTSTRAP_MIN_CHARS <= len(key) <= BOOTSTRAP_MAX_CHARS:
        return f"TERN_ADMIN_KEY must be {BOOTSTRAP_MIN_CHARS} to {BOOTSTRAP_MAX_CHARS} characters long"
    if not _PRINTABLE.fullmatch(key):
        return "TERN_ADMIN_KEY may hold only visible ASCII characters (no spaces)"
    return None


def key_kind(key: str) -> str | None:
    """The kind a Tern key's prefix claims (None for other strings)."""
    for kind, prefix in PREFIXES.items():
        if key.startswith(prefix):
            return kind
    return None


def hash_key(key: str, secret: bytes) -> str:
    """HMAC-SHA256 in hex (``hmac.digest`` is the one-shot form: it runs on every request)."""
    return hmac.digest(secret, key.encode(), "sha256").hex()


def display_hint(key: str) -> str:
    """What lists show instead of the secret: the typed prefix and the last four characters."""
    prefix = next((p for p in PREFIXES.values() if key.startswith(p)), "")
    return f"{prefix}...{key[-4:]}"
