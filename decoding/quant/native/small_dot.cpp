// Products of the 32-element GGUF types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: most of a Qwen2.5-0.5B, whose
// 896 columns are no multiple of the K-quants' 256) against int8-quantised activations.
//
// A block stores codes u with w = wd * (u - bias) (Q4_0: bias 8, Q5_0: 16, Q8_0: 0,
// its codes signed) or w = wd * u + wm (Q4_1, Q5_1: an offset). Against activation block j of a row:
//   S_j = sum(w codes * x codes), an exact integer (= sum(u * x) - bias * sum(x));
//   acc[j % 4] = fma(float(S_j), wd_j * dx_j, acc[j % 4]);
//   offset types, then: acc[j % 4] = fma(float(sum(x codes)), wm_j * dx_j, acc[j % 4]);
//   the row's result: (acc[0] + acc[1]) + (acc[2] + acc[3]).
// Why four accumulators by j mod 4 and one float step per block: a prompt's rows are taken four at a time
// and a decode step's blocks four at a time, each group's four exact sums reduced into one vector, so one
// vector float step serves four rows (or four blocks); both ways perform the very same float operations
// on every accumulator, so a row's bits are the same alone or among many.
//
// Same bits in both builds (see gguf_dot.cpp): the integer sums are exact, the float steps the same.

#include <vector>

#include "gguf_blocks.h"

namespace meshd {
namespace {

constexpr int small_bias(int t) { return t == Q4_0 ? 8 : t == Q5_0 ? 16 : 0; }
constexpr bool small_offset(int t) { return t == Q4_1 || t == Q5_1; }

#if defined(MESHD_AVX2)
inline __m256i nibbles16(const uint8_t* qs) {  // 16 bytes -> low nibbles (elements 0..15), high (16..31)
    const __m128i q = _mm_loadu_si128((const __m128i*)qs);
    const __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}
inline __m256i bits32(const uint8_t* p) {  // 32 bits -> 32 bytes of 0x10 where the bit is set
    uint32_t x;
    std::memcpy(&x, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

// A block's 32 codes as the products take them: unsigned (< 32, no bias applied) but Q8_0's, signed.
template <int T>
inline __m256i small_codes(const uint8_t* b) {
    if (T == Q8_0) return _mm256_loadu_si256((const __m256i*)(b + 2));
    if (T == Q4_0) return nibbles16(b + 2);
    if (T == Q4_1) return nibbles16(b + 4);
    if (T == Q5_0) return _mm256_or_si256(nibbles16(b + 6), bits32(b + 2));
    return _mm256_or_si256(nibbles16(b + 8), bits32(b + 4));  // Q5_1
}

// The codes times one activation block: i16 sums of pairs (unsigned codes: each |pair| <= 2 * 31 * 127,
// so eight elements still fit an i16) or, for Q8_0's signed codes, i32 sums of four.
template <int T>
inline __m256i small_product(__m256i u, __m256i xv) {
    if (T == Q8_0)
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(u), _mm256_sign_epi8(xv, u)), _mm256_set1_epi16(1));
    return _mm256_maddubs_epi16(u, xv);
}

// Four products (four rows' or four blocks') reduced to their four exact 32-element sums, in order.
template <int T>
inline __m128i small_sums4(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    __m256i h;
    if (T == Q8_0) h = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
    else h = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(p0, p1), _mm256_hadd_epi16(p2, p3)), _mm256_set1_epi16(1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));  // elements 0..15 + 16..31
}
#else
// A block's codes with the bias applied (signed; Q4_1/Q5_1's unsigned codes < 32 fit too) and its scales.
template <int T>
inline void small_decode(const uint8_t* b, int8_t* w, float& wd, float& wm) {
    wd = f16(b);
    wm = small_offset(T) ? f16(b + 2) : 0.0f;
    if (T == Q8_0) {
        std::memcpy(w, b + 2, 32);
        return;
    }
    const int off = T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8;
    const uint8_t* qs = b + off;
    uint32_t qh = 0;
    if (T == Q5_0 || T == Q5_1) std::memcpy(&qh, b + off - 4, 4);
    for (int i = 0; i < 16; i++) {
        int lo = qs[i] & 0xF, hi = qs[i] >> 4;
        if (T == Q5_0 || T == Q5_1) {
            lo |= ((qh >> i) & 1) << 4;
            hi |= ((qh >> (i + 16)) & 1) << 4;
        }
        w[i] = (int8_t)(lo - small_bias(T));
        w[i + 16] = (int8_t)(hi - small_bias(T));
    }
}
#endif

// The sum of the activation codes of block j (from the sums per 16 the quantiser keeps).
inline int act_sum32(const int16_t* s, int64_t j) { return (int)s[2 * j] + (int)s[2 * j + 1]; }

#if defined(MESHD_AVX2)
// The float scales (and the offset types' offsets) of four consecutive blocks: one conversion for the four.
template <int T>
inline void small_scales4(const uint8_t* b, __m128& wd, __m128& wm) {
    constexpr int BB = block_bytes(T);
    int32_t v[4];  // (d, m) of an offset type; d and two code bytes else
    for (int k = 0; k < 4; k++) std::memcpy(v + k, b + k * BB, 4);
    const __m256 f = _mm256_cvtph_ps(_mm_setr_epi32(v[0], v[1], v[2], v[3]));
    const __m128 lo = _mm256_castps256_ps128(f), hi = _mm256_extractf128_ps(f, 1);
    wd = _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
    wm = _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
}

// Blocks [j, j + n) (n <= 4) of one weight row against one activation row: their exact sums in one vector
// and one float step (lane k: accumulator k, the block j + k; j is a multiple of 4). With fewer than four
// blocks (a row's end) the other lanes keep their values.
template <int T>
inline __m128 small_blocks4(const uint8_t* b, const Act& x, int64_t j, int n, __m128 acc) {
    constexpr int BB = block_bytes(T);
    const __m256i* xv = (const __m256i*)(x.q + 32 * j);
    __m128i s, sx;
    __m128 wd, wm, dx;
    // the lanes of blocks that exist (all four but at a row's end)
    const __m128i live = _mm_cmpgt_epi32(_mm_set1_epi32(n), _mm_setr_epi32(0, 1, 2, 3));
    if (n == 4) {
        s = small_sums4<T>(small_product<T>(small_codes<T>(b), _mm256_loadu_si256(xv)),
                           small_product<T>(small_codes<T>(b + BB), _mm256_loadu_si256(xv + 1)),
                           small_product<T>(small_codes<T>(b + 2 * BB), _mm256_loadu_si256(xv + 2)),
                           small_product<T>(small_codes<T>(b + 3 * BB), _mm256_loadu_si256(xv + 3)));
        // the four blocks' activation sums: pairs of the sums per 16
        sx = _mm_madd_epi16(_mm_loadu_si128((const __m128i*)(x.s + 2 * j)), _mm_set1_epi16(1));
        small_scales4<T>(b, wd, wm);
        dx = _mm_loadu_ps(x.d + j);
    } else {
        // the missing blocks' lanes: products, sums, scales and offsets all zero (masked loads, no stores)
        const __m256i z = _mm256_setzero_si256();
        const auto product = [&](int k) { return k < n ? small_product<T>(small_codes<T>(b + k * BB), _mm256_loadu_si256(xv + k)) : z; };
        s = small_sums4<T>(product(0), product(1), product(2), z);
        sx = _mm_madd_epi16(_mm_maskload_epi32((const int*)(x.s + 2 * j), live), _mm_set1_epi16(1));
        dx = _mm_maskload_ps(x.d + j, live);
        const auto half = [&](int k, int at) { return k < n ? f16(b + k * BB + at) : 0.0f; };
        wd = _mm_setr_ps(half(0, 0), half(1, 0), half(2, 0), 0.0f);
        wm = small_offset(T) ? _mm_setr_ps(half(0, 2), half(1, 2), half(2, 2), 0.0f) : _mm_setzero_ps();
    }
    if (small_bias(T)) s = _mm_sub_epi32(s, _mm_slli_epi32(sx, small_bias(T) == 8 ? 3 : 4));
    __m128 a = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(wd, dx), acc);
    if (small_offset(T)) a = _mm_fmadd_ps(_mm_cvtepi32_ps(sx), _mm_mul_ps(wm, dx), a);
    return n == 4 ? a : _mm_blendv_ps(acc, a, _mm_castsi128_ps(live));
}

// One weight row of a 32-element type against one activation row (a decode step's product).
template <int T>
inline float small_row(const uint8_t* row, int64_t nb, const Act& x) {
    constexpr int BB = block_bytes(T);
    __m128 acc = _mm_setzero_ps();
    int64_t j = 0;
    for (; j + 4 <= nb; j += 4) {
        for (int l = 0; l < 4 * BB; l += 64) _mm_prefetch((const char*)(row + j * BB + PREFETCH_AHEAD + l), _MM_HINT_T0);
        acc = small_blocks4<T>(row + j * BB, x, j, 4, acc);
    }
    if (j < nb) acc = small_blocks4<T>(row + j * BB, x, j, (int)(nb - j), acc);
    // (a0 + a1) + (a2 + a3), each sum with its operands in that order (as the other paths add them)
    const __m128 t = _mm_add_ps(acc, _mm_shuffle_ps(acc, acc, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehl_ps(t, t)));
}

// Activation rows in groups of R (4 or 8) as the many-row product reads them, interleaved per block j:
// the rows' codes of block j side by side, then per row its scale, the bias times its codes' sum (Q4_0,
// Q5_0) and that sum as a float (Q4_1, Q5_1). One pointer walks a group, whatever K is.
template <int R>
struct RowGroup {
    std::vector<int8_t> q;      // [nb][R][32]
    std::vector<float> dx, sf;  // [nb][R]
    std::vector<int32_t> bsx;   // [nb][R]
};

// `live` < R: only the first `live` rows are real; the others repeat the last one (a verify round of two
// or three rows takes a group's pass, whose results per row are those of the row alone, and drops the copies).
template <int T, int R>
inline void fill_group(RowGroup<R>& g, const int8_t* xq, const float* xd, const int16_t* xs, int64_t m, int64_t K,
                       int live = R) {
    const int64_t nb = K / 32;
    g.q.resize(R * K);
    g.dx.resize(R * nb);
    g.sf.resize(R * nb);
    g.bsx.resize(R * nb);
    for (int r = 0; r < R; r++) {
        const int64_t src = m + (r < live ? r : live - 1);
        for (int64_t j = 0; j < nb; j++) {
            std::memcpy(g.q.data() + 32 * (R * j + r), xq + src * K + 32 * j, 32);
            const int sx = act_sum32(xs + src * (K / 16), j);
            g.dx[R * j + r] = xd[src * nb + j];
            g.sf[R * j + r] = (float)sx;
            g.bsx[R * j + r] = small_bias(T) * sx;
        }
    }
}

// Block j of a weight row against a group's R rows: R / 4 vectors of four exact sums, one float step each
// into the rows' accumulators of j mod 4 (`acc`, R / 4 vectors: lane r is row r).
template <int T, int R>
__attribute__((always_inline)) inline void small_step(const uint8_t* b, const RowGroup<R>& g, int64_t j, __m128* acc) {
    const __m256i u = small_codes<T>(b);
    const __m128 wd = _mm_set1_ps(f16(b));
    const __m256i* xv = (const __m256i*)(g.q.data() + 32 * R * j);
    for (int i = 0; i < R / 4; i++) {
        __m128i s = small_sums4<T>(small_product<T>(u, _mm256_loadu_si256(xv + 4 * i)),
                                   small_product<T>(u, _mm256_loadu_si256(xv + 4 * i + 1)),
                                   small_product<T>(u, _mm256_loadu_si256(xv + 4 * i + 2)),
                                   small_product<T>(u, _mm256_loadu_si256(xv + 4 * i + 3)));
        if (small_bias(T)) s = _mm_sub_epi32(s, _mm_loadu_si128((const __m128i*)(g.bsx.data() + R * j + 4 * i)));
        const __m128 dx = _mm_loadu_ps(g.dx.data() + R * j + 4 * i);
        acc[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(wd, dx), acc[i]);
        if (small_offset(T))
            acc[i] = _mm_fmadd_ps(_mm_loadu_ps(g.sf.data() + R * j + 4 * i), _mm_mul_ps(_mm_set1_ps(f16(b + 2)), dx), acc[i]);
    }
}

// One weight row against a group of R activation rows: each block decoded once for the R.
template <int T, int R>
inline void small_rows(const uint8_t* row, int64_t nb, const RowGroup<R>& g, float* out) {
    constexpr int BB = block_bytes(T);
    __m128 a0[R / 4], a1[R / 4], a2[R / 4], a3[R / 4];
    for (int i = 0; i < R / 4; i++) a0[i] = a1[i] = a2[i] = a3[i] = _mm_setzero_ps();
    int64_t j = 0;
    for (; j + 4 <= nb; j += 4) {
        small_step<T, R>(row + j * BB, g, j, a0);
        small_step<T, R>(row + (j + 1) * BB, g, j + 1, a1);
        small_step<T, R>(row + (j + 2) * BB, g, j + 2, a2);
        small_step<T, R>(row + (j + 3) * BB, g, j + 3, a3);
    }
    if (j < nb) small_step<T, R>(row + j * BB, g, j, a0);  // the last blocks: j is a multiple of 4 here
    if (j + 1 < nb) small_step<T, R>(row + (j + 1) * BB, g, j + 1, a1);
    if (j + 2 < nb) small_step<T, R>(row + (j + 2) * BB, g, j + 2, a2);
    for (int i = 0; i < R / 4; i++) _mm_storeu_ps(out + 4 * i, _mm_add_ps(_mm_add_ps(a0[i], a1[i]), _mm_add_ps(a2[i], a3[i])));
}
#else
// A weight row of a 32-element type decoded once for a pass over many activation rows.
struct SmallRow {
    std::vector<int8_t> w;
    std::vector<float> wd, wm;
};

template <int T>
inline void decode_row_small(const uint8_t* row, int64_t nb, SmallRow& o) {
    o.w.resize(32 * nb);
    o.wd.resize(nb);
    o.wm.resize(nb);
    for (int64_t j = 0; j < nb; j++) small_decode<T>(row + j * block_bytes(T), o.w.data() + 32 * j, o.wd[j], o.wm[j]);
}

// One weight row against one activation row, its blocks decoded beforehand (`pre`) or as they are read.
template <int T>
inline float small_row(const uint8_t* row, const SmallRow* pre, int64_t nb, const Act& x) {
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int8_t own[32];
    for (int64_t j = 0; j < nb; j++) {
        const int8_t* w = own;
        float wd, wm;
        if (pre) {
            w = pre->w.data() + 32 * j, wd = pre->wd[j], wm = pre->wm[j];
        } else {
            small_decode<T>(row + j * block_bytes(T), own, wd, wm);
        }
        const int8_t* xq = x.q + 32 * j;
        int s = 0;
        for (int e = 0; e < 32; e++) s += (int)w[e] * (int)xq[e];
        a[j & 3] = std::fma((float)s, wd * x.d[j], a[j & 3]);
        if (small_offset(T)) a[j & 3] = std::fma((float)act_sum32(x.s, j), wm * x.d[j], a[j & 3]);
    }
    return (a[0] + a[1]) + (a[2] + a[3]);
}
#endif

template <int T>
void matmul_small(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K, const int8_t* xq,
                  const float* xd, const int16_t* xs, int64_t M, float* out, int64_t ldo, const int64_t* colmap,
                  int64_t col0) {
    const int64_t nb = K / 32;
    const auto act = [&](int64_t m) { return Act{xq + m * K, xd + m * nb, xs + m * (K / 16)}; };
#if defined(MESHD_AVX2)
    constexpr int R = 8;  // rows a weight row's blocks are decoded for at once (and 4 for the rest)
    std::vector<RowGroup<R>> groups(M_TILE / R);
    RowGroup<4> fours[2];
    for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
        const int64_t m1 = m0 + M_TILE < M ? m0 + M_TILE : M;
        // groups of eight; the rest (0-7 rows) in groups of four, the last one filled up with copies when it
        // has two or three rows (a four-row pass costs less than three rows alone: the decoding is shared)
        const int64_t ng = (m1 - m0) / R, m4 = m0 + R * ng, rest = m1 - m4;
        const int n4 = rest >= 6 ? 2 : rest >= 2 ? 1 : 0;
        int live[2] = {0, 0};
        for (int i = 0; i < n4; i++) live[i] = (int)(rest - 4 * i < 4 ? rest - 4 * i : 4);
        for (int64_t i = 0; i < ng; i++) fill_group<T, R>(groups[i], xq, xd, xs, m0 + R * i, K);
        for (int i = 0; i < n4; i++) fill_group<T, 4>(fours[i], xq, xd, xs, m4 + 4 * i, K, live[i]);
        const int64_t m1s = m4 + live[0] + live[1];
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t* row = w + n * row_bytes;
            const int64_t col = col0 + (colmap ? colmap[n] : n);
            float r[R];
            for (int64_t i = 0; i < ng; i++) {
                small_rows<T, R>(row, nb, groups[i], r);
                for (int e = 0; e < R; e++) out[(m0 + R * i + e) * ldo + col] = r[e];
            }
            for (int i = 0; i < n4; i++) {
                small_rows<T, 4>(row, nb, fours[i], r);
                for (int e = 0; e < live[i]; e++) out[(m4 + 4 * i + e) * ldo + col] = r[e];
            }
            for (int64_t m = m1s; m < m1; m++) out[m * ldo + col] = small_row<T>(row, nb, act(m));
        }
    }
#else
    SmallRow pre;
    for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
        const int64_t m1 = m0 + M_TILE < M ? m0 + M_TILE : M;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t* row = w + n * row_bytes;
            const int64_t col = col0 + (colmap ? colmap[n] : n);
            const bool many = m1 - m0 >= 4;  // decode the row once for a pass over many
            if (many) decode_row_small<T>(row, nb, pre);
            for (int64_t m = m0; m < m1; m++) out[m * ldo + col] = small_row<T>(row, many ? &pre : nullptr, nb, act(m));
        }
    }
#endif
}

}  // namespace

bool small_matmul(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K,
                  const int8_t* xq, const float* xd, const int16_t* xs, int64_t M, float* out, int64_t ldo,
                  const int64_t* colmap, int64_t col0) {
#define MESHD_CASE(T) \
    case T: matmul_small<T>(w, row_bytes, n0, n1, K, xq, xd, xs, M, out, ldo, colmap, col0); return true;
    switch (qtype) {
        MESHD_CASE(Q4_0) MESHD_CASE(Q4_1) MESHD_CASE(Q5_0) MESHD_CASE(Q5_1) MESHD_CASE(Q8_0)
        default: return false;
    }
#undef MESHD_CASE
}

}  // namespace meshd
