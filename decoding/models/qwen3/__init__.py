"""Qwen3 (dense): the Llama block without q/k/v biases, with an RMSNorm on each query and key head.

Everything else is the Llama family's (``decoding.models.llama``): its config
readers, RoPE, attention, MLP, loader and forward, imported rather than copied.
What this folder adds is only what differs: the per-head norms' tensor names
(``names``), the layer weights that apply them (``layers``) and the stage that
loads them (``stage``). llama.cpp does not permute Qwen3's q/k rows, so
``gguf_heads_permuted`` (Llama's) answers None for it.
"""

from decoding.models.llama import config_from_gguf, config_from_hf, gguf_heads_permuted, unpermute_rows
from decoding.models.qwen3.layers import Qwen3LayerWeights
from decoding.models.qwen3.names import gguf_canonical, hf_canonical
from decoding.models.qwen3.stage import StageModel

#: GGUF ``general.architecture`` values this family runs.
GGUF_ARCHS = ("qwen3",)
#: Hugging Face ``model_type`` -> architecture.
HF_MODEL_TYPES = {"qwen3": "qwen3"}

__all__ = ["GGUF_ARCHS", "HF_MODEL_TYPES", "Qwen3LayerWeights", "StageModel", "config_from_gguf", "config_from_hf",
           "gguf_canonical", "gguf_heads_permuted", "hf_canonical", "unpermute_rows"]
