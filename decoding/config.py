"""The architecture numbers a Llama-family forward needs, whatever file they came from."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Architectures whose decoder is the Llama block (RMSNorm, RoPE, GQA, SwiGLU).
# Qwen2 differs only by q/k/v biases; Mistral by an optional sliding window,
# which we do not implement (we refuse contexts beyond it rather than be wrong).
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")


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

    @property
    def kv_bytes_per_token_per_layer_f32(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * 4

    def layer_param_count(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * h * 2 + h * kv * 2 + (h + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h

    def embed_param_count(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_param_count(self) -> int:
        return self.hidden_size + (0 if self.tie_embeddings else self.vocab_size * self.hidden_size)
