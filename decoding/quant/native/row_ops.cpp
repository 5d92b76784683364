// The element-wise steps of a decoder layer for the gguf mode, one foreign call each.
//
// Why: a decode step of a 1.5B model on one core spends ~110 ms in the matrix products and, before
// these, ~17 ms in the ~30 small torch operations of 28 layers (each a dispatch of several
// microseconds for a row of 1,536 floats). RMSNorm, rotary embedding and SwiGLU here cost a call each
// (SwiGLU with an exponential of its own, eight lanes at a time, as fast as torch's vectorised one,
// so a decode step can run a whole layer without leaving C++). Every output
// row depends on its own input row only, computed in a fixed order, so a row gets the same bits
// alone or in a prompt (the gguf mode's rule).

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(MESHD_AVX2)
#include <immintrin.h>
#endif

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

namespace {

constexpr float EXP_LO = -87.0f, EXP_HI = 88.3762626647949f;  // Cephes' range: 2^n stays a normal float
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float ROUND = 12582912.0f;  // 1.5 * 2^23: (t + ROUND) - ROUND rounds |t| < 2^22 to nearest
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f, P3 = 4.1665795894e-2f,
                P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;

// silu(g) * u for eight lanes, exp by Cephes' expf (x = n ln2 + r, a degree-6 polynomial in r, 2^n from
// the exponent bits; a few ulp for x in [EXP_LO, EXP_HI], exp(EXP_LO) below, infinity above). Always
// eight, with a padded tail, so every element takes the same operations wherever it lies in a row; the
// AVX2 and portable versions do the same operations in the same order (no contraction): the same bits.
#if defined(MESHD_AVX2)
inline void swiglu8(const float* g, const float* u, float* o) {
    const __m256 gv = _mm256_loadu_ps(g);
    const __m256 x = _mm256_xor_ps(gv, _mm256_set1_ps(-0.0f));  // exp(-g)
    const __m256 v = _mm256_max_ps(_mm256_set1_ps(EXP_LO), _mm256_min_ps(_mm256_set1_ps(EXP_HI), x));
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(LOG2E)), _mm256_set1_ps(ROUND)),
                                   _mm256_set1_ps(ROUND));
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(v, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
    __m256 p = _mm256_set1_ps(P0);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P1));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P2));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P3));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P4));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P5));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    e = _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, _mm256_set1_ps(EXP_HI), _CMP_GT_OQ));
    const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(o, _mm256_mul_ps(silu, _mm256_loadu_ps(u)));
}
#else
inline void swiglu8(const float* g, const float* u, float* o) {
    for (int l = 0; l < 8; l++) {
        const float x = -g[l];
        const float v = EXP_HI < x ? EXP_HI : x;
        const float w = EXP_LO > v ? EXP_LO : v;
        const float n = (w * LOG2E + ROUND) - ROUND;
        const float r = (w - n * LN2_HI) - n * LN2_LO;
        float p = P0;
        p = p * r + P1;
        p = p * r + P2;
        p = p * r + P3;
        p = p * r + P4;
        p = p * r + P5;
        p = (p * (r * r) + r) + 1.0f;
        const int32_t bits = ((int32_t)n + 127) << 23;
        float scale;
        std::memcpy(&scale, &bits, sizeof scale);
        const float e = x > EXP_HI ? INFINITY : p * scale;
        o[l] = (g[l] / (1.0f + e)) * u[l];
    }
}
#endif

}  // namespace

extern "C" {

// out[r, i] = silu(gu[r, i]) * gu[r, inter + i] for m rows of 2 * inter floats (row strides ldg, ldo):
// the gated MLP's activation of every gguf-mode row, in a prompt, a verify round or a decode step.
void meshd_swiglu(const float* gu, int64_t ldg, int64_t m, int64_t inter, float* out, int64_t ldo) {
    for (int64_t r = 0; r < m; r++) {
        const float* g = gu + r * ldg;
        const float* u = g + inter;
        float* o = out + r * ldo;
        const int64_t whole = inter - inter % 8;
        for (int64_t i = 0; i < whole; i += 8) swiglu8(g + i, u + i, o + i);
        if (whole < inter) {
            float gt[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ut[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ot[8];
            std::memcpy(gt, g + whole, (inter - whole) * sizeof(float));
            std::memcpy(ut, u + whole, (inter - whole) * sizeof(float));
            swiglu8(gt, ut, ot);
            std::memcpy(o + whole, ot, (inter - whole) * sizeof(float));
        }
    }
}

}  // extern "C"
