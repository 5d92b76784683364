// Matrix products on a GGUF file's own blocks against int8-quantised activations.
//
// Why this file exists: on a CPU without a bfloat16 matrix unit (an AVX2 mini PC, an ARM board) the
// fastest way to multiply by 4-6-bit weights is llama.cpp's: quantise each activation row to int8 per
// block of 32 and take integer dot products with the weights' codes as the file stores them, so no
// weight is ever widened to a float. bench/RESULTS.md ("kernel candidates") has the measurement that
// chose writing these over the libraries (onnxruntime's MatMulNBits is not row-independent for more
// than one row; torch's int4 kernels want bfloat16 activations).
//
// Two builds of this one source: MESHD_AVX2 (x86 with AVX2, FMA, F16C) and a portable one (ARM,
// older x86). They give the same bits: every integer sum is exact, every float accumulator is updated
// with a fused multiply-add in the same order in both, and the accumulators are summed in one fixed
// tree. So a row's result depends only on its own activations and the weights — never on how many rows
// came with it, which thread computed it, or which CPU a mesh member has.
//
// Activations are quantised as llama.cpp's are: a scale per 32 for the 32-element weight types (Q8_0),
// per 256 for the K-quants (Q8_K). The float steps:
// - K-quants, per superblock and row: lane k of eight gets an exact integer sum (elements 4k..4k+3 of
//   each 32, times their half's integer scale), then acc_k = fma(float(isum_k), wd * dx, acc_k), and
//   the additive term (a minimum, the Q6_K centre) the same way into the same lanes;
// - 32-element types, per block j and row: one exact sum S_j, acc[j % 4] = fma(float(S_j), wd * dx,
//   acc[j % 4]) (see small_bias below for why four accumulators).
// Compiled with -ffp-contract=off so the compiler fuses nothing on its own.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"

#if defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#endif

namespace meshd {
namespace {

// Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j from the 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// A 256-element K-quant superblock, decoded once per weight row and pass: its float scale and the
// factor of its additive term, the integer scales of its 32-blocks' halves and, per 16 elements, the
// integer the activations' sums are multiplied by for that term.
struct SuperHead {
    float wd, wm;
    int factor;
    int16_t sc[16];    // integer scale of each half (16 elements) of each 32-block
    int16_t mins[16];  // per half: what its activation sum is multiplied by in the additive term
};

template <int T>
inline void decode_head(const uint8_t* b, SuperHead& h) {
    if (T == Q6_K) {  // w = d * sc * (u - 32): the additive term is -32 * d * sum(sc * s)
        const int8_t* sc = (const int8_t*)(b + 192);
        for (int i = 0; i < 16; i++) h.sc[i] = h.mins[i] = sc[i];
        h.wd = h.wm = f16(b + 208);
        h.factor = -32;
        return;
    }
    // Q4_K / Q5_K: w = d * sc * u - dmin * m
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, b + 4, sc, m);
        h.sc[2 * j] = h.sc[2 * j + 1] = (int16_t)sc;
        h.mins[2 * j] = h.mins[2 * j + 1] = (int16_t)m;
    }
    h.wd = f16(b);
    h.wm = -f16(b + 2);
    h.factor = 1;
}

// The codes of 32-block j (0..7) of a superblock, unsigned (< 64).
#if defined(MESHD_AVX2)
template <int T>
inline __m256i decode_k(const uint8_t* b, int j) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (T == Q6_K) {  // ql[128] qh[64] scales[16] d
        const int n = j >> 2, t = j & 3;
        const __m256i q = _mm256_loadu_si256((const __m256i*)(b + 64 * n + (t & 1) * 32));
        const __m256i lo = t < 2 ? _mm256_and_si256(q, m4) : _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        const __m256i h = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * n));
        return _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * t), _mm256_set1_epi8(3)), 4));
    }
    const __m256i q = _mm256_loadu_si256((const __m256i*)(b + (T == Q5_K ? 48 : 16) + 32 * (j >> 1)));
    __m256i u = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(q, 4) : q, m4);
    if (T == Q5_K) {
        const __m256i h = _mm256_loadu_si256((const __m256i*)(b + 16));
        u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, j), _mm256_set1_epi8(1)), 4));
    }
    return u;
}
#else
template <int T>
inline void decode_k(const uint8_t* b, int j, uint8_t* u) {
    if (T == Q6_K) {
        const int n = j >> 2, t = j & 3;
        const uint8_t* ql = b + 64 * n + (t & 1) * 32;
        const uint8_t* qh = b + 128 + 32 * n;
        for (int l = 0; l < 32; l++)
            u[l] = (uint8_t)((t < 2 ? (ql[l] & 0xF) : (ql[l] >> 4)) | (((qh[l] >> (2 * t)) & 3) << 4));
        return;
    }
    const uint8_t* qs = b + (T == Q5_K ? 48 : 16) + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
    for (int l = 0; l < 32; l++) {
        int v = (qs[l] >> shift) & 0xF;
        if (T == Q5_K) v |= ((b[16 + l] >> j) & 1) << 4;
        u[l] = (uint8_t)v;
    }
}
#endif

#if defined(MESHD_AVX2)
struct Acc {
    __m256 v;
};
inline void acc_zero(Acc& a) { a.v = _mm256_setzero_ps(); }
inline float acc_total(const Acc& a) {
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}
#else
struct Acc {
    float v[8];
};
inline void acc_zero(Acc& a) { for (float& x : a.v) x = 0.0f; }
inline float acc_total(const Acc& a) {
    float t[4], u[2];
    for (int k = 0; k < 4; k++) t[k] = a.v[k] + a.v[k + 4];
    u[0] = t[0] + t[2];
    u[1] = t[1] + t[3];
    return u[0] + u[1];
}
#endif

// The float step of a K-quant superblock for one activation row: lane k takes its integer sum times
// wd * dx, then the additive term's integers of halves 2k and 2k+1 times wmf * dx (wmf: the minimum's
// or the centre's float scale times its integer factor, -32 or 1: a power of two, exact).
#if defined(MESHD_AVX2)
inline void k_step(Acc& a, __m256i isum, __m256i mins, const Act& x, int64_t sb, float wd, float wmf) {
    const float dx = x.d[sb];
    a.v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(wd * dx), a.v);
    const __m256i ms = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i*)(x.s + 16 * sb)));
    a.v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_set1_ps(wmf * dx), a.v);
}
#else
inline void k_step(Acc& a, const int* isum, const int16_t* mins, const Act& x, int64_t sb, float wd, float wmf) {
    const float dx = x.d[sb], sv = wd * dx, mv = wmf * dx;
    const int16_t* s = x.s + 16 * sb;
    for (int k = 0; k < 8; k++) a.v[k] = std::fma((float)isum[k], sv, a.v[k]);
    for (int k = 0; k < 8; k++) a.v[k] = std::fma((float)(mins[2 * k] * s[2 * k] + mins[2 * k + 1] * s[2 * k + 1]), mv, a.v[k]);
}
#endif

// A K-quant weight row decoded once for a pass over many activation rows: its codes one per byte, the
// integer scales of each 32-block's halves laid out as the multiply wants them, and per superblock the
// float scales and the integers its additive term multiplies the activation sums by. Decoding is the
// costly part of a K-quant product; done once per row and tile of activation rows, it is shared by all.
struct KRow {
    uint8_t* codes;  // [K]
    int16_t* sc;     // [K / 32][16]: the first half's scale in lanes 0..7, the second's in 8..15
    int16_t* mins;   // [K / 256][16]
    float* wd;       // [K / 256]
    float* wm;       // [K / 256]
    int factor;
};

template <int T>
inline void decode_row_k(const uint8_t* row, int64_t K, KRow& o) {
    SuperHead h;
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t* b = row + sb * block_bytes(T);
        decode_head<T>(b, h);
        o.wd[sb] = h.wd;
        o.wm[sb] = h.wm;
        o.factor = h.factor;
        std::memcpy(o.mins + 16 * sb, h.mins, sizeof h.mins);
        for (int j = 0; j < 8; j++) {
            int16_t* sc = o.sc + 16 * (8 * sb + j);
#if defined(MESHD_AVX2)
            _mm256_storeu_si256((__m256i*)sc, _mm256_set_m128i(_mm_set1_epi16(h.sc[2 * j + 1]), _mm_set1_epi16(h.sc[2 * j])));
            _mm256_storeu_si256((__m256i*)(o.codes + 256 * sb + 32 * j), decode_k<T>(b, j));
#else
            for (int i = 0; i < 8; i++) { sc[i] = h.sc[2 * j]; sc[8 + i] = h.sc[2 * j + 1]; }
            decode_k<T>(b, j, o.codes + 256 * sb + 32 * j);
#endif
        }
    }
}

// A K-quant row against R activation rows, its blocks decoded beforehand (`k`, for a pass over many
// rows) or as they are read (`k` null: a decode step, where a row is read once). Per superblock and
// row the integer sums of its eight 32-blocks (each times its halves' integer scales) are added
// exactly; one float step follows. Both ways compute the same integers and the same float steps.
template <int T, int R>
inline void rows_dot_k(const uint8_t* row, const KRow* k, int64_t K, const Act* x, float* out) {
    Acc acc[R];
    for (int r = 0; r < R; r++) acc_zero(acc[r]);
    SuperHead h;
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t* b = row + sb * block_bytes(T);
        float wd, wm;
        int factor;
        const int16_t* mins;
        if (k) {
            wd = k->wd[sb], wm = k->wm[sb], factor = k->factor, mins = k->mins + 16 * sb;
        } else {
            decode_head<T>(b, h);
            wd = h.wd, wm = h.wm, factor = h.factor, mins = h.mins;
        }
#if defined(MESHD_AVX2)
        __m256i isum[R];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i u = k ? _mm256_loadu_si256((const __m256i*)(k->codes + 256 * sb + 32 * j)) : decode_k<T>(b, j);
            const __m256i sc = k ? _mm256_loadu_si256((const __m256i*)(k->sc + 16 * (8 * sb + j)))
                                 : _mm256_set_m128i(_mm_set1_epi16(h.sc[2 * j + 1]), _mm_set1_epi16(h.sc[2 * j]));
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i*)(x[r].q + 256 * sb + 32 * j));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), sc));
            }
        }
        const __m256i mv = _mm256_loadu_si256((const __m256i*)mins);
        for (int r = 0; r < R; r++) k_step(acc[r], isum[r], mv, x[r], sb, wd, wm * (float)factor);
#else
        int isum[R][8] = {};
        uint8_t own[32];
        for (int j = 0; j < 8; j++) {
            const uint8_t* c = own;
            if (k) c = k->codes + 256 * sb + 32 * j;
            else decode_k<T>(b, j, own);
            const int8_t* u = (const int8_t*)c;  // codes < 64: as signed bytes, int8 dot products (ARM's sdot)
            const int s0 = k ? k->sc[16 * (8 * sb + j)] : h.sc[2 * j];
            const int s1 = k ? k->sc[16 * (8 * sb + j) + 8] : h.sc[2 * j + 1];
            for (int r = 0; r < R; r++) {
                const int8_t* xq = x[r].q + 256 * sb + 32 * j;
#if defined(__ARM_FEATURE_DOTPROD)
                // sdot's four-element sums are the loop's below, lanes 0..3 and 4..7: the same integers
                const int32x4_t lo = vdotq_s32(vdupq_n_s32(0), vld1q_s8(u), vld1q_s8(xq));
                const int32x4_t hi = vdotq_s32(vdupq_n_s32(0), vld1q_s8(u + 16), vld1q_s8(xq + 16));
                vst1q_s32(isum[r], vmlaq_n_s32(vld1q_s32(isum[r]), lo, s0));
                vst1q_s32(isum[r] + 4, vmlaq_n_s32(vld1q_s32(isum[r] + 4), hi, s1));
#else
                for (int q = 0; q < 8; q++) {
                    int sum = 0;
                    for (int e = 4 * q; e < 4 * q + 4; e++) sum += (int)u[e] * (int)xq[e];
                    isum[r][q] += sum * (q < 4 ? s0 : s1);
                }
#endif
            }
        }
        for (int r = 0; r < R; r++) k_step(acc[r], isum[r], mins, x[r], sb, wd, wm * (float)factor);
#endif
    }
    for (int r = 0; r < R; r++) out[r] = acc_total(acc[r]);
}

#if defined(MESHD_AVX2)
// The same product as rows_dot_k with the blocks decoded as read, the superblock's scales unpacked with
// vector shuffles (a decode step reads each weight once: the unpacking is most of its work). It forms
// the very integers rows_dot_k forms, so its float steps and bits are the same.
template <int T, int R>
inline void rows_dot_k_fly(const uint8_t* row, int64_t K, const Act* x, float* out) {
    Acc acc[R];
    for (int r = 0; r < R; r++) acc_zero(acc[r]);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    // per 32-block j: lanes 0..7 take the i16 at byte 4j, lanes 8..15 the one at 4j + 2 (after the
    // i32 pair of block j has been moved to every 32-bit lane)
    const __m256i pick = _mm256_set_epi8(3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                                         1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t* b = row + sb * block_bytes(T);
        // a decode step streams the weights from memory once: ask for them ahead of the hardware
        for (int l = 0; l < block_bytes(T); l += 64) _mm_prefetch((const char*)(b + PREFETCH_AHEAD + l), _MM_HINT_T0);
        float wd, wm;
        int factor;
        __m256i pairs;  // i32 lane j: block j's two half scales as i16
        __m256i mins;   // i16 per half: what its activation sum is multiplied by
        if (T == Q6_K) {
            const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192)));
            pairs = s16;
            mins = s16;
            wd = wm = f16(b + 208);
            factor = -32;
        } else {  // the 12 scale bytes as 8 scales then 8 minimums (llama.cpp's unpacking)
            uint32_t u[4];
            std::memcpy(u, b + 4, 12);
            const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
            u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
            const uint32_t m_lo = u[1] & k1;
            u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
            u[2] = m_lo;
            u[0] &= k1;
            const __m256i sm = _mm256_cvtepu8_epi16(_mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]));
            // both halves of block j share scale j: i32 lane j = (sc_j, sc_j)
            const __m128i sc = _mm256_castsi256_si128(sm);
            pairs = _mm256_set_m128i(_mm_unpackhi_epi16(sc, sc), _mm_unpacklo_epi16(sc, sc));
            const __m128i mn = _mm256_extracti128_si256(sm, 1);
            mins = _mm256_set_m128i(_mm_unpackhi_epi16(mn, mn), _mm_unpacklo_epi16(mn, mn));
            wd = f16(b);
            wm = -f16(b + 2);
            factor = 1;
        }
        __m256i isum[R];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        __m256i h = _mm256_setzero_si256(), q = h;
        if (T == Q5_K) h = _mm256_loadu_si256((const __m256i*)(b + 16));
        for (int j = 0; j < 8; j++) {
            __m256i u;
            if (T == Q6_K) {
                const int n = j >> 2, t = j & 3;
                q = _mm256_loadu_si256((const __m256i*)(b + 64 * n + (t & 1) * 32));
                const __m256i lo = t < 2 ? _mm256_and_si256(q, m4) : _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                if (t == 0) h = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * n));
                u = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * t), _mm256_set1_epi8(3)), 4));
            } else {
                if ((j & 1) == 0) q = _mm256_loadu_si256((const __m256i*)(b + (T == Q5_K ? 48 : 16) + 32 * (j >> 1)));
                u = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(q, 4) : q, m4);
                if (T == Q5_K)
                    u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, j), _mm256_set1_epi8(1)), 4));
            }
            const __m256i sc = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(pairs, _mm256_set1_epi32(j)), pick);
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i*)(x[r].q + 256 * sb + 32 * j));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), sc));
            }
        }
        for (int r = 0; r < R; r++) k_step(acc[r], isum[r], mins, x[r], sb, wd, wm * (float)factor);
    }
    for (int r = 0; r < R; r++) out[r] = acc_total(acc[r]);
}
#endif

// Rows [m0, m1) of the activations against one K-quant weight row, four at a time where there are four,
// the last one to three together (a verify round's few rows share the weight row's unpacking).
template <class Dot>
inline void tile_rows(int64_t m0, int64_t m1, int64_t K, int64_t nd, const int8_t* xq, const float* xd,
                      const int16_t* xs, float* out, int64_t ldo, int64_t col, Dot&& dot) {
    const int64_t ns = K / 16;
    float r[4];
    Act x[4];
    int64_t m = m0;
    const auto take = [&](int n) {
        for (int i = 0; i < n; i++) x[i] = {xq + (m + i) * K, xd + (m + i) * nd, xs + (m + i) * ns};
    };
    const auto put = [&](int n) {
        for (int i = 0; i < n; i++) out[(m + i) * ldo + col] = r[i];
    };
    for (; m + 4 <= m1; m += 4) {
        take(4);
        dot(x, r, std::integral_constant<int, 4>());
        put(4);
    }
    const int rest = (int)(m1 - m);
    take(rest);
    if (rest == 3) dot(x, r, std::integral_constant<int, 3>());
    if (rest == 2) dot(x, r, std::integral_constant<int, 2>());
    if (rest == 1) dot(x, r, std::integral_constant<int, 1>());
    put(rest);
}

#if defined(MESHD_AVX2)
constexpr int64_t PREDECODE_FROM = 24;  // activation rows from which a K-quant row is decoded ahead (measured: equal at 24)
#else
constexpr int64_t PREDECODE_FROM = 4;
#endif

template <int T>
void matmul_k(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K, const int8_t* xq,
              const float* xd, const int16_t* xs, int64_t M, float* out, int64_t ldo, const int64_t* colmap,
              int64_t col0) {
    std::vector<uint8_t> codes(K);
    std::vector<int16_t> sc(K / 2), mins(K / 16);
    std::vector<float> wd(K / 256), wm(K / 256);
    KRow k{codes.data(), sc.data(), mins.data(), wd.data(), wm.data(), 0};
    for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
        const int64_t m1 = m0 + M_TILE < M ? m0 + M_TILE : M;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t* row = w + n * row_bytes;
            const int64_t col = col0 + (colmap ? colmap[n] : n);
            // decoded once into memory for a long pass over many rows (a prompt); a verify round's few
            // rows decode as they read, sharing each unpacked block in registers
            const KRow* pre = nullptr;
            if (m1 - m0 >= PREDECODE_FROM) {
                decode_row_k<T>(row, K, k);
                pre = &k;
            }
            tile_rows(m0, m1, K, K / 256, xq, xd, xs, out, ldo, col, [&](const Act* x, float* r, auto R) {
#if defined(MESHD_AVX2)
                if (!pre) return rows_dot_k_fly<T, decltype(R)::value>(row, K, x, r);
#endif
                rows_dot_k<T, decltype(R)::value>(row, pre, K, x, r);
            });
        }
    }
}

}  // namespace
}  // namespace meshd

using namespace meshd;

extern "C" {

// Which build this is: 2 = AVX2/FMA/F16C, 0 = portable.
int meshd_kernel_isa() {
#if defined(MESHD_AVX2)
    return 2;
#else
    return 0;
#endif
}

// Bytes of one block and elements per block of a GGUF type this file computes on (0: not supported).
int meshd_block_bytes(int qtype) { return block_bytes(qtype); }
int meshd_block_elems(int qtype) { return block_bytes(qtype) ? block_elems(qtype) : 0; }

// The activation block the kernels pair with a weight type: 32 (Q8_0) or 256 (Q8_K); 0: not supported.
int meshd_act_block(int qtype) { return block_bytes(qtype) ? block_elems(qtype) : 0; }

// Rows [0, M) of x (float32, row stride ldx) as int8 codes, a scale per `qk` elements (32 or 256; amax /
// 127, round to nearest even) and the codes' sums per 16: llama.cpp's Q8_0 (qk 32) and Q8_K (qk 256).
// K must be a multiple of qk. Returns -1 for another qk.
int meshd_quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int qk, int8_t* q, float* d, int16_t* s) {
    if (qk != 32 && qk != 256) return -1;
    for (int64_t m = 0; m < M; m++) {
        const float* xr = x + m * ldx;
        for (int64_t j = 0; j < K / qk; j++) {
            const float* v = xr + qk * j;
            int8_t* qj = q + m * K + qk * j;
#if defined(MESHD_AVX2)
            // the same steps eight lanes at a time: max ignores NaN as fmax does, the conversion rounds to
            // nearest even as nearbyint does, and non-finite products become 0
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 vmax = _mm256_setzero_ps();
            for (int i = 0; i < qk; i += 8) vmax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)), vmax);
            float lanes[8];
            _mm256_storeu_ps(lanes, vmax);
            float amax = 0.0f;
            for (float l : lanes) amax = std::fmax(amax, l);
#else
            float amax = 0.0f;
            for (int i = 0; i < qk; i++) amax = std::fmax(amax, std::fabs(v[i]));
#endif
            float dj = amax / 127.0f;
            float id = dj != 0.0f ? 1.0f / dj : 0.0f;
            if (!std::isfinite(id) || !std::isfinite(dj)) {  // a tiny (subnormal) or non-finite block: zeros
                id = 0.0f;                                   // times NaN, the same in every build
                if (!std::isfinite(dj)) dj = NAN;
            }
#if defined(MESHD_AVX2)
            const __m256 vid = _mm256_set1_ps(id), inf = _mm256_set1_ps(INFINITY);
            for (int i = 0; i < qk; i += 32) {
                __m256i w[4];
                for (int g = 0; g < 4; g++) {
                    const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * g), vid);
                    const __m256 finite = _mm256_cmp_ps(_mm256_andnot_ps(sign, t), inf, _CMP_LT_OQ);
                    w[g] = _mm256_cvtps_epi32(_mm256_and_ps(t, finite));
                }
                // i32 -> i8 (values within +-127: no saturation); packs interleave 128-bit lanes, undone after
                const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
                _mm256_storeu_si256((__m256i*)(qj + i),
                                    _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
            }
#else
            for (int i = 0; i < qk; i++) {
                const float t = v[i] * id;
                qj[i] = std::isfinite(t) ? (int8_t)(int)std::nearbyint(t) : (int8_t)0;
            }
#endif
            d[m * (K / qk) + j] = dj;
            for (int h = 0; h < qk / 16; h++) {
                int sum = 0;
                for (int i = 0; i < 16; i++) sum += qj[16 * h + i];
                s[m * (K / 16) + (qk / 16) * j + h] = (int16_t)sum;
            }
        }
    }
    return 0;
}

// out[m, col0 + colmap[n]] = dot(weight row n, activation row m) for n in [n0, n1), m in [0, M).
// Returns 0, or -1 for a type this file does not compute on.
int meshd_gguf_matmul(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K,
                      const int8_t* xq, const float* xd, const int16_t* xs, int64_t M, float* out, int64_t ldo,
                      const int64_t* colmap, int64_t col0) {
#define MESHD_CASE(T) \
    case T: matmul_k<T>(w, row_bytes, n0, n1, K, xq, xd, xs, M, out, ldo, colmap, col0); return 0;
    switch (qtype) {
        MESHD_CASE(Q4_K) MESHD_CASE(Q5_K) MESHD_CASE(Q6_K)
        default: return small_matmul(qtype, w, row_bytes, n0, n1, K, xq, xd, xs, M, out, ldo, colmap, col0) ? 0 : -1;
    }
#undef MESHD_CASE
}

// One linear layer in one call: the row-wise concatenation of `nparts` GGUF matrices (fused q/k/v,
// gate/up) times x (float32 [M, K], row stride ldx), output rows [n0, n1) of the concatenation into
// out (float32 [M, ldo]). The activations are quantised here, once per activation block size the parts
// need. A caller splitting a product over threads gives each thread its own [n0, n1): every output
// element is computed the same way whichever range it falls in. Returns 0, -1 for an unknown type.
int meshd_linear(int nparts, const int* types, const uint8_t* const* w, const int64_t* row_bytes,
                 const int64_t* rows, const int64_t* const* colmaps, int64_t n0, int64_t n1, const float* x,
                 int64_t M, int64_t K, int64_t ldx, float* out, int64_t ldo) {
    std::vector<int8_t> q[2];
    std::vector<float> d[2];
    std::vector<int16_t> s[2];
    for (int p = 0; p < nparts; p++) {
        if (!block_bytes(types[p])) return -1;
        const int which = block_elems(types[p]) == 256 ? 1 : 0;
        if (q[which].empty()) {
            const int qk = which ? 256 : 32;
            q[which].resize(M * K);
            d[which].resize(M * (K / qk));
            s[which].resize(M * (K / 16));
            meshd_quantize_rows(x, M, K, ldx, qk, q[which].data(), d[which].data(), s[which].data());
        }
    }
    int64_t start = 0;
    for (int p = 0; p < nparts; p++) {
        const int64_t end = start + rows[p];
        const int64_t a = n0 > start ? n0 : start, b = n1 < end ? n1 : end;
        if (a < b) {
            const int which = block_elems(types[p]) == 256 ? 1 : 0;
            meshd_gguf_matmul(types[p], w[p], row_bytes[p], a - start, b - start, K, q[which].data(),
                              d[which].data(), s[which].data(), M, out, ldo, colmaps[p], start);
        }
        start = end;
    }
    return 0;
}

}  // extern "C"
