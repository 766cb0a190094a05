"""The key format: typed prefix, >= 160 bits of randomness, an offline-checkable CRC32 checksum."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from gateway.keys.format import (
    BASE62,
    CHECKSUM_CHARS,
    RANDOM_CHARS,
    bootstrap_key_problem,
    display_hint,
    generate_key,
    has_valid_checksum,
    hash_key,
    is_plausible_key,
    key_kind,
)


def test_keys_have_typed_prefixes_and_enough_randomness() -> None:
    inference, admin = generate_key("inference"), generate_key("admin")
    assert inference.startswith("tern_sk_") and admin.startswith("tern_ak_")
    assert key_kind(inference) == "inference" and key_kind(admin) == "admin"
    assert RANDOM_CHARS * math.log2(len(BASE62)) >= 160
    assert len({generate_key("inference") for _ in range(200)}) == 200


def test_generated_keys_pass_the_offline_check() -> None:
    for kind in ("inference", "admin"):
        key = generate_key(kind)
        assert has_valid_checksum(key) and is_plausible_key(key)


@given(position=st.integers(min_value=8, max_value=8 + RANDOM_CHARS + CHECKSUM_CHARS - 1), data=st.data())
def test_any_single_character_typo_is_caught(position: int, data: st.DataObject) -> None:
    key = generate_key("inference")
    replacement = data.draw(st.sampled_from([c for c in BASE62 if c != key[position]]))
    typo = key[:position] + replacement + key[position + 1 :]
    assert not has_valid_checksum(typo)
    assert not is_plausible_key(typo)


def test_foreign_strings_are_rejected_before_any_lookup() -> None:
    assert not is_plausible_key("")
    assert not is_plausible_key("sk-short")
    assert not is_plausible_key("tern_sk_" + "a" * 38)  # right shape, wrong checksum
    assert not is_plausible_key("x" * 31)  # too short to be the bootstrap admin key
    assert not is_plausible_key("x" * 40 + " y")  # whitespace is never part of a key
    assert is_plausible_key("x" * 32)  # could be TERN_ADMIN_KEY; the lookup decides


def test_hash_depends_on_the_server_secret_and_hint_shows_only_the_tail() -> None:
    key = generate_key("admin")
    assert hash_key(key, b"secret-one") != hash_key(key, b"secret-two")
    assert len(hash_key(key, b"secret-one")) == 64
    assert display_hint(key) == f"tern_ak_...{key[-4:]}"


def test_bootstrap_key_rules_match_what_can_authenticate() -> None:
    """Issue 18, defect 12: every key the bootstrap accepts passes :func:`is_plausible_key`."""
    unusable = ["tern_admin_" + "0" * 32, "tern_ak_" + "a" * 38, "x" * 31, "x" * 513, "x" * 40 + " y"]
    usable = [
        "x" * 32,
        "operator-chosen-admin-key-0123456789",
        generate_key("admin"),
        generate_key("inference"),
    ]
    for key in unusable:
        assert bootstrap_key_problem(key) is not None and not is_plausible_key(key), key
    for key in usable:
        assert bootstrap_key_problem(key) is None and is_plausible_key(key), key
