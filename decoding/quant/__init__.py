"""Computing on a model's own low-bit weights instead of float copies of them.

Decode on a CPU is bound by the bytes of weights read per token: a 4-bit GGUF
dequantised to float32 reads eight times what the file holds. ``groups`` turns
GGUF blocks into 4-bit codes with a scale and an offset per group of 32 inputs
(exactly, for the formats that are 4-bit already); ``packed`` multiplies them
without ever widening the whole matrix.
"""
