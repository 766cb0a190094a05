"""Long prompts of an exact token count, for prefill benchmarks (``tern bench engine --prompt-tokens``).

Each prompt is the bundled calibration text (public domain), repeated to length, behind a line of
its own ("Document 3 of 8, 2048 tokens.") so that no two prompts share a prefix, of one length or
of several, and neither server's prefix cache can serve one from another (with the count alone in
that line, a 2,048-token prompt began with the 512-token one of the same number, and a prefix
cache that kept it served a quarter of the longer prompt). Written as a JSON list of strings, the
file is a ``--prompts`` file for the OpenAI load client that runs Tern and llama-server side by side:

    python -m bench.engine.long_prompts --tokens 2048 --count 4 > /tmp/prompts-2048.json
"""

from __future__ import annotations

import argparse
import json

from engine.loader import load_tokenizer
from engine.tokenizer import Tokenizer


def long_prompts(tokenizer: Tokenizer, num_tokens: int, count: int) -> list[list[int]]:
    """``count`` token-id prompts of exactly ``num_tokens`` tokens each, with distinct first lines."""
    from engine.quantize import default_calibration_text

    body = tokenizer.encode(default_calibration_text())
    prompts = []
    for i in range(count):
        ids = tokenizer.encode(f"Document {i + 1} of {count}, {num_tokens} tokens.\n")
        while len(ids) < num_tokens:
            ids += body[: num_tokens - len(ids)]
        prompts.append(ids[:num_tokens])
    return prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, required=True, help="tokens per prompt")
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--model", help="whose tokenizer counts the tokens (default: the default model)")
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    print(json.dumps([tokenizer.decode(ids) for ids in long_prompts(tokenizer, args.tokens, args.count)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
