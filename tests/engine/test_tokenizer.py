"""Our tokenizer against transformers' AutoTokenizer: from the default GGUF and from a tokenizer.json dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import pytest

from engine.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "The year 2024 had 366 days; π ≈ 3.14159.",
    "héllo wörld — naïve café, Straße",
    "emoji 🤖🎉👩‍👩‍👧 and 日本語のテキスト, 한국어, العربية",
    "tabs\tand\n\nnewlines   triple   spaces\r\n",
    "can't won't I'll they've",
    "def f(x):\n    return x ** 2  # code",
    "",
]
TEXTS_WITH_SPECIALS = ["<|im_start|>user\nhi<|im_end|>\n", "a<|endoftext|>b"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and ∞ − 1?"},
    ],
]


@pytest.fixture(scope="module")
def hf_dir_tokenizer(hf_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_tokenizer_dir)


@pytest.fixture(scope="module", params=["gguf", "hf_dir"])
def pair(
    request: pytest.FixtureRequest,
    default_tokenizer: Tokenizer,
    hf_gguf_tokenizer: Any,
    hf_tokenizer_dir: Path,
    hf_dir_tokenizer: Any,
) -> tuple[Tokenizer, Any]:
    """(ours, transformers') built from the same source."""
    if request.param == "gguf":
        return default_tokenizer, hf_gguf_tokenizer
    return Tokenizer.from_hf_dir(hf_tokenizer_dir), hf_dir_tokenizer


@pytest.mark.parametrize("text", TEXTS + TEXTS_WITH_SPECIALS)
def test_encode_matches_transformers(pair: tuple[Tokenizer, Any], text: str) -> None:
    ours, hf = pair
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(pair: tuple[Tokenizer, Any], text: str) -> None:
    ours, hf = pair
    ids = hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS_WITH_SPECIALS)
def test_decode_keeps_special_tokens_on_request(pair: tuple[Tokenizer, Any], text: str) -> None:
    ours, hf = pair
    ids = hf.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False) == text


def test_decode_skips_control_tokens(default_tokenizer: Tokenizer) -> None:
    # transformers' GGUF conversion keeps them even with skip_special_tokens=True; llama.cpp and the
    # original tokenizer.json treat them as special, and so do we.
    ids = default_tokenizer.encode("<|im_start|>assistant\nParis<|im_end|>")
    assert default_tokenizer.decode(ids) == "assistant\nParis"


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    pair: tuple[Tokenizer, Any], conversation: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    ours, hf = pair
    prompt = add_generation_prompt
    expected = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
    assert ours.apply_chat_template(conversation, add_generation_prompt=prompt) == expected
    expected_ids = hf.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert ours.encode_chat(conversation, add_generation_prompt=add_generation_prompt) == list(expected_ids)


# Exercises what transformers adds to jinja: tojson (no HTML escaping), raise_exception,
# loop controls, namespace, the special-token variables and trim/lstrip of block whitespace.
FEATURE_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% if tools %}Tools: {{ tools | tojson }}
{% endif %}
{% for m in messages %}
    {% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
    {% if m.content == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
[{{ ns.n }}:{{ m.role }}] {{ m.content }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}[assistant]{% endif %}"""


def test_template_features_match_transformers(default_tokenizer: Tokenizer, hf_gguf_tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "a <b> & 'c'"},
        {"role": "assistant", "content": "skip"},
        {"role": "user", "content": "ünï"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "<city> weather"}}]
    special = default_tokenizer.special_tokens
    ours = Tokenizer(default_tokenizer.backend, special_tokens=special, chat_template=FEATURE_TEMPLATE)
    expected = hf_gguf_tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=FEATURE_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(messages, tools=tools) == expected
    assert '"<city> weather"' in expected

    with pytest.raises(jinja2.TemplateError, match="bad role system"):
        ours.apply_chat_template([{"role": "system", "content": "x"}])


def test_model_without_template_gives_clear_error(default_tokenizer: Tokenizer) -> None:
    bare = Tokenizer(default_tokenizer.backend, special_tokens=default_tokenizer.special_tokens)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_special_token_ids(default_tokenizer: Tokenizer, hf_gguf_tokenizer: Any) -> None:
    assert default_tokenizer.bos_token_id == hf_gguf_tokenizer.bos_token_id
    assert default_tokenizer.eos_token_id == hf_gguf_tokenizer.eos_token_id
    assert default_tokenizer.eos_token_ids == (hf_gguf_tokenizer.eos_token_id,)
    assert default_tokenizer.vocab_size == len(hf_gguf_tokenizer)


def test_eos_ids_combine_model_config_and_tokenizer(default_tokenizer: Tokenizer) -> None:
    special = default_tokenizer.special_tokens
    tok = Tokenizer(default_tokenizer.backend, special_tokens=special, eos_token_ids=(0,))
    assert tok.eos_token_ids == (0, default_tokenizer.eos_token_id)


def test_digits_split_individually_like_llama_cpp(default_tokenizer: Tokenizer) -> None:
    # GGUF pre-tokenizer "smollm" splits every digit before GPT-2's regex.
    ids = default_tokenizer.encode("12345", add_special_tokens=False)
    assert [default_tokenizer.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]


def test_hf_dir_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_phi4_minis_gpt4o_split() -> None:
    """Phi-4-mini's GGUF says pre-tokenizer "gpt-4o" (o200k's regex): camel case and contractions stay
    with their word, numbers go three digits at a time; GPT-2's regex, the fallback, does neither."""
    from tests.engine.test_loader_gguf import BYTE_TOKENS

    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": BYTE_TOKENS,
        "tokenizer.ggml.merges": [],
    }
    text = "HelloWorld's 12345 don't"
    pieces = {}
    for pre in ("gpt-4o", "gpt2"):
        backend = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": pre}).backend
        assert backend.pre_tokenizer is not None
        pieces[pre] = [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
    assert pieces["gpt-4o"] == ["Hello", "World's", "Ġ", "123", "45", "Ġdon't"]
    assert pieces["gpt2"] == ["HelloWorld", "'s", "Ġ12345", "Ġdon", "'t"]


def test_unknown_pre_tokenizer_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """An unknown `tokenizer.ggml.pre` falls back to GPT-2's split, which may cut text differently from
    the model's own: the log says so, once per load; known names and GPT-2's own say nothing."""
    from tests.engine.test_loader_gguf import BYTE_TOKENS

    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": BYTE_TOKENS,
        "tokenizer.ggml.merges": [],
    }
    for pre in ("gpt-2", "smollm", "llama-bpe", "qwen2"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": pre})
    assert not [r for r in caplog.records if "pre-tokenizer" in r.getMessage()]
    with caplog.at_level("WARNING", logger="engine.tokenizer"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": "some-new-model"})
        Tokenizer.from_gguf_metadata(metadata)  # no pre at all: an old conversion
    warned = [r.getMessage() for r in caplog.records if "pre-tokenizer" in r.getMessage()]
    assert len(warned) == 2 and "'some-new-model' is unknown" in warned[0] and "None is unknown" in warned[1]
