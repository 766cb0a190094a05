"""The CPU KV pool commits memory only where tokens are written."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.core.model_runner import _zeroed_pool, release_block_pages


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))


def test_cpu_pool_is_zeros_and_a_written_token_costs_pages_not_huge_pages() -> None:
    # the default model's layout: [k/v, layer, blocks, block size, kv heads, head dim], 96 MiB here
    pool = _zeroed_pool((2, 30, 128, 16, 3, 64), torch.float16, torch.device("cpu"))
    assert pool.shape == (2, 30, 128, 16, 3, 64) and pool.dtype == torch.float16
    before = _rss_anon_kib()
    pool[:, :, 0, 0] = 1.0  # one token in every layer's keys and values: 60 separate regions
    grown_mib = (_rss_anon_kib() - before) / 1024
    # 60 pages of 4 KiB; with 2 MiB transparent huge pages it was 120 MiB
    assert grown_mib < 16, grown_mib
    assert pool[:, :, 1:].count_nonzero() == 0 and pool[:, :, 0, 0].eq(1).all()


def _mapping_rss_kib(address: int) -> int:
    """Resident KiB of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "Rss:":
                return int(fields[1])
    raise AssertionError("no mapping holds the pool")


def test_free_blocks_pages_are_given_back_and_read_as_zeros() -> None:
    # 4 KiB blocks (16 tokens x 2 heads x 64 dims, float16): each block is a page in each of 6 regions
    pool = _zeroed_pool((2, 3, 64, 16, 2, 64), torch.float16, torch.device("cpu"))
    pool[:, :, :10] = 1.0
    written = _mapping_rss_kib(pool.data_ptr())
    assert release_block_pages(pool, [7, 3, 2, 4]) == 4 * 6 * 4096
    assert written - _mapping_rss_kib(pool.data_ptr()) == 4 * 6 * 4
    freed = torch.zeros(64, dtype=torch.bool)
    freed[[2, 3, 4, 7]] = True
    assert pool[:, :, freed].count_nonzero() == 0
    assert pool[:, :, :10][:, :, ~freed[:10]].eq(1).all()
    assert release_block_pages(pool, []) == 0


def test_a_block_smaller_than_a_page_gives_back_only_pages_wholly_its_own() -> None:
    # 6 KiB blocks: block 1 spans bytes 6-12 KiB of each region, so only the page at 8-12 KiB goes;
    # its neighbours keep every value
    pool = _zeroed_pool((2, 2, 16, 16, 3, 64), torch.float16, torch.device("cpu"))
    pool[:, :, :3] = 1.0
    assert release_block_pages(pool, [1]) == 4 * 4096
    assert pool[:, :, 0].eq(1).all() and pool[:, :, 2].eq(1).all()
    block = pool[:, :, 1].reshape(4, -1)  # 3,072 values a region: the first 1,024 share a page with block 0
    assert block[:, :1024].eq(1).all() and block[:, 1024:].count_nonzero() == 0


def test_an_idle_engine_gives_back_its_free_blocks_and_tokens_do_not_change(tmp_path: Path) -> None:
    """Gemma 3 (both pools): requests whose pages the prefix cache already holds leave their own
    copies free; idle, the engine gives their pages back, and the same requests then give the same
    tokens as on a fresh engine (a given-back block reads as zeros, as a never-written one)."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.core.outputs import EngineRequest, SamplingParams
    from engine.loader import load_model
    from tests.engine.families_gguf import tiny_family_model, write_family_gguf

    path = write_family_gguf(tiny_family_model("gemma3"), "gemma3", tmp_path / "tiny.gguf")

    def engine() -> LLMEngine:
        config = EngineConfig(device="cpu", num_kv_blocks=64, num_threads=1)
        return LLMEngine.from_loaded(config, load_model(path, progress=False))

    prompts = [[(7 * i + j) % 250 + 3 for i in range(40)] for j in range(3)]
    sampling = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def tokens(served: LLMEngine) -> list[list[int]]:
        requests = [EngineRequest(f"r{i}", p, sampling) for i, p in enumerate(prompts)]
        out = served.generate(requests)
        return [[t for d in out[r.request_id].deltas for t in d.token_ids] for r in requests]

    served = engine()
    first = tokens(served)
    assert all(len(t) == 24 for t in first)
    assert tokens(served) == first  # the cache's hits; these requests' own copies of its pages go free
    assert served.runner.local_kv_cache is not None
    assert served.release_idle_kv() > 0
    assert served.block_manager.allocator.take_free_dirty() == []
    assert tokens(served) == first
    assert tokens(engine()) == first
