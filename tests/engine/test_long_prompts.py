"""The long-prompt benchmark's prompts: exact length, no shared prefix (so no prefix cache helps)."""

from bench.engine.long_prompts import long_prompts
from engine.loader import load_tokenizer


def test_long_prompts_have_the_exact_length_and_no_common_prefix() -> None:
    tokenizer = load_tokenizer()
    prompts = long_prompts(tokenizer, 700, 3)
    assert [len(p) for p in prompts] == [700, 700, 700]
    first_lines = {tuple(p[:16]) for p in prompts + long_prompts(tokenizer, 300, 3)}
    assert len(first_lines) == 6  # they differ in the first 16-token block of the cache, across lengths too
    # Sent as text to OpenAI servers: re-encoding the decoded text keeps the length (within a few tokens).
    for ids in prompts:
        assert abs(len(tokenizer.encode(tokenizer.decode(ids))) - 700) <= 7
