"""Llama 3.x, Qwen3, SmolLM3, Gemma 3 and Phi-3 on the CPU fast path: a GGUF's linears in their own
blocks, every decode step through the one-call C decoder layers (q/k norm and NoPE layers in C:
layer_rows.c; Phi-3's fused weights and Phi-4-mini's partial rotary; Gemma 3's norms after attention and
the MLP, tanh GeGLU, and its local layers' window, pool and rotary tables), against the same file
dequantized to float32 on the torch path.

Random weights leave near-ties, so the top-1 agreement over 512 teacher-forced decode positions is
compared with what plain Llama's fast path reaches on random weights of the same size
(tests/engine/families_gguf.py, RANDOM_*; Qwen3's heads are 128 wide, so its Llama has 128-wide heads
too), both measured here, over the positions the baseline's precision decides (NEAR_TIE_SIGMAS);
figures in AGREEMENT_MEASURED."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import EngineRequest
from engine.cpu import kernels
from engine.layers.attention import Attention
from engine.layers.context import make_context, reset_context, set_context
from engine.loader import load_model
from engine.loader.linear_factory import CpuKernels, install_cpu_kernels
from engine.models.llama_decode_kernel import DecoderLayersKernel
from protocol.rpc import SamplingParams
from tests.engine.families_gguf import RANDOM_VARIANTS, RANDOM_WINDOW, write_random_family_gguf
from tests.engine.ggml_files import MIXED_TYPES, Q
from tests.engine.test_cpu_kernels import assert_decoder_kernel_is_the_torch_path
from tests.engine.test_loader_gguf import BYTE_TOKENS

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not kernels.available(), reason="the C kernels do not build here"),
]

POSITIONS = 512
BLOCK = 16
# The two type mixes: a Q4_K_M file's (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0) and the 4-bit legacy types.
TYPE_MIXES = {
    "q4_k_m": MIXED_TYPES,
    "q4_0_q4_1": {role: Q.Q4_0 if role in ("attn_q", "attn_k", "ffn_up") else Q.Q4_1 for role in MIXED_TYPES},
}
AGREEMENT_MEASURED = {
    "q4_k_m": {
        "llama": (0.961, 1.0, 373),
        "llama_hd128": (0.969, 1.0, 387),
        "llama3": (0.975, 1.0, 379),
        "qwen3": (0.967, 1.0, 353),
        "smollm3": (0.963, 1.0, 388),
        "gemma3": (1.0, 1.0, 0),
        "phi3": (0.984, 1.0, 378),
    },
    "q4_0_q4_1": {
        "llama": (1.0, 1.0, 511),
        "llama_hd128": (1.0, 1.0, 512),
        "llama3": (1.0, 1.0, 512),
        "qwen3": (1.0, 1.0, 512),
        "smollm3": (1.0, 1.0, 512),
        "gemma3": (1.0, 1.0, 511),
        "phi3": (1.0, 1.0, 511),
    },
}
"""Measured here (AMD EPYC, AVX-512 VNNI: the Q4_K_M mix on the tiles' int8 activations, its Q8_0 and
Q5_0 parts too since they run tiles of their own (before, on int16 rows: 0.980, 0.973, 0.984, 0.973,
0.980, 1.0, 0.990 over all positions, 1.0 over 376-401 decided), Q4_0/Q4_1 on int16): top-1 agreement
with float32 over all 512 positions, over the positions its baseline decides, and how many those are.
Over all positions Qwen3's 0.973 (at int16 Q8_0/Q5_0 rows) is its 128-wide heads, not its q/k norm: a
plain Llama of its shapes lands on the same 0.973, and Qwen3's logit error is no larger (mean
|fast - f32| 0.322 against Llama's 0.325 and 0.335 for the 128-wide Llama); every flip in any family
sits at a float32 top-2 margin under 1.7 logits (of a logit spread of 22; median margin 7.6). Gemma 3's
logits are soft-capped at 30 and its margins narrow (median 0.30): at Q4_K_M none is past what Llama's
int8 activations move a margin by, so its Q4_K_M check counts no position (its own fast path moves
margins 1/100 as far and agrees at all 512, through the C layers); its Q4_0/Q4_1 check counts 511.
Phi-3's reference steps as the fast path does (LongRoPE's factors follow each step's reach)."""
BASELINES = {"qwen3": "llama_hd128"}
"""Each family's plain Llama of the same shapes (else "llama")."""
NEAR_TIE_SIGMAS = 4.0
"""A position whose float32 top-2 margin is under this many standard deviations of the change the
baseline's fast path makes to a top-2 margin (over its 512 positions: 0.80 logits at Q4_K_M, 0.0009
at Q4_0/Q4_1) is a near-tie: which of the two wins is quantization noise at the baseline's precision, not
the model. Left out for the family and its baseline alike; the family must then agree at least as
often as the baseline on what is left, with no allowance: one flip of a decided position more than
the baseline's fails (no flip is measured past 1.7 logits at Q4_K_M; the cut is 3.2, 3.4 for Qwen3's
128-wide Llama). What that catches: a Qwen3 whose normed q/k heads were rounded to 4 bits flips 2
decided positions of its Q4_0/Q4_1 file (int16 activations: the cut is 0.003) and fails; under
Q4_K_M's int8 activations only losses that move margins past the cut fail (q/k rounded to 7 levels:
5 decided flips)."""
MIN_DISTINCT_TOKENS = 32
"""A random model whose float32 top-1 is nearly constant agrees with anything (random Q4_1 blocks'
positive mins once made every family answer one token at all 512 positions)."""


def _teacher_ids() -> list[int]:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, len(BYTE_TOKENS), (POSITIONS + 8,), generator=generator).tolist()


@torch.inference_mode()
def _float32_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """The whole sequence in one uncached causal pass (the torch path, float32)."""
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


def _give_cache(model: nn.Module, blocks: int) -> list[Attention]:
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    config = model.config
    dtype = layers[0].cache_dtype(torch.float32)
    cache = torch.zeros(
        2, len(layers), blocks, BLOCK, config.num_key_value_heads, config.head_dim, dtype=dtype
    )
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    return layers


@torch.inference_mode()
def _decoded_logits(model: nn.Module, ids: list[int], prefill: int) -> torch.Tensor:
    """Logits of positions prefill.. len(ids)-1, each a decode step of one row (the C layers)."""
    blocks = -(-len(ids) // BLOCK)
    _give_cache(model, blocks)
    table = list(range(blocks))
    out = []

    def step(start: int, end: int) -> torch.Tensor:
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
        set_context(
            make_context(
                query_lens=[end - start], context_lens=[end], block_tables=[table], slot_mapping=slots
            )
        )
        try:
            return model.compute_logits(model(torch.tensor(ids[start:end]), torch.arange(start, end)))
        finally:
            reset_context()

    step(0, prefill)
    for position in range(prefill, len(ids)):
        out.append(step(position, position + 1))
    return torch.cat(out)


def _fast(path: Path, variant: str) -> nn.Module:
    loaded = load_model(path, progress=False, keep_gguf_int4=True, keep_gguf_blocks=True)
    assert install_cpu_kernels(loaded.model, CpuKernels.C_F32).steps_in_c, variant
    assert isinstance(loaded.model.model.decode_kernel, DecoderLayersKernel)
    return loaded.model


@pytest.fixture(scope="module")
def random_files(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    folder = tmp_path_factory.mktemp("random_families")
    return {
        (variant, mix): write_random_family_gguf(folder / f"{variant}-{mix}.gguf", variant, types)
        for variant in RANDOM_VARIANTS
        for mix, types in TYPE_MIXES.items()
    }


def _logits(path: Path, variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 and fast-path logits of the 512 teacher-forced positions."""
    ids = _teacher_ids()
    prefill = len(ids) - POSITIONS
    exact_model = load_model(path, progress=False).model
    if variant == "phi3":  # LongRoPE's factors depend on how far each step reaches: step the same way
        exact = _decoded_logits(exact_model, ids, prefill)
    else:
        exact = _float32_logits(exact_model, ids)[prefill:]
    return exact, _decoded_logits(_fast(path, variant), ids, prefill)


def _top2(exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's float32 top-2 tokens [positions, 2] and the margin between them."""
    values, tokens = exact.topk(2, -1)
    return tokens, values[:, 0] - values[:, 1]


def _near_tie(exact: torch.Tensor, fast: torch.Tensor) -> float:
    """NEAR_TIE_SIGMAS standard deviations of how far the fast path moves each float32 top-2 margin."""
    tokens, margin = _top2(exact)
    chosen = fast.gather(1, tokens)
    return NEAR_TIE_SIGMAS * (chosen[:, 0] - chosen[:, 1] - margin).std().item()


def _decided_agreement(exact: torch.Tensor, fast: torch.Tensor, near_tie: float) -> tuple[float, int]:
    """Top-1 agreement over the positions whose float32 margin is at least ``near_tie``, and how many."""
    decided = _top2(exact)[1] >= near_tie
    flips = (decided & (exact.argmax(-1) != fast.argmax(-1))).sum().item()
    counted = int(decided.sum().item())
    return 1.0 - flips / max(counted, 1), counted


@pytest.mark.parametrize("mix", sorted(TYPE_MIXES))
def test_each_family_agrees_with_float32_as_often_as_llama(
    random_files: dict[tuple[str, str], Path], mix: str
) -> None:
    logits = {variant: _logits(random_files[variant, mix], variant) for variant in RANDOM_VARIANTS}
    for variant, (exact, fast) in logits.items():
        assert exact.argmax(-1).unique().numel() >= MIN_DISTINCT_TOKENS, variant
        baseline = BASELINES.get(variant, "llama")
        near_tie = _near_tie(*logits[baseline])
        theirs, counted = _decided_agreement(*logits[baseline], near_tie)
        assert counted >= POSITIONS // 2, (baseline, near_tie)  # the baseline decides most positions
        ours = _decided_agreement(exact, fast, near_tie)
        assert ours[0] >= theirs, (variant, mix, near_tie, ours, theirs)


@pytest.mark.parametrize("variant", ["qwen3", "smollm3", "gemma3", "phi3"])
def test_the_c_layers_are_the_torch_path_bit_for_bit(
    random_files: dict[tuple[str, str], Path], variant: str
) -> None:
    """Decode rows through the one-call C layers (q/k norm, NoPE, Phi-4-mini's partial rotary in C,
    Phi-3's fused weights, Gemma 3's layers) equal the layers' torch path, in a batch of three and alone."""
    assert_decoder_kernel_is_the_torch_path(_fast(random_files[variant, "q4_k_m"], variant))


@pytest.mark.parametrize("variant", ["qwen3", "smollm3", "gemma3", "phi3"])
def test_decode_rows_do_not_depend_on_the_batch_or_threads(
    random_files: dict[tuple[str, str], Path], variant: str
) -> None:
    """Bit for bit alone, in a batch and at 1 or 2 threads; Gemma 3's rows run past its window."""
    model = _fast(random_files[variant, "q4_k_m"], variant)
    length = RANDOM_WINDOW + 16 if variant == "gemma3" else 40
    ids, prefill = _teacher_ids()[:length], length - 10
    alone = _decoded_logits(model, ids, prefill)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(_decoded_logits(model, ids, prefill), alone)
    finally:
        torch.set_num_threads(threads)
    # the same rows as the last of a batch of three sequences: bit for bit
    assert torch.equal(_batched_last_rows(model, ids, prefill), alone)


@torch.inference_mode()
def _batched_last_rows(model: nn.Module, ids: list[int], prefill: int) -> torch.Tensor:
    """``ids`` decoded from ``prefill`` on as the third of three sequences stepping together."""
    others = [_teacher_ids()[100 : 100 + len(ids)], _teacher_ids()[200 : 200 + len(ids)]]
    sequences = [*others, ids]
    per = -(-len(ids) // BLOCK)
    _give_cache(model, per * len(sequences))
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(sequences))]

    def step(chosen: list[int], start: int, end: int) -> torch.Tensor:
        """Positions start..end-1 of each chosen sequence, in one step."""
        set_context(
            make_context(
                query_lens=[end - start] * len(chosen),
                context_lens=[end] * len(chosen),
                block_tables=[tables[c] for c in chosen],
                slot_mapping=[
                    tables[c][p // BLOCK] * BLOCK + p % BLOCK for c in chosen for p in range(start, end)
                ],
            )
        )
        tokens = [t for c in chosen for t in sequences[c][start:end]]
        positions = [p for _ in chosen for p in range(start, end)]
        try:
            return model.compute_logits(model(torch.tensor(tokens), torch.tensor(positions)))
        finally:
            reset_context()

    for chosen in range(3):  # each prompt alone, as the engine prefills
        step([chosen], 0, prefill)
    return torch.stack([step([0, 1, 2], p, p + 1)[2] for p in range(prefill, len(ids))])


def test_gemma3_c_layers_are_the_torch_path_with_a_local_pool(
    random_files: dict[tuple[str, str], Path],
) -> None:
    """As the model runner lays Gemma 3 out: its local layers' K/V in a pool of their own, through other
    block tables, whose blocks out of every row's window are freed (-1, as the block manager leaves them).
    Decode rows past the window through the C layers (local rotary tables, window, local slots and tables)
    equal the torch path bit for bit, two sequences together and one alone, and the C layers take every
    one of those steps."""
    model = _fast(random_files["gemma3", "q4_k_m"], "gemma3")
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    local = [a for a in attention if a.window is not None]
    full = [a for a in attention if a.window is None]
    assert local and full and model.model.local_layers
    for layers in (full, local):
        heads, dim = model.config.num_key_value_heads, model.config.head_dim
        pool = torch.zeros(2, len(layers), 16, BLOCK, heads, dim, dtype=local[0].cache_dtype(torch.float32))
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = pool[0, i], pool[1, i]
    sequences = [_teacher_ids()[:100], _teacher_ids()[200:300]]
    tables = [list(range(7)), list(range(7, 14))]
    local_tables = [list(range(13, 6, -1)), list(range(6, -1, -1))]  # other blocks, in another order
    kernel = model.model.decode_kernel
    took: list[bool] = []

    def counted(*args: object) -> torch.Tensor | None:
        out = kernel(*args)
        took.append(out is not None)
        return out

    @torch.inference_mode()
    def step(chosen: list[int], starts: list[int], length: int) -> torch.Tensor:
        """``length`` new tokens of each chosen sequence from its start on."""
        spans = [(c, p) for c, s in zip(chosen, starts, strict=True) for p in range(s, s + length)]
        reach = [start + length - RANDOM_WINDOW for start in starts]  # the first position in the window
        set_context(
            make_context(
                query_lens=[length] * len(chosen),
                context_lens=[start + length for start in starts],
                block_tables=[tables[c] for c in chosen],
                slot_mapping=[tables[c][p // BLOCK] * BLOCK + p % BLOCK for c, p in spans],
                local_block_tables=[  # a local block whose every position has left the window: freed
                    [-1 if (b + 1) * BLOCK <= first else block for b, block in enumerate(local_tables[c])]
                    for c, first in zip(chosen, reach, strict=True)
                ],
                local_slot_mapping=[local_tables[c][p // BLOCK] * BLOCK + p % BLOCK for c, p in spans],
            )
        )
        tokens, positions = [sequences[c][p] for c, p in spans], [p for _, p in spans]
        try:
            return model(torch.tensor(tokens), torch.tensor(positions))
        finally:
            reset_context()

    step([0], [0], 70)  # the prompts, alone, through the torch layers
    step([1], [0], 90)
    decodes = [([0, 1], [70 + i, 90 + i]) for i in range(4)] + [([1], [94 + i]) for i in range(3)]
    for chosen, starts in decodes:
        model.model.decode_kernel = counted
        fused = step(chosen, starts, 1)
        model.model.decode_kernel = None
        try:
            assert torch.equal(fused, step(chosen, starts, 1)), (chosen, starts)
        finally:
            model.model.decode_kernel = kernel
    assert took == [True] * len(decodes)


def test_gemma3_through_the_engine_takes_the_c_layers_past_the_window(
    random_files: dict[tuple[str, str], Path],
) -> None:
    """Through ``LLMEngine``: the model runner's pool of the local layers' own, whose blocks out of the
    window go back to it as the sequence runs, and speculation's draft rows. Greedy tokens over 6 windows on
    the C layers equal those of the torch layers over the same C linears and attention, and the C layers
    took every decode step."""
    loaded = load_model(
        random_files["gemma3", "q4_k_m"], progress=False, keep_gguf_int4=True, keep_gguf_blocks=True
    )
    assert install_cpu_kernels(loaded.model, CpuKernels.C_F32).steps_in_c
    kernel = loaded.model.model.decode_kernel
    took: list[bool] = []

    def counted(*args: object) -> torch.Tensor | None:
        out = kernel(*args)
        took.append(out is not None)
        return out

    prompt, tokens = _teacher_ids()[: 2 * RANDOM_WINDOW], 4 * RANDOM_WINDOW

    def greedy(decode_kernel: object) -> list[int]:
        loaded.model.model.decode_kernel = decode_kernel
        config = EngineConfig(
            device="cpu", block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=256, num_threads=1
        )
        engine = LLMEngine(
            config, model=loaded.model, tokenizer=loaded.tokenizer, model_config=loaded.config, model_name="g"
        )
        assert engine.runner.local_kv_cache is not None
        sampling = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        out = engine.generate([EngineRequest(request_id="r", prompt_token_ids=prompt, sampling=sampling)])
        return [t for delta in out["r"].deltas for t in delta.token_ids]

    fused = greedy(counted)
    # every step but the prompt's (fewer steps than tokens: n-gram drafts are rows of a decode step too)
    assert len(fused) == tokens and took[0] is False and len(took) > 1 and all(took[1:])
    assert fused == greedy(None)
