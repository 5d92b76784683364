"""The Llama family (Llama, Mistral, Qwen2): its flags, tensor names, loader and forward.

What ``decoding.models`` asks of a family: the architecture names it runs
(``GGUF_ARCHS``, ``HF_MODEL_TYPES``), how each file format names its tensors
(``gguf_canonical``, ``hf_canonical``, ``gguf_heads_permuted``), its config
from each format (``config_from_gguf``, ``config_from_hf``) and its stage
(``StageModel.from_source``).
"""

from decoding.models.llama.config import (GGUF_ARCHS, GGUF_PERMUTED, HF_MODEL_TYPES, config_from_gguf,
                                          config_from_hf)
from decoding.models.llama.layers import LayerWeights, rms_norm, rotate
from decoding.models.llama.names import gguf_canonical, gguf_heads_permuted, hf_canonical, unpermute_rows
from decoding.models.llama.stage import StageModel

__all__ = ["GGUF_ARCHS", "GGUF_PERMUTED", "HF_MODEL_TYPES", "LayerWeights", "StageModel", "config_from_gguf",
           "config_from_hf", "gguf_canonical", "gguf_heads_permuted", "hf_canonical", "rms_norm", "rotate",
           "unpermute_rows"]
