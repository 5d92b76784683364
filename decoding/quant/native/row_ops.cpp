// The element-wise steps of a decoder layer for the gguf mode, one foreign call each.
//
// Why: a decode step of a 1.5B model on one core spends ~110 ms in the matrix products and, before
// these, ~17 ms in the ~30 small torch operations of 28 layers (each a dispatch of several
// microseconds for a row of 1,536 floats). RMSNorm and rotary embedding here cost a call each
// (SwiGLU's exponential stays torch's: its vectorised exp beats a scalar libm one). Every output
// row depends on its own input row only, computed in a fixed order, so a row gets the same bits
// alone or in a prompt (the gguf mode's rule).

#include <cmath>
#include <cstdint>

extern "C" {

// out[m] = w * (x[m] / sqrt(mean(x[m]^2) + eps)) for rows of n floats (row strides ldx, ldo).
void meshd_rms_norm(const float* x, int64_t ldx, const float* w, float* out, int64_t ldo, int64_t m, int64_t n,
                    float eps) {
    for (int64_t r = 0; r < m; r++) {
        const float* xr = x + r * ldx;
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++) ss = ss + xr[i] * xr[i];
        const float inv = 1.0f / std::sqrt(ss / (float)n + eps);
        float* o = out + r * ldo;
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

// Rotate-half RoPE in place on x viewed as [n, heads, hd] (strides: row, head; elements contiguous):
// x * cos + rotate_half(x) * sin, cos/sin [n, hd] contiguous.
void meshd_rope(float* x, int64_t n, int64_t heads, int64_t hd, int64_t row_stride, int64_t head_stride,
                const float* cos, const float* sin) {
    const int64_t half = hd / 2;
    for (int64_t r = 0; r < n; r++) {
        const float* c = cos + r * hd;
        const float* s = sin + r * hd;
        for (int64_t h = 0; h < heads; h++) {
            float* v = x + r * row_stride + h * head_stride;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + (-b) * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

}  // extern "C"
