// The testbed's delay proxy, compiled: each direction of each connection delayed by a fixed one-way time.
//
// Why beside delay_proxy.py: this kernel has no netem, so a proxy is the link's round trip, and on a
// machine whose cores all emulate devices the proxy's own CPU time lands on the link. The Python proxy
// costs ~0.15 ms an exchange of a tensor group's partial sums on a busy 2-core machine (its event loop
// woken twice an exchange), half again the 0.3 ms link it emulates; this one costs a few microseconds.
// Same behaviour: chunks stamped on arrival and released at their time (a pipeline, not a sleep), EOF
// travels with the same delay, a reset on one side aborts the other, reading pauses past 8 MiB queued.
//
// On time, not merely never early: at sub-millisecond delays the proxy's own wake-ups are a large part
// of the link (measured on a 2-core VM: a "0.3 ms" link gave 0.55 ms round trips when every chunk was
// stamped when the proxy woke and released when its timer woke it). So a chunk is stamped with the
// kernel's receive time (SO_TIMESTAMPNS), and the timer is armed early by the proxy's measured wake-up
// lateness (a running average), so chunks leave at their time on average; one may leave early by at
// most that lateness, which is capped at MAX_LEAD_NS.
//
//   delay_proxy --listen IP:PORT --target IP:PORT --one-way-ms X     (prints "READY host port")
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNS 1024
#define CHUNK 65536
#define MAX_QUEUED (8u << 20)
#define TIMER_ID ((uint64_t)-1)
#define LISTEN_ID ((uint64_t)-2)
#define MAX_LEAD_NS 100000ull  // the timer's lead never exceeds 0.1 ms (nor half the delay)

typedef struct Chunk {
    struct Chunk* next;
    uint64_t due;
    size_t len, off;
    int eof;
    char data[];
} Chunk;

typedef struct {
    int src, dst;  // read from src, write to dst
    Chunk *head, *tail;
    size_t queued;
    int src_eof, done, blocked;
} Dir;

typedef struct {
    int used;
    Dir d[2];  // d[0]: client -> target, d[1]: target -> client
} Conn;

static Conn conns[MAX_CONNS];
static int ep, tfd;
static uint64_t delay_ns;
static uint64_t lead_ns;   // how early the timer is armed: the running average of its wake-up lateness
static uint64_t armed_at;  // the absolute time the timer is armed for (0: not armed, or already due)

static uint64_t clock_ns(clockid_t id) {
    struct timespec t;
    clock_gettime(id, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static uint64_t now_ns(void) { return clock_ns(CLOCK_MONOTONIC); }

// the chunks whose time has come: due by now, or by the time the timer armed early for them would have
// woken the proxy
static uint64_t horizon(uint64_t now) { return now + lead_ns; }

static int parse_addr(const char* s, struct sockaddr_in* a) {
    char host[64];
    const char* colon = strrchr(s, ':');
    if (!colon || colon - s >= (long)sizeof host) return -1;
    memcpy(host, s, colon - s);
    host[colon - s] = 0;
    memset(a, 0, sizeof *a);
    a->sin_family = AF_INET;
    a->sin_port = htons((uint16_t)atoi(colon + 1));
    return inet_pton(AF_INET, host, &a->sin_addr) == 1 ? 0 : -1;
}

static void nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

// each socket is the src of one direction and the dst of the other: ask for what both need
static void interest(Conn* c, int side) {
    int fd = c->d[side].src;
    Dir* in = &c->d[side];
    Dir* out = &c->d[1 - side];
    struct epoll_event ev = {0};
    ev.events = ((!in->src_eof && in->queued < MAX_QUEUED) ? EPOLLIN : 0) | (out->blocked ? EPOLLOUT : 0);
    ev.data.u64 = ((uint64_t)(c - conns) << 1) | (uint64_t)side;
    epoll_ctl(ep, EPOLL_CTL_MOD, fd, &ev);
}

static void drop(Conn* c) {
    for (int s = 0; s < 2; s++) {
        Chunk* k = c->d[s].head;
        while (k) {
            Chunk* n = k->next;
            free(k);
            k = n;
        }
    }
    struct linger hard = {1, 0};
    setsockopt(c->d[0].src, SOL_SOCKET, SO_LINGER, &hard, sizeof hard);
    setsockopt(c->d[1].src, SOL_SOCKET, SO_LINGER, &hard, sizeof hard);
    close(c->d[0].src);
    close(c->d[1].src);
    memset(c, 0, sizeof *c);
}

static void finish_if_done(Conn* c) {
    if (c->d[0].done && c->d[1].done) {
        close(c->d[0].src);
        close(c->d[1].src);
        memset(c, 0, sizeof *c);
    }
}

// what is due goes out; returns -1 when the connection broke
static int pump(Conn* c, int side, uint64_t now) {
    Dir* d = &c->d[side];
    d->blocked = 0;
    while (d->head && d->head->due <= horizon(now)) {
        Chunk* k = d->head;
        if (k->eof) {
            shutdown(d->dst, SHUT_WR);
            d->done = 1;
        } else {
            while (k->off < k->len) {
                ssize_t n = send(d->dst, k->data + k->off, k->len - k->off, MSG_NOSIGNAL);
                if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                    d->blocked = 1;
                    interest(c, 1 - side);
                    return 0;
                }
                if (n < 0) return -1;
                k->off += (size_t)n;
            }
            d->queued -= k->len;
        }
        d->head = k->next;
        if (!d->head) d->tail = NULL;
        free(k);
    }
    interest(c, 1 - side);
    interest(c, side);
    return 0;
}

// when the chunk's bytes reached this host (the kernel's receive stamp, on the real-time clock), on the
// monotonic clock; ``now`` when there is no stamp
static uint64_t arrival(struct msghdr* msg, uint64_t now) {
    for (struct cmsghdr* c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_TIMESTAMPNS) continue;
        struct timespec ts;
        memcpy(&ts, CMSG_DATA(c), sizeof ts);
        uint64_t stamp = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
        uint64_t real = clock_ns(CLOCK_REALTIME), mono = now_ns();
        uint64_t at = stamp + mono - real;  // the same instant on the monotonic clock
        return at <= now ? at : now;        // never after we read it (a clock step)
    }
    return now;
}

static void enqueue(Dir* d, Chunk* k) {
    k->next = NULL;
    if (d->tail) d->tail->next = k;
    else d->head = k;
    d->tail = k;
}

// read what the socket has; returns -1 when the connection broke
static int take(Conn* c, int side, uint64_t now) {
    Dir* d = &c->d[side];
    while (!d->src_eof && d->queued < MAX_QUEUED) {
        Chunk* k = malloc(sizeof(Chunk) + CHUNK);
        char control[CMSG_SPACE(sizeof(struct timespec))];
        struct iovec iov = {k->data, CHUNK};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                             .msg_controllen = sizeof control};
        ssize_t n = recvmsg(d->src, &msg, 0);
        if (n < 0) {
            free(k);
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            return -1;
        }
        k->due = arrival(&msg, now) + delay_ns;
        k->off = 0;
        k->len = (size_t)n;
        k->eof = n == 0;
        if (n == 0) d->src_eof = 1;
        d->queued += (size_t)n;
        enqueue(d, k);
    }
    interest(c, side);
    return 0;
}

static void arm(void) {
    uint64_t next = 0;
    for (int i = 0; i < MAX_CONNS; i++) {
        if (!conns[i].used) continue;
        for (int s = 0; s < 2; s++) {
            Dir* d = &conns[i].d[s];
            if (d->head && !d->blocked && (!next || d->head->due < next)) next = d->head->due;
        }
    }
    struct itimerspec t = {0};
    if (next) next = next > lead_ns ? next - lead_ns : 1;
    armed_at = next > now_ns() ? next : 0;  // a deadline already past says nothing about wake-ups
    if (next) {
        t.it_value.tv_sec = (time_t)(next / 1000000000ull);
        t.it_value.tv_nsec = (long)(next % 1000000000ull);
        if (!t.it_value.tv_sec && !t.it_value.tv_nsec) t.it_value.tv_nsec = 1;
    }
    timerfd_settime(tfd, TFD_TIMER_ABSTIME, &t, NULL);
}

static void accept_all(int lfd, const struct sockaddr_in* target) {
    for (;;) {
        int a = accept4(lfd, NULL, NULL, SOCK_NONBLOCK);
        if (a < 0) return;
        int b = socket(AF_INET, SOCK_STREAM, 0);
        if (b < 0 || connect(b, (const struct sockaddr*)target, sizeof *target) < 0) {
            close(a);
            if (b >= 0) close(b);
            continue;
        }
        nonblock(b);
        int one = 1;
        setsockopt(a, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        setsockopt(b, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        setsockopt(a, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one);
        setsockopt(b, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one);
        int i = 0;
        while (i < MAX_CONNS && conns[i].used) i++;
        if (i == MAX_CONNS) {
            close(a);
            close(b);
            continue;
        }
        Conn* c = &conns[i];
        memset(c, 0, sizeof *c);
        c->used = 1;
        c->d[0].src = a, c->d[0].dst = b;
        c->d[1].src = b, c->d[1].dst = a;
        for (int s = 0; s < 2; s++) {
            struct epoll_event ev = {.events = EPOLLIN, .data.u64 = ((uint64_t)i << 1) | (uint64_t)s};
            epoll_ctl(ep, EPOLL_CTL_ADD, c->d[s].src, &ev);
        }
    }
}

int main(int argc, char** argv) {
    const char *listen_at = "127.0.0.1:0", *target_at = NULL;
    double one_way_ms = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--listen")) listen_at = argv[i + 1];
        else if (!strcmp(argv[i], "--target")) target_at = argv[i + 1];
        else if (!strcmp(argv[i], "--one-way-ms")) one_way_ms = atof(argv[i + 1]);
    }
    struct sockaddr_in la, ta;
    if (!target_at || parse_addr(listen_at, &la) || parse_addr(target_at, &ta) || one_way_ms < 0) {
        fprintf(stderr, "usage: delay_proxy --listen IP:PORT --target IP:PORT --one-way-ms X\n");
        return 2;
    }
    delay_ns = (uint64_t)(one_way_ms * 1e6);
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);  // wake on time: the default slack (50 us) is a third of 0.15 ms
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(lfd, (struct sockaddr*)&la, sizeof la) || listen(lfd, 128)) {
        perror("delay_proxy: listen");
        return 1;
    }
    socklen_t len = sizeof la;
    getsockname(lfd, (struct sockaddr*)&la, &len);
    char host[64];
    inet_ntop(AF_INET, &la.sin_addr, host, sizeof host);
    printf("READY %s %d\n", host, ntohs(la.sin_port));
    fflush(stdout);
    ep = epoll_create1(0);
    tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = LISTEN_ID};
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    ev.data.u64 = TIMER_ID;
    epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &ev);
    struct epoll_event evs[64];
    for (;;) {
        int n = epoll_wait(ep, evs, 64, -1);
        if (n < 0 && errno == EINTR) continue;
        uint64_t now = now_ns();
        for (int e = 0; e < n; e++) {
            uint64_t id = evs[e].data.u64;
            if (id == LISTEN_ID) {
                accept_all(lfd, &ta);
                continue;
            }
            if (id == TIMER_ID) {
                uint64_t expirations;
                if (read(tfd, &expirations, sizeof expirations) < 0) { /* spurious */ }
                if (armed_at && now >= armed_at) {  // learn how late this timer wakes the proxy
                    uint64_t late = now - armed_at, cap = delay_ns / 2 < MAX_LEAD_NS ? delay_ns / 2 : MAX_LEAD_NS;
                    lead_ns = (7 * lead_ns + (late < cap ? late : cap)) / 8;
                }
                for (int i = 0; i < MAX_CONNS; i++)
                    for (int s = 0; s < 2 && conns[i].used; s++)
                        if (pump(&conns[i], s, now) < 0) drop(&conns[i]);
                continue;
            }
            Conn* c = &conns[id >> 1];
            int side = (int)(id & 1);
            if (!c->used) continue;
            if ((evs[e].events & EPOLLOUT) && pump(c, 1 - side, now) < 0) {
                drop(c);
                continue;
            }
            if ((evs[e].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) && take(c, side, now) < 0) {
                drop(c);
                continue;
            }
            if (c->used && pump(c, side, now) < 0) {  // a zero delay releases at once
                drop(c);
                continue;
            }
            if (c->used) finish_if_done(c);
        }
        for (int i = 0; i < MAX_CONNS; i++)
            if (conns[i].used) finish_if_done(&conns[i]);
        arm();
    }
}
