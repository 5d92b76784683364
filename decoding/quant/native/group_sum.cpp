// A tensor-parallel member's partial sums summed over its group by the decode kernel's own thread, without
// a trip through Python for each of them.
//
// Why here: a decode step of a split model makes one or two reductions a layer, each a few kilobytes that
// the next half-layer waits for. Through a Python callback each one took the GIL, built arrays, sealed and
// opened its frames in Python and added in numpy: ~35 us a side on top of the socket (measured inside a
// decode step over the testbed's link), 29-57 times a token. Here the same frames are written and read by C.
//
// The streams and their keys stay transport.group_stream's: this code gets each stream's socket and its
// two libsodium secretstream states (the very memory PyNaCl seals and opens with, so whichever side seals
// next continues the same nonce sequence) and libsodium's own push/pull, handed over as function pointers.
// A frame is what group_stream writes: a 4-byte little-endian length, then the sealed message
// (kind u8, pass u32, exchange u32, payload); frames are read exactly, never past the one awaited, so the
// Python side finds the stream where it left it. The sum is added in rank order, element by element, as
// decoding.tensor_group.add_in_rank_order does: every member holds the same bits, whichever path it took.
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <time.h>

namespace {

typedef int (*SealFn)(void* state, unsigned char* c, unsigned long long* clen, const unsigned char* m,
                      unsigned long long mlen, const unsigned char* ad, unsigned long long adlen, unsigned char tag);
typedef int (*OpenFn)(void* state, unsigned char* m, unsigned long long* mlen, unsigned char* tag,
                      const unsigned char* c, unsigned long long clen, const unsigned char* ad,
                      unsigned long long adlen);
typedef int (*CheckFn)(void);

constexpr int MAX_PEERS = 15;
constexpr size_t ABYTES = 17;  // crypto_secretstream_xchacha20poly1305_ABYTES
constexpr size_t HEADER = 9;   // kind, pass, exchange (group_stream.HEADER, "<BII")
constexpr size_t PAD = 7;      // the plaintext lands at +7, so its payload starts 16-byte aligned
constexpr uint32_t MAX_FRAME = 1u << 30;
constexpr uint8_t PARTIAL = 1;

// v sized n, its storage given back when it held far more (a long prompt's chunk, once)
template <typename T>
void fit(std::vector<T>& v, size_t n) {
    v.resize(n);
    if (v.capacity() > 4 * n && v.capacity() * sizeof(T) > (1u << 20)) v.shrink_to_fit();
}

double now_s() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

}  // namespace

extern "C" {

struct PeerStream {
    int32_t rank;
    int32_t fd;
    void* push_state;
    void* pull_state;
};

// transport.group_link's _NativeSum (ctypes) lays this out field for field.
struct GroupSum {
    double spin_s;       // wait this long without sleeping (yielding the core) ...
    double last_wait_s;  // ... while the last exchange's wait was shorter than that (updated here)
    int32_t slice_ms;    // a blocked wait asks check() this often
    int32_t rank, size, npeers;
    int32_t abort;  // set by any thread: the waits end
    uint32_t pass, exchange;  // exchange: the last one made (incremented here)
    SealFn seal;
    OpenFn open;
    CheckFn check;  // non-zero: the group is lost (the links' health, a member told to leave)
    PeerStream peers[MAX_PEERS];
    char error[256];
};

}  // extern "C"

namespace {

struct Incoming {
    uint8_t len_bytes[4];
    size_t have_len = 0, have = 0;
    uint32_t len = 0;
    std::vector<unsigned char> sealed, plain;
    bool done = false;
};

struct Outgoing {
    std::vector<unsigned char> frame;
    size_t sent = 0;
};

int fail(GroupSum* g, const char* fmt, long a = 0, long b = 0, long c = 0, long d = 0) {
    std::snprintf(g->error, sizeof g->error, fmt, a, b, c, d);
    return 1;
}

// Reads what the socket has of peer p's frames, up to the one awaited. 0: nothing more to read now (or the
// awaited frame is in), 1: the group failed (g->error says why).
int receive(GroupSum* g, const PeerStream& p, Incoming& in, size_t payload_bytes) {
    while (!in.done) {
        ssize_t got;
        if (in.have_len < 4) {
            got = recv(p.fd, in.len_bytes + in.have_len, 4 - in.have_len, MSG_DONTWAIT);
        } else {
            // the buffer grows with the bytes that come, not with what an unauthenticated length claims
            const size_t want = in.len - in.have < (1u << 20) ? in.len : in.have + (1u << 20);
            if (in.sealed.size() < want) in.sealed.resize(want);
            got = recv(p.fd, in.sealed.data() + in.have, want - in.have, MSG_DONTWAIT);
        }
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
        if (got < 0) return fail(g, "group member %ld dropped its link (errno %ld)", p.rank, errno);
        if (got == 0) return fail(g, "group member %ld dropped its link (the stream closed)", p.rank);
        if (in.have_len < 4) {
            in.have_len += size_t(got);
            if (in.have_len < 4) continue;
            in.len = uint32_t(in.len_bytes[0]) | uint32_t(in.len_bytes[1]) << 8 | uint32_t(in.len_bytes[2]) << 16 |
                     uint32_t(in.len_bytes[3]) << 24;
            if (in.len > MAX_FRAME || in.len < ABYTES + HEADER)
                return fail(g, "group member %ld sent a %ld-byte frame (broken stream)", p.rank, long(in.len));
            in.have = 0;
            continue;
        }
        in.have += size_t(got);
        if (in.have < in.len) continue;
        // a whole frame: open it (in order: a dropped, replayed or altered frame fails here)
        const size_t mlen = in.len - ABYTES;
        if (in.plain.size() < PAD + mlen) in.plain.resize(PAD + mlen);
        unsigned long long out_len = 0;
        unsigned char tag = 0;
        if (g->open(p.pull_state, in.plain.data() + PAD, &out_len, &tag, in.sealed.data(), in.len, nullptr, 0) != 0)
            return fail(g, "a frame from group member %ld failed authentication", p.rank);
        in.have_len = 0;
        const unsigned char* m = in.plain.data() + PAD;
        uint32_t pass, number;
        std::memcpy(&pass, m + 1, 4);
        std::memcpy(&number, m + 5, 4);
        if (m[0] != PARTIAL) continue;  // not a partial sum: nothing this exchange reads
        if (pass == g->pass && number == g->exchange) {
            if (mlen - HEADER != payload_bytes)
                return fail(g, "group member %ld sent %ld bytes for a %ld-byte partial sum", p.rank,
                            long(mlen - HEADER), long(payload_bytes));
            in.done = true;
            return 0;
        }
        if (pass < g->pass || (pass == g->pass && number < g->exchange)) continue;  // given up: nobody waits
        // a later exchange before the awaited one: the stream is in order, so the awaited one never comes
        return fail(g, "group member %ld is at pass %ld exchange %ld, this member at pass %ld", p.rank, long(pass),
                    long(number), long(g->pass));
    }
    return 0;
}

}  // namespace

extern "C" {

// The kernel's ReduceFn: x [n] (this member's partial) becomes the sum over the group, in rank order.
// Non-zero: the group failed (g->error says why; a lost link, an abort, a broken stream).
int meshd_group_sum(void* ctx, float* x, int64_t n) {
    GroupSum* g = static_cast<GroupSum*>(ctx);
    thread_local std::vector<Outgoing> out;
    thread_local std::vector<Incoming> in;
    thread_local std::vector<float> own;
    thread_local std::vector<pollfd> fds;
    const int np = g->npeers;
    const size_t bytes = size_t(n) * sizeof(float);
    out.resize(np);
    in.resize(np);
    g->exchange++;
    thread_local std::vector<unsigned char> message;  // kind, pass, exchange, the partial
    fit(message, HEADER + bytes);
    message[0] = PARTIAL;
    std::memcpy(message.data() + 1, &g->pass, 4);
    std::memcpy(message.data() + 5, &g->exchange, 4);
    std::memcpy(message.data() + HEADER, x, bytes);
    for (int i = 0; i < np; i++) {
        Outgoing& o = out[i];
        const uint32_t len = uint32_t(HEADER + bytes + ABYTES);
        fit(o.frame, 4 + size_t(len));
        for (int b = 0; b < 4; b++) o.frame[b] = uint8_t(len >> (8 * b));
        unsigned long long clen = 0;
        if (g->seal(g->peers[i].push_state, o.frame.data() + 4, &clen, message.data(), message.size(), nullptr, 0, 0) != 0)
            return fail(g, "sealing a partial sum failed");
        o.sent = 0;
        Incoming& r = in[i];
        r.done = false;
        r.have_len = 0;
        fit(r.sealed, len);  // the awaited frame's size (a larger one grows it as its bytes come)
        fit(r.plain, PAD + HEADER + bytes);
    }
    fit(own, size_t(n));
    std::memcpy(own.data(), x, bytes);
    const double started = now_s();
    const double spin_until = started + (g->last_wait_s < g->spin_s ? g->spin_s : 0.0);
    double checked = started;
    fds.resize(np);
    for (;;) {
        bool waiting = false;
        for (int i = 0; i < np; i++) {
            Outgoing& o = out[i];
            while (o.sent < o.frame.size()) {
                ssize_t s = send(g->peers[i].fd, o.frame.data() + o.sent, o.frame.size() - o.sent,
                                 MSG_DONTWAIT | MSG_NOSIGNAL);
                if (s < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
                if (s < 0) return fail(g, "group member %ld dropped its link (errno %ld)", g->peers[i].rank, errno);
                o.sent += size_t(s);
            }
            if (receive(g, g->peers[i], in[i], bytes)) return 1;
            waiting = waiting || o.sent < o.frame.size() || !in[i].done;
        }
        if (!waiting) break;
        if (__atomic_load_n(&g->abort, __ATOMIC_RELAXED)) return fail(g, "this member's group wait was aborted");
        if (now_s() < spin_until) {
            sched_yield();
            continue;
        }
        // a peer whose frame is in is still watched for its link going (a reset or close), not for its next
        // frame (that is the next exchange's to read: asked for here, it would wake this wait at once)
        for (int i = 0; i < np; i++) {
            fds[i].fd = g->peers[i].fd;
            fds[i].events = short((in[i].done ? POLLRDHUP : POLLIN) | (out[i].sent < out[i].frame.size() ? POLLOUT : 0));
            fds[i].revents = 0;
        }
        int ready = poll(fds.data(), nfds_t(np), g->slice_ms);
        if (ready < 0 && errno != EINTR) return fail(g, "waiting on the group's links failed (errno %ld)", errno);
        for (int i = 0; i < np && ready > 0; i++) {
            if (fds[i].revents & POLLNVAL) return fail(g, "this member's group links were closed");
            if (in[i].done && (fds[i].revents & (POLLERR | POLLHUP | POLLRDHUP)))
                return fail(g, "group member %ld dropped its link", g->peers[i].rank);
        }
        const double now = now_s();
        if (now - checked >= g->slice_ms * 1e-3) {  // the links' health and a leaving member, now and then
            checked = now;
            if (g->check && g->check()) return fail(g, "the group was lost while this member waited");
        }
    }
    g->last_wait_s = now_s() - started;
    // every member adds the parts in rank order: the first part, then each later one
    const float* part[MAX_PEERS + 1];
    part[g->rank] = own.data();
    for (int i = 0; i < np; i++)
        part[g->peers[i].rank] = reinterpret_cast<const float*>(in[i].plain.data() + PAD + HEADER);
    std::memcpy(x, part[0], bytes);
    for (int r = 1; r < g->size; r++) {
        const float* p = part[r];
        for (int64_t j = 0; j < n; j++) x[j] = x[j] + p[j];
    }
    return 0;
}

}  // extern "C"
