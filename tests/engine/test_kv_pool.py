"""The CPU KV pool commits memory only where tokens are written."""

from __future__ import annotations

import torch

from engine.core.model_runner import _zeroed_pool


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
