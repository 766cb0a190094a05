"""The Triton kernels' bounded tuning space and the table the request path reads (issue 50).

Every config a table may name (each space's alternatives) and every default runs in Triton's CPU
interpreter against the kernel's plain-torch reference, at tiny ragged shapes. The request path is
checked to choose by lookup only: no autotuner is built and nothing is timed, hit or miss.
"""

import ast
import logging
from pathlib import Path

import pytest
import torch

import engine.kernels
from engine.kernels import tuning
from engine.kernels.int4_matmul import int4_matmul, int4_matmul_ref, launch_int4, pack_int4
from engine.kernels.ternary_matmul import (
    launch_quantize,
    launch_ternary,
    pack_ternary,
    quantize_activations_ref,
    ternary_matmul,
    ternary_matmul_ref,
)
from engine.kernels.tuning import (
    KERNEL_SPACES,
    MAX_CONFIGS,
    SPACES,
    Chooser,
    LaunchConfig,
    TuningTable,
    m_bucket,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_DIR = Path(engine.kernels.__file__).parent


def _jit_kernels() -> set[str]:
    """Names of the ``@triton.jit`` functions of engine/kernels that are launched (``*_kernel``)."""
    names = set()
    for path in KERNELS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                if any("triton.jit" in ast.unparse(d) for d in node.decorator_list):
                    names.add(node.name)
    return names


def test_every_kernel_has_a_space_of_at_most_eight_configs_and_a_default() -> None:
    assert _jit_kernels() == set(KERNEL_SPACES), "each launched Triton kernel needs a tuning space"
    assert {s for spaces in KERNEL_SPACES.values() for s in spaces} == set(SPACES)
    for space in SPACES.values():
        assert len(space.configs) <= MAX_CONFIGS, f"{space.kernel}: {len(space.configs)} configs"
        assert len(set(space.configs)) == len(space.configs), f"{space.kernel} repeats a config"
        assert space.candidates()[0] == space.default


def test_nothing_in_the_engine_autotunes() -> None:
    """The request path cannot search: no autotuner and no benchmark timer anywhere in engine/."""
    engine_dir = KERNELS_DIR.parent
    for path in engine_dir.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not names & {"autotune", "Autotuner", "do_bench", "do_bench_cudagraph"}, path


def test_committed_table_names_only_configs_of_the_spaces() -> None:
    """What the table may pick is what the parametrized tests below run."""
    table = TuningTable.load(tuning.TABLE_PATH)
    for (kernel, _gpu, _triton, n, k, bucket), config in table.entries.items():
        assert config in SPACES[kernel].candidates(), (kernel, n, k, bucket, config)
        assert bucket == m_bucket(bucket)


def _space_configs(prefix: str) -> list[tuple[str, LaunchConfig]]:
    return [(s.kernel, c) for s in SPACES.values() if s.kernel.startswith(prefix) for c in s.candidates()]


def _config_id(case: tuple[str, LaunchConfig]) -> str:
    return f"{case[0]}-{case[1].name}"


def _int4_weights(n: int, k: int, group: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(group + n)
    num_groups = -(-k // group)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand((n, num_groups), generator=gen) * 0.05 + 0.01
    mins = -8 * scales
    return tuple(t.to(DEVICE) for t in pack_int4(codes, scales, mins, group))


@pytest.mark.parametrize("case", _space_configs("int4_"), ids=_config_id)
def test_each_int4_config_matches_the_reference(case: tuple[str, LaunchConfig]) -> None:
    kernel, config = case
    group = int(kernel.split("_")[1][1:])
    m = 3 if kernel.endswith("decode") else 20
    n, k = 40, 2 * group - 8  # ragged N and K; K ends inside its last group
    qweight, scales, mins = _int4_weights(n, k, group)
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.float16)
    out = torch.zeros((m, n), device=DEVICE, dtype=torch.float32 if config["SPLIT_K"] > 1 else x.dtype)
    launch_int4(x, qweight, scales, mins, out, group, config)
    ref = int4_matmul_ref(x, qweight, scales, mins, group)
    torch.testing.assert_close(out.half().float(), ref.float(), rtol=2e-3, atol=2e-3 * ref.abs().max().item())


@pytest.mark.parametrize("case", _space_configs("ternary_"), ids=_config_id)
def test_each_ternary_config_matches_the_reference(case: tuple[str, LaunchConfig]) -> None:
    kernel, config = case
    gen = torch.Generator().manual_seed(7)
    m, n, k = (3 if kernel != "ternary_gemm" else 20), 40, 200
    x = torch.randn((m, k), generator=gen).to(DEVICE)
    xq_ref, scale_ref = quantize_activations_ref(x)
    if kernel == "ternary_quantize":
        xq = torch.empty((m, k), device=DEVICE, dtype=torch.int8)
        scale = torch.empty((m,), device=DEVICE, dtype=torch.float32)
        launch_quantize(x, xq, scale, config)
        assert torch.equal(xq.cpu(), xq_ref) and torch.allclose(scale.cpu(), scale_ref)
        return
    qweight = pack_ternary(torch.randint(-1, 2, (n, k), generator=gen)).to(DEVICE)
    w_scale = torch.tensor([0.02], device=DEVICE)
    out = torch.zeros((m, n), device=DEVICE, dtype=torch.float32)
    launch_ternary(xq_ref.to(DEVICE), scale_ref.to(DEVICE), qweight, w_scale, out, config)
    torch.testing.assert_close(out, ternary_matmul_ref(x, qweight, w_scale), rtol=1e-5, atol=1e-5)


def test_m_buckets() -> None:
    assert [m_bucket(m) for m in (1, 2, 3, 4, 5, 16, 17, 300, 512, 4096)] == [
        1, 2, 4, 4, 8, 16, 32, 512, 512, 512,
    ]  # fmt: skip


def test_table_hit_miss_and_foreign_entry(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    space = SPACES["int4_g32_decode"]
    best = space.configs[3]
    outside = LaunchConfig.of(BLOCK_M=16, BLOCK_N=512, BLOCK_K=32, SPLIT_K=1)
    table = TuningTable()
    table.entries[("int4_g32_decode", "GPU X", "3.9", 64, 96, 4)] = best
    table.entries[("int4_g32_decode", "GPU X", "3.9", 64, 96, 8)] = outside
    table.save(tmp_path / "t.json", about="test")
    chooser = Chooser(TuningTable.load(tmp_path / "t.json"), "GPU X", "3.9")

    with caplog.at_level(logging.INFO, logger=tuning.__name__):
        assert chooser.choose("int4_g32_decode", 64, 96, 3) == best  # bucket 4
        assert chooser.choose("int4_g32_decode", 64, 96, 4) == best
        assert not caplog.records
        assert chooser.choose("int4_g32_decode", 64, 96, 8) == space.default  # not in the space
        assert chooser.choose("int4_g32_decode", 64, 96, 16) == space.default  # no entry
        assert chooser.choose("int4_g32_decode", 64, 96, 9) == space.default  # same key: no second line
        assert Chooser(table, "GPU Y", "3.9").choose("int4_g32_decode", 64, 96, 4) == space.default
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3, messages
    assert "not in the space" in messages[0] and "no entry" in messages[1] and "GPU Y" in messages[2]
    assert "tern bench kernel-tuning" in messages[1]


class _Searched(AssertionError):
    pass


def _refuse(*_args: object, **_kwargs: object) -> None:
    raise _Searched("the request path searched for a config")


def test_request_path_looks_up_and_never_searches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hit and miss through the public matmuls: the table's config is launched (its result is the
    reference's), and building an autotuner or timing a config would raise."""
    import triton.testing

    monkeypatch.setattr(triton.runtime.autotuner.Autotuner, "__init__", _refuse)
    monkeypatch.setattr(triton.testing, "do_bench", _refuse)
    group, n, k = 32, 24, 56
    qweight, scales, mins = _int4_weights(n, k, group)
    gpu, version = tuning.device_name(), triton.__version__
    table = TuningTable()
    table.entries[("int4_g32_decode", gpu, version, n, k, 2)] = SPACES["int4_g32_decode"].configs[0]
    chooser = Chooser(table, gpu, version)
    monkeypatch.setattr(tuning, "_chooser", chooser)
    for m in (2, 1, 20):  # hit, miss (decode), miss (GEMM)
        x = torch.randn((m, k), generator=torch.Generator().manual_seed(m)).to(DEVICE)
        expected = int4_matmul_ref(x, qweight, scales, mins, group)
        torch.testing.assert_close(int4_matmul(x, qweight, scales, mins, group), expected)
    x = torch.randn((2, k)).to(DEVICE)
    ternary = pack_ternary(torch.randint(-1, 2, (n, k))).to(DEVICE)
    w_scale = torch.tensor([0.5], device=DEVICE)
    torch.testing.assert_close(ternary_matmul(x, ternary, w_scale), ternary_matmul_ref(x, ternary, w_scale))
    chosen = chooser.chosen()
    assert chosen[("int4_g32_decode", n, k, 2)] == SPACES["int4_g32_decode"].configs[0]
    assert chosen[("int4_g32_decode", n, k, 1)] == SPACES["int4_g32_decode"].default
    assert chosen[("int4_g32_gemm", n, k, 32)] == SPACES["int4_g32_gemm"].default
    assert chosen[("ternary_decode", n, k, 2)] == SPACES["ternary_decode"].default
    assert chosen[("ternary_quantize", 0, k, 2)] == SPACES["ternary_quantize"].default


def test_tuning_bench_fills_the_table_the_request_path_reads(tmp_path: Path) -> None:
    """``tern bench kernel-tuning``'s fill step, run in the interpreter on one key (the wall clock
    stands in for the GPU timer): every candidate is checked and timed, the fastest lands in the
    table, and a chooser on the saved table picks it without a log line."""
    from bench.engine.kernel_tuning import tune, wall_timer

    key = ("int4_g32_decode", 24, 56, 2)
    table = TuningTable()
    rows = tune([key, ("paged_decode", 0, 0, 1)], table, "interpreter", wall_timer, DEVICE, torch.float32)
    (row,) = rows  # paged_decode has nothing to choose from
    space = SPACES["int4_g32_decode"]
    assert row["wrong"] == [] and row["default_ms"] is not None
    (entry,) = table.entries.items()
    assert entry[0][:2] == ("int4_g32_decode", "interpreter") and entry[0][3:] == (24, 56, 2)
    assert entry[1] in space.candidates() and entry[1].name == row["best"]
    table.save(tmp_path / "table.json", about="test")
    chooser = Chooser(TuningTable.load(tmp_path / "table.json"), "interpreter", entry[0][2])
    assert chooser.choose("int4_g32_decode", 24, 56, 2) == entry[1]
