"""The architecture numbers a stage, its KV cache and the planner need, whatever file they came from.

Which architectures there are, and how each file format spells these numbers,
is ``decoding.models``' business (the registry and its family folders).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return asdict(self)
