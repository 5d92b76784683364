// A gguf-mode decode step through all of a stage's layers in one foreign call, and the one-row attention
// every lone row uses.
//
// Why: a decode step multiplies one row, so at one core the ~25 small torch operations between a
// layer's matrix products (each a dispatch of several microseconds) cost ~0.6 ms a layer: a sixth of
// the 1.5B's step and a third of the embedded model's, the gap to llama.cpp. Two foreign calls a layer
// with torch's SwiGLU between them still left ~30 us a layer of Python (~1 ms of the embedded model's
// 16 ms step). Here a layer is its attention half (RMSNorm, q/k/v, RoPE, the cache write, attention,
// the output product and residual, the second RMSNorm and gate/up), SwiGLU (row_ops.cpp) and the down
// product with its residual, and the stage's layers run in one call.
//
// Exactness: every step is the same function, in the same order, as the per-operation path a verify
// round or a prompt's lone rows take (row_ops.cpp, gguf_dot.cpp, meshd_row_attention below), so a decode
// step and the same row in any other pass give the same bits (the gguf mode's rule).
//
// Threads: a product's output rows and attention's heads are split over a small pool of this library's
// own threads; each output element is computed the same way whichever thread computes it.

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

extern "C" {
int meshd_linear(int nparts, const int* types, const uint8_t* const* w, const int64_t* row_bytes,
                 const int64_t* rows, const int64_t* const* colmaps, int64_t n0, int64_t n1, const float* x,
                 int64_t M, int64_t K, int64_t ldx, float* out, int64_t ldo);
void meshd_rms_norm(const float* x, int64_t ldx, const float* w, float* out, int64_t ldo, int64_t m, int64_t n,
                    float eps);
void meshd_rope(float* x, int64_t n, int64_t heads, int64_t hd, int64_t row_stride, int64_t head_stride,
                const float* cos, const float* sin);
void meshd_swiglu(const float* gu, int64_t ldg, int64_t m, int64_t inter, float* out, int64_t ldo);
}

namespace {

// A fused matrix as FusedMatrices (native/__init__.py) lays it out.
struct Matrix {
    int nparts;
    const int* types;
    const uint8_t* const* w;
    const int64_t* row_bytes;
    const int64_t* rows;
    const int64_t* const* colmaps;
    int64_t n_out;
    int64_t k;
};

// Keys and values of one sequence at one layer, in segments (a forked sequence reads its ancestors'
// prefixes in place): segment s holds lengths[s] positions, head h's keys at keys[s] + h * head_strides[s],
// one position every hd floats.
struct Segments {
    int n;
    const float* const* keys;
    const float* const* values;
    const int64_t* lengths;
    const int64_t* head_strides;
};

// Workers that wait for a job, run their share, and go back to waiting. They spin briefly before
// sleeping: a decode step's products follow one another within microseconds. Every worker acknowledges
// every job, its share or not, so none can still be reading one job's fields when the next is posted.
class Pool {
public:
    void run(int threads, const std::function<void(int, int)>& job) {
        if (threads <= 1) {
            job(0, 1);
            return;
        }
        std::lock_guard<std::mutex> one_job(run_lock_);
        grow(threads - 1);
        {
            std::lock_guard<std::mutex> g(m_);
            job_ = &job;
            nthreads_ = threads;
            pending_.store((int)workers_.size(), std::memory_order_relaxed);
            generation_.fetch_add(1, std::memory_order_release);
        }
        cv_.notify_all();
        job(0, threads);
        while (pending_.load(std::memory_order_acquire) != 0) relax();
    }

private:
    static inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#else
        std::this_thread::yield();
#endif
    }

    void grow(int n) {
        while ((int)workers_.size() < n) {
            const int id = (int)workers_.size() + 1;
            // the generation before this job's: a worker that starts late still sees the job
            const uint64_t seen = generation_.load(std::memory_order_acquire);
            workers_.emplace_back([this, id, seen] { loop(id, seen); });
            workers_.back().detach();
        }
    }

    void loop(int id, uint64_t seen) {
        for (;;) {
            uint64_t g = seen;
            for (int spin = 0; spin < 20000 && (g = generation_.load(std::memory_order_acquire)) == seen; spin++)
                relax();
            if (g == seen) {
                std::unique_lock<std::mutex> lk(m_);
                cv_.wait(lk, [&] { return (g = generation_.load(std::memory_order_acquire)) != seen; });
            }
            seen = g;  // one job at a time: run() waits for every worker's acknowledgement before the next
            if (id < nthreads_) (*job_)(id, nthreads_);
            pending_.fetch_sub(1, std::memory_order_acq_rel);
        }
    }

    std::mutex run_lock_, m_;
    std::condition_variable cv_;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> pending_{0};
    const std::function<void(int, int)>* job_ = nullptr;
    int nthreads_ = 1;
    std::vector<std::thread> workers_;
};

Pool& pool() {
    static Pool* p = new Pool();  // never destroyed: detached workers may outlive static destruction
    return *p;
}

// Rows [n0, n1) of the share `t` of `T` threads (the same split a caller of meshd_linear makes).
inline void share(int64_t n, int t, int T, int64_t* a, int64_t* b) {
    const int64_t step = (n + T - 1) / T;
    *a = step * t < n ? step * t : n;
    *b = step * (t + 1) < n ? step * (t + 1) : n;
}

// out (float32 [M, ldo]) = x (float32 [M, k], row stride ldx) @ m.T, the output rows split over the pool.
void linear_rows(const Matrix& m, const float* x, int64_t M, int64_t ldx, float* out, int64_t ldo, int threads) {
    pool().run(threads, [&](int t, int T) {
        int64_t a, b;
        share(m.n_out, t, T, &a, &b);
        if (a < b) meshd_linear(m.nparts, m.types, m.w, m.row_bytes, m.rows, m.colmaps, a, b, x, M, m.k, ldx, out, ldo);
    });
}

inline void linear(const Matrix& m, const float* x, float* out, int threads) {
    linear_rows(m, x, 1, m.k, out, m.n_out, threads);
}

// Dot product of two rows of hd floats in eight lanes (element i in lane i % 8), summed in a fixed tree.
inline float dot8(const float* a, const float* b, int64_t hd) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int64_t whole = hd - hd % 8;
    for (int64_t i = 0; i < whole; i += 8)
        for (int l = 0; l < 8; l++) acc[l] = acc[l] + a[i + l] * b[i + l];
    for (int64_t i = whole; i < hd; i++) acc[i - whole] = acc[i - whole] + a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// The attention of n query heads that share one key/value head (grouped-query attention), one query
// row each, over every segment's positions in position order. The heads go through the keys and the
// values together, so a long context is read once per group rather than once per head (Qwen2.5 has
// six query heads a key/value head); each head's own steps are those of a head alone, in its order.
void attend_heads(const float* q, int64_t n, const Segments& s, int64_t kv_head, int64_t hd, float scale,
                  float* out, std::vector<float>& scores, std::vector<float>& mx) {
    int64_t total = 0;
    for (int i = 0; i < s.n; i++) total += s.lengths[i];
    scores.resize(n * total);
    mx.assign(n, -INFINITY);
    int64_t j = 0;
    for (int i = 0; i < s.n; i++) {
        const float* k = s.keys[i] + kv_head * s.head_strides[i];
        for (int64_t p = 0; p < s.lengths[i]; p++, j++) {
            const float* kr = k + p * hd;
            for (int64_t h = 0; h < n; h++) {
                const float v = dot8(q + h * hd, kr, hd) * scale;
                scores[h * total + j] = v;
                mx[h] = v > mx[h] ? v : mx[h];
            }
        }
    }
    for (int64_t h = 0; h < n; h++) {
        float* sc = scores.data() + h * total;
        float sum = 0.0f;
        for (int64_t p = 0; p < total; p++) {
            const float e = std::exp(sc[p] - mx[h]);
            sc[p] = e;
            sum = sum + e;
        }
        mx[h] = 1.0f / sum;  // from here on: the head's 1 / sum
    }
    for (int64_t d = 0; d < n * hd; d++) out[d] = 0.0f;
    j = 0;
    for (int i = 0; i < s.n; i++) {
        const float* v = s.values[i] + kv_head * s.head_strides[i];
        for (int64_t p = 0; p < s.lengths[i]; p++, j++) {
            const float* vr = v + p * hd;
            for (int64_t h = 0; h < n; h++) {
                const float w = scores[h * total + j] * mx[h];
                float* o = out + h * hd;
                for (int64_t d = 0; d < hd; d++) o[d] = o[d] + w * vr[d];
            }
        }
    }
}

// Heads are split over the pool as before; a thread takes the heads of its share that share a
// key/value head together.
void attention(const float* q, int64_t nh, int64_t nkv, int64_t hd, float scale, const Segments& s, float* out,
               int threads) {
    const int64_t group = nh / nkv;
    pool().run(threads, [&](int t, int T) {
        int64_t a, b;
        share(nh, t, T, &a, &b);
        thread_local std::vector<float> scores, mx;
        for (int64_t h = a; h < b;) {
            const int64_t g = h / group, end = (g + 1) * group < b ? (g + 1) * group : b;
            attend_heads(q + h * hd, end - h, s, g, hd, scale, out + h * hd, scores, mx);
            h = end;
        }
    });
}

}  // namespace

extern "C" {

// A product of any row count on `threads` of the pool (BlockLinear's one call): each output element is
// computed the same way whichever thread's share it falls in.
void meshd_linear_threads(const Matrix* m, const float* x, int64_t M, int64_t ldx, float* out, int64_t ldo,
                          int threads) {
    linear_rows(*m, x, M, ldx, out, ldo, threads);
}

// One query row per head, q [nh, hd] contiguous, attending over `s`'s positions; out [nh, hd].
// Every lone row of the gguf mode (a decode step, a verify round's rows, a
// prompt's last partial block) attends through this, so each gets the same bits in any of them.
void meshd_row_attention(const float* q, int64_t nh, int64_t nkv, int64_t hd, float scale, const Segments* s,
                         float* out, int threads) {
    attention(q, nh, nkv, hd, scale, *s, out, threads);
}

}  // extern "C"

namespace {

// One layer's weights as meshd_decode_layers reads them (DecodeLayerSpec in native/__init__.py).
struct DecodeLayer {
    const Matrix* qkv;
    const float* qkv_bias;  // null: none (Llama); Qwen2's q/k/v biases
    const Matrix* o;
    const Matrix* gate_up;
    const Matrix* down;
    const float* attn_norm;
    const float* mlp_norm;
};

// A tensor-parallel member's partial sum (o's and down's outputs, every row of the step) handed to its group,
// which replaces it in place with the sum over the members; non-zero: the group failed and the step stops.
// ctx: the reducer's own (group_sum.cpp's GroupSum, or null for a Python callback).
typedef int (*ReduceFn)(void* ctx, float* x, int64_t n);

struct Reducer {
    ReduceFn fn;
    void* ctx;
    bool operator()(float* x, int64_t n) const { return fn && fn(ctx, x, n); }  // true: the group failed
};

// Where one row's sequence keeps its keys and values (see meshd_decode_layers).
struct RowCache {
    int nseg;
    float* const* key_base;
    float* const* value_base;
    const int64_t* lengths;
    const int64_t* head_strides;
    const int64_t* layer_step;
    int64_t own;
    int64_t dst_head_stride;
};

// The attention half of a decoder layer for R rows h [R, hidden], one per sequence (updated in place:
// h += attention's output): each row's new key and value written into its own sequence's cache at layer
// li and attended over that sequence's positions alone; out_gate_up [R, 2 * intermediate] receives the
// MLP's first product. scratch: at least R * (hidden + q/k/v width + nh * hd) floats. The products take
// all R rows at once (the weights read once: a row's bits do not depend on the others), everything else
// is row by row, as the per-operation path does it.
bool decode_attention(const DecodeLayer& L, int li, float eps, int64_t R, float* h, const float* cos,
                      const float* sin, int64_t nh, int64_t nkv, int64_t hd, float scale, const RowCache* rows,
                      float* out_gate_up, float* scratch, int threads, Reducer reduce,
                      std::vector<const float*>& keys, std::vector<const float*>& values) {
    const int64_t hidden = L.o->n_out, width = L.qkv->n_out;
    float* x = scratch;
    float* qkv_out = x + R * hidden;
    float* attn = qkv_out + R * width;
    meshd_rms_norm(h, hidden, L.attn_norm, x, hidden, R, hidden, eps);
    linear_rows(*L.qkv, x, R, hidden, qkv_out, width, threads);
    if (L.qkv_bias)
        for (int64_t r = 0; r < R; r++)
            for (int64_t i = 0; i < width; i++) qkv_out[r * width + i] = qkv_out[r * width + i] + L.qkv_bias[i];
    meshd_rope(qkv_out, R, nh, hd, width, hd, cos, sin);
    meshd_rope(qkv_out + nh * hd, R, nkv, hd, width, hd, cos, sin);
    for (int64_t r = 0; r < R; r++) {
        const RowCache& c = rows[r];
        const float* q = qkv_out + r * width;
        const float* k = q + nh * hd;
        const float* v = k + nkv * hd;
        const int last = c.nseg - 1;
        float* k_dst = c.key_base[last] + li * c.layer_step[last] + c.own;
        float* v_dst = c.value_base[last] + li * c.layer_step[last] + c.own;
        for (int64_t g = 0; g < nkv; g++) {
            std::memcpy(k_dst + g * c.dst_head_stride, k + g * hd, hd * sizeof(float));
            std::memcpy(v_dst + g * c.dst_head_stride, v + g * hd, hd * sizeof(float));
        }
        keys.resize(c.nseg);
        values.resize(c.nseg);
        for (int j = 0; j < c.nseg; j++) {
            keys[j] = c.key_base[j] + li * c.layer_step[j];
            values[j] = c.value_base[j] + li * c.layer_step[j];
        }
        const Segments s{c.nseg, keys.data(), values.data(), c.lengths, c.head_strides};
        attention(q, nh, nkv, hd, scale, s, attn + r * nh * hd, threads);
    }
    linear_rows(*L.o, attn, R, nh * hd, x, hidden, threads);
    if (reduce(x, R * hidden)) return false;
    for (int64_t i = 0; i < R * hidden; i++) h[i] = h[i] + x[i];
    meshd_rms_norm(h, hidden, L.mlp_norm, x, hidden, R, hidden, eps);
    linear_rows(*L.gate_up, x, R, hidden, out_gate_up, L.gate_up->n_out, threads);
    return true;
}

// The MLP's last product and the residual for R rows: h += act @ down.T. scratch: R * hidden floats.
bool decode_down(const Matrix& down, int64_t R, const float* act, float* h, float* scratch, int threads,
                 Reducer reduce) {
    linear_rows(down, act, R, down.k, scratch, down.n_out, threads);
    if (reduce(scratch, R * down.n_out)) return false;
    for (int64_t i = 0; i < R * down.n_out; i++) h[i] = h[i] + scratch[i];
    return true;
}

}  // namespace

extern "C" {

// R rows h [R, hidden] (updated in place), each the one new row of its own sequence, through n_layers
// layers; cos/sin [R, hd] are each row's rotation. Row r's sequence keeps its keys and values in
// nseg[r] segments, listed one row after another in key_base/value_base/lengths/head_strides/layer_step:
// segment j's layer li starts at key_base[j] / value_base[j] + li * layer_step[j] floats, holds lengths[j]
// positions (the last one's count includes the new row) with head stride head_strides[j]; the new row's
// key and value go own[r] floats into its last segment's layer, head stride dst_head_stride[r].
// gate_up: R * 2 * intermediate floats; act: R * intermediate; scratch: R * (hidden + q/k/v width +
// nh * hd). reduce (null on one device): a group member's partial sums summed over its group, called with
// reduce_ctx; reduce_attention the same for the attention output (null also for a member that computes every
// head: its output is whole). *done grows by R after each layer (another thread may read it: a long pass shows
// its progress). Returns 0, or 1 when the group failed (h is then unusable).
int meshd_decode_layers(int n_layers, const DecodeLayer* layers, float eps, int64_t R, float* h, const float* cos,
                         const float* sin, int64_t nh, int64_t nkv, int64_t hd, float scale, const int* nseg,
                         float* const* key_base, float* const* value_base, const int64_t* lengths,
                         const int64_t* head_strides, const int64_t* layer_step, const int64_t* own,
                         const int64_t* dst_head_stride, float* gate_up, float* act, float* scratch, int threads,
                         ReduceFn reduce_attention, void* reduce_attention_ctx, ReduceFn reduce, void* reduce_ctx,
                         int64_t* done) {
    const Reducer by_attention{reduce_attention, reduce_attention_ctx}, by_mlp{reduce, reduce_ctx};
    std::vector<RowCache> rows(R);
    for (int64_t r = 0, at = 0; r < R; at += nseg[r], r++)
        rows[r] = RowCache{nseg[r], key_base + at, value_base + at, lengths + at, head_strides + at, layer_step + at,
                           own[r], dst_head_stride[r]};
    std::vector<const float*> keys, values;
    for (int li = 0; li < n_layers; li++) {
        const DecodeLayer& L = layers[li];
        if (!decode_attention(L, li, eps, R, h, cos, sin, nh, nkv, hd, scale, rows.data(), gate_up, scratch, threads,
                              by_attention, keys, values))
            return 1;
        const int64_t inter = L.down->k;
        meshd_swiglu(gate_up, 2 * inter, R, inter, act, inter);
        if (!decode_down(*L.down, R, act, h, scratch, threads, by_mlp)) return 1;
        __atomic_add_fetch(done, R, __ATOMIC_RELAXED);
    }
    return 0;
}

}  // extern "C"
