// What the kernels' sources share: the GGUF block types they multiply, a half float's value, how a row
// of quantised activations is laid out, and the 32-element types' product (small_dot.cpp) that
// gguf_dot.cpp's entry points hand those types to.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(MESHD_AVX2)
#include <immintrin.h>
#endif

namespace meshd {

// A decode step streams each weight from memory once: the kernels ask for the bytes this far ahead of
// the ones they read (measured on the 1.5B's matrices: 2 KB beat 1 and 4 KB, and no prefetch by 1.4x).
constexpr int PREFETCH_AHEAD = 2048;

enum QType : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

inline float f16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
#if defined(MESHD_AVX2)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
#endif
}

constexpr int block_bytes(int t) {
    return t == Q4_0 ? 18 : t == Q4_1 ? 20 : t == Q5_0 ? 22 : t == Q5_1 ? 24 : t == Q8_0 ? 34
         : t == Q4_K ? 144 : t == Q5_K ? 176 : t == Q6_K ? 210 : 0;
}
constexpr int block_elems(int t) { return (t == Q4_K || t == Q5_K || t == Q6_K) ? 256 : 32; }

// The activations of one row, quantised: codes, a scale per activation block (32 elements for the
// 32-element weight types, 256 for the K-quants, as llama.cpp's Q8_0 and Q8_K) and the codes' sums per 16.
struct Act {
    const int8_t* q;
    const float* d;
    const int16_t* s;
};

constexpr int64_t M_TILE = 64;  // activation rows kept hot (in L2) while every weight row passes them

// out[m, col0 + colmap[n]] = dot(weight row n, activation row m) for n in [n0, n1), m in [0, M), for the
// 32-element types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); false for another type.
bool small_matmul(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K,
                  const int8_t* xq, const float* xd, const int16_t* xs, int64_t M, float* out, int64_t ldo,
                  const int64_t* colmap, int64_t col0);

}  // namespace meshd
