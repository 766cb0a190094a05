"""The load plan (engine/loader/plan.py): each GGUF tensor's form decided from the header alone, and
the C kernels' Q4_0/Q4_1 linears laid out straight from the file's blocks, byte for byte what the
old route through a byte-per-code ``Int4Linear`` gave."""

from __future__ import annotations

import pytest
import torch

from engine.cpu import kernels as cpu_kernels
from engine.cpu.ggml_kernels import GGMLType, random_blocks
from engine.layers.ggml_linear import StackedLinear
from engine.layers.packed_linear import Q4CpuLinear
from engine.layers.quant.formats import int4_from_gguf
from engine.layers.quant.linear import Int4Linear
from engine.layers.stacking import stack_linears
from engine.loader import gguf_file
from engine.loader.linear_factory import CpuKernels, install_cpu_kernels
from engine.loader.load import default_model_path, load_model
from engine.loader.plan import Form, KeepPolicy, gguf_plan, keep_policy

needs_c_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels do not build here")
LAID_OUT = ("qweight", "scales", "mins")


def via_int4(blocks: torch.Tensor, quant_type: str, width: int) -> Q4CpuLinear:
    """The old route: codes unpacked to a byte each (``Int4Linear``), then packed again."""
    weight = int4_from_gguf(blocks, (blocks.shape[0], width), quant_type)
    return Q4CpuLinear(Int4Linear(weight, backend="torch"))


def assert_same_layout(a: Q4CpuLinear, b: Q4CpuLinear) -> None:
    assert (a.in_features, a.out_features) == (b.in_features, b.out_features)
    for name in LAID_OUT:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@needs_c_kernels
@pytest.mark.parametrize("tiled", [True, False], ids=["vnni-tiles", "rows"])
@pytest.mark.parametrize("rows", [48, 40], ids=["whole-tiles", "part-tile"])
@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1"])
def test_q4_blocks_lay_out_as_the_int4_route_did(
    quant_type: str, rows: int, tiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both layouts the kernels read (this CPU's build runs one of them: only it is multiplied)."""
    built_tiled = cpu_kernels.q4_1_tiled()
    monkeypatch.setattr(cpu_kernels, "q4_1_tiled", lambda: tiled)
    blocks = torch.from_numpy(random_blocks(GGMLType[quant_type], rows, 128, seed=rows))
    direct = Q4CpuLinear.from_gguf_blocks(blocks, quant_type)
    old = via_int4(blocks, quant_type, 128)
    assert_same_layout(direct, old)
    if tiled == built_tiled:
        x = torch.randn(3, 128)
        assert torch.equal(direct(x), old(x))


@needs_c_kernels
@pytest.mark.parametrize("tiled", [True, False], ids=["vnni-tiles", "rows"])
def test_stacked_q4_linears_join_their_layouts(tiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    built_tiled = cpu_kernels.q4_1_tiled()
    monkeypatch.setattr(cpu_kernels, "q4_1_tiled", lambda: tiled)
    parts_blocks = [torch.from_numpy(random_blocks(GGMLType.Q4_1, n, 64, seed=n)) for n in (64, 32, 48)]
    parts = [Q4CpuLinear.from_gguf_blocks(b, "Q4_1") for b in parts_blocks]
    stacked = stack_linears(parts)
    assert isinstance(stacked, Q4CpuLinear)
    int4_parts = [
        Int4Linear(int4_from_gguf(b, (b.shape[0], 64), "Q4_1"), backend="torch") for b in parts_blocks
    ]
    old = stack_linears(int4_parts)
    assert isinstance(old, Int4Linear)
    assert_same_layout(stacked, Q4CpuLinear(old))
    # a part before the last that ends inside a tile cannot share tiles: each part on its own kernel
    straddling = [Q4CpuLinear.from_gguf_blocks(b, "Q4_1") for b in reversed(parts_blocks)]
    straddling[0] = Q4CpuLinear.from_gguf_blocks(parts_blocks[2][:40], "Q4_1")
    side_by_side = stack_linears(straddling)
    assert isinstance(side_by_side, StackedLinear)
    if tiled != built_tiled:
        return  # the kernels of this build read the other layout
    x = torch.randn(2, 64)
    assert torch.equal(side_by_side(x), torch.cat([p(x) for p in straddling], dim=-1))


def test_the_plan_decides_each_tensor_from_the_header() -> None:
    reader = gguf_file.open_gguf(default_model_path())
    headers = gguf_file.headers(reader, "llama")
    heads, kv_heads = 9, 3  # SmolLM2-135M

    def forms(keep: KeepPolicy) -> dict[str, Form]:
        return {p.name: p.form for p in gguf_plan(headers, "llama", heads, kv_heads, keep).values()}

    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert set(forms(KeepPolicy()).values()) == {Form.FLOAT}
    assert forms(KeepPolicy(int4=True))[q_proj] is Form.INT4_BLOCKS
    c_path = forms(KeepPolicy(int4=True, ternary=True, blocks=True, q4_kernel=True))
    assert c_path[q_proj] is Form.Q4_KERNEL
    assert c_path["model.layers.0.input_layernorm.weight"] is Form.FLOAT
    plans = gguf_plan(headers, "llama", heads, kv_heads, KeepPolicy())
    # llama.cpp's q/k row permutation is undone over the right head count, nothing else is permuted
    assert plans["blk.0.attn_q.weight"].permuted_heads == heads
    assert plans["blk.0.attn_k.weight"].permuted_heads == kv_heads
    assert plans["blk.0.attn_v.weight"].permuted_heads is None


@needs_c_kernels
def test_the_default_model_on_the_c_kernels_never_holds_int4_codes() -> None:
    """Loaded as the engine's C kernels' path loads it, against the old route (``Int4Linear``, then the
    linear table): the same layer bytes, and no ``Int4Linear`` existed to be replaced."""
    direct = load_model(None, progress=False, keep_gguf_int4=True, keep_gguf_blocks=True).model
    assert not any(isinstance(m, Int4Linear) for m in direct.modules())
    old = load_model(None, progress=False, keep_gguf_int4=True).model
    assert any(isinstance(m, Int4Linear) for m in old.modules())
    for model in (direct, old):
        install_cpu_kernels(model, CpuKernels.C_F32)
    for a, b in zip(direct.model.layers, old.model.layers, strict=True):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            new_linear, old_linear = a.get_submodule(name), b.get_submodule(name)
            assert isinstance(new_linear, Q4CpuLinear) and isinstance(old_linear, Q4CpuLinear)
            assert_same_layout(new_linear, old_linear)


def test_the_keep_policy_follows_the_serving_plan() -> None:
    fast = {"method": "none", "quant": "auto", "fast_path": True, "own_blocks": True, "c_kernels": True}
    assert keep_policy(gguf=True, **fast) == KeepPolicy(int4=True, ternary=True, blocks=True, q4_kernel=True)
    # without the C kernels, Q4 linears still stay packed, for torch's int4 kernel
    torch_int4 = keep_policy(gguf=True, **(fast | {"own_blocks": False, "c_kernels": False}))
    assert torch_int4 == KeepPolicy(int4=True)
    # a directory has no GGML blocks; --quant none dequantizes everything; AWQ keeps its int4 tensors
    assert keep_policy(gguf=False, **fast) == KeepPolicy()
    assert keep_policy(gguf=True, **(fast | {"quant": "none"})) == KeepPolicy()
    assert keep_policy(gguf=False, **(fast | {"method": "int4", "quant": "auto"})).int4
