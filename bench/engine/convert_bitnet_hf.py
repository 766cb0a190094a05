"""Run llama.cpp's ``convert_hf_to_gguf.py`` on a transformers-layout BitNet checkpoint (2B-4T's layout).

    PYTHONPATH=$LLAMA_CPP/gguf-py python bench/engine/convert_bitnet_hf.py $LLAMA_CPP <hf dir> \\
        --no-lazy --outtype f16 --outfile <out.F16.gguf>

The converter (llama.cpp as vendored by llama-cpp-python 0.3.36) registers ``BitNetForCausalLM`` and
unpacks transformers' packed weights (``quantization_config.quant_method: bitnet``: codes / weight_scale,
then its absmean ``weight_quant``), but as shipped it does not take that layout to the end:
- its tensor map knows the sub-norms only by the 1bitLLM/bitnet_b1_58 names (``inner_attn_ln``,
  ``ffn_layernorm``), not transformers' ``attn_sub_norm`` / ``ffn_sub_norm``: "Can not map tensor";
- its BitNet vocabulary is sentencepiece only (``tokenizer.model``), and 2B-4T ships, like the default
  model, a BPE ``tokenizer.json``;
- its lazy path fails in the packed-weight unpacking (a CPU shift tensor against meta tensors), so
  ``--no-lazy`` is needed.
This adds the two names to the tensor map and takes the vocabulary the way the converter does for
every BPE model (``_set_vocab_gpt2``); every tensor still goes through the converter's own code.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    llama_cpp = os.path.abspath(sys.argv[1])
    sys.path[:0] = [llama_cpp, os.path.join(llama_cpp, "gguf-py")]
    from conversion.bitnet import BitnetModel
    from gguf.constants import MODEL_TENSOR
    from gguf.tensor_mapping import TensorNameMap

    names = TensorNameMap.block_mappings_cfg
    names[MODEL_TENSOR.ATTN_SUB_NORM] += ("model.layers.{bid}.self_attn.attn_sub_norm",)
    names[MODEL_TENSOR.FFN_SUB_NORM] += ("model.layers.{bid}.mlp.ffn_sub_norm",)
    BitnetModel.set_vocab = lambda self: self._set_vocab_gpt2()
    script = os.path.join(llama_cpp, "convert_hf_to_gguf.py")
    sys.argv = [script, *sys.argv[2:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
