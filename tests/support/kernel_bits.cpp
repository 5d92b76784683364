// Prints the bits of the integer kernels' results on fixed inputs, one line per case, so that two builds
// (AVX2 and portable on x86, the ARM build under emulation) can be compared line by line. The inputs are
// made here with splitmix64, the same on every machine; the weights are random GGUF blocks with sane
// scales, the activations include the quantiser's edge values.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

extern "C" {
int meshd_block_bytes(int qtype);
int meshd_block_elems(int qtype);
int meshd_quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int qk, int8_t* q, float* d, int16_t* s);
int meshd_gguf_matmul(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K,
                      const int8_t* xq, const float* xd, const int16_t* xs, int64_t M, float* out, int64_t ldo,
                      const int64_t* colmap, int64_t col0);
void meshd_rms_norm(const float* x, int64_t ldx, const float* w, float* out, int64_t ldo, int64_t m, int64_t n, float eps);
void meshd_swiglu(const float* gu, int64_t ldg, int64_t m, int64_t inter, float* out, int64_t ldo);
}

namespace {
uint64_t state = 0x9E3779B97F4A7C15ull;
uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
float uniform() { return (float)((next() >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }  // [-1, 1), exact

void print(const char* what, const void* p, size_t n) {  // FNV-1a of the bytes: equal bits, equal line
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t*)p)[i]) * 1099511628211ull;
    std::printf("%s %016llx\n", what, (unsigned long long)h);
}

uint16_t half_of(float f) {  // a normal half: scales in [2^-10, 2^-6)
    const int e = 15 - 10 + (int)(next() % 4), m = (int)(next() % 1024);
    return (uint16_t)(((f < 0) << 15) | (e << 10) | m);
}
}  // namespace

int main() {
    const int types[] = {2, 3, 6, 7, 8, 12, 13, 14};
    const int64_t N = 24, MS[] = {1, 3, 6, 13};
    for (int t : types) {
        const int bb = meshd_block_bytes(t), be = meshd_block_elems(t);
        // the 32-element types: whole groups of four blocks, and three, two and one block over
        const int64_t ks[] = {512, be == 32 ? 480 : 768, be == 32 ? 448 : 1024, be == 32 ? 416 : 1280};
        for (int64_t K : ks) {
            const int64_t nb = K / be, row = nb * bb;
            std::vector<uint8_t> w(N * row);
            for (auto& b : w) b = (uint8_t)next();
            for (int64_t i = 0; i < N * nb; i++) {  // the float16 fields: finite scales (minimums too)
                uint8_t* b = w.data() + i * bb;
                const int at = t == 14 ? 208 : 0;
                uint16_t h = half_of(uniform());
                std::memcpy(b + at, &h, 2);
                if (t == 3 || t == 7 || t == 12 || t == 13) {
                    h = half_of(uniform());
                    std::memcpy(b + 2, &h, 2);
                }
            }
            const int64_t M = 13;
            std::vector<float> x(M * K);
            for (auto& v : x) v = uniform() * 3.0f;
            // the quantiser's edge values in row 4 (a NaN makes its whole row NaN: rows 0-3 stay finite, so
            // the one- and three-row products compare numbers), a block too small to scale in row 1
            float* edge = x.data() + 4 * K;
            edge[0] = NAN, edge[1] = INFINITY, edge[2] = 1e-40f, edge[3] = 0.5f, edge[4] = -2.5f;
            for (int64_t i = 0; i < 32; i++) x[K + i] = 1e-42f;
            std::vector<int8_t> q(M * K);
            std::vector<float> d(M * (K / be));
            std::vector<int16_t> s(M * (K / 16));
            meshd_quantize_rows(x.data(), M, K, K, be, q.data(), d.data(), s.data());
            char name[64];
            std::snprintf(name, sizeof name, "quantize t%d k%lld", t, (long long)K);
            print(name, q.data(), q.size());
            print(name, d.data(), d.size() * 4);
            print(name, s.data(), s.size() * 2);
            for (int64_t m : MS) {
                std::vector<float> out(m * N);
                meshd_gguf_matmul(t, w.data(), row, 0, N, K, q.data(), d.data(), s.data(), m, out.data(), N, nullptr, 0);
                std::snprintf(name, sizeof name, "matmul t%d k%lld m%lld", t, (long long)K, (long long)m);
                print(name, out.data(), out.size() * 4);
            }
        }
    }
    std::vector<float> x(6 * 520), w(520), out(6 * 520);
    for (auto& v : x) v = uniform() * 12.0f;
    for (auto& v : w) v = uniform();
    meshd_rms_norm(x.data(), 520, w.data(), out.data(), 520, 6, 520, 1e-6f);
    print("rms_norm", out.data(), out.size() * 4);
    meshd_swiglu(x.data(), 520, 6, 260, out.data(), 520);  // 260: whole groups of eight and a tail
    print("swiglu", out.data(), 6 * 520 * 4);
    return 0;
}
