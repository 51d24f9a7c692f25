/* dist.h: data parallelism across processes (docs/DESIGN.md §17), the host part both engines share.
 *
 * Ranks come from torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
 * MASTER_PORT); WORLD_SIZE unset or 1 is one process and every function here is then a no-op.
 * The control plane is a TCP star: rank 0 listens on MASTER_ADDR:MASTER_PORT, every other rank
 * connects. Collectives go through rank 0 in rank order, so every sum has one fixed order. The CPU
 * engine sends its gradients through it; the CUDA engine only its NCCL id and scalars (the
 * gradients travel through NCCL). Every wait has a timeout; a peer that exits closes its socket and
 * the waiting rank stops at once with one error line naming it. Until the first step a stop signal
 * ends the ranks without training (a rank that never comes must not hold them up until the timeout).
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_DIST_H
#define MICROGPT_HOST_DIST_H

#include "crc32c.h"
#include "output.h"
#include "signals.h"
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* "AND4": rank 0 closes a connection from something else and waits on; a rank refuses a rank 0 that
 * is something else. It changes whenever DistHello does, so a rank of another build is told at once
 * too (a longer greeting would be waited for in vain): it reads rank 0's magic and refuses itself. */
#define DIST_MAGIC 0x414e4434u
#define DIST_DEFAULT_TIMEOUT_S 600.0
/* A stoppable wait (dist_wait) polls at most this long at a time: a signal that lands after the
 * stop flag was read and before poll() starts does not interrupt it, so the flag is read again. */
#define DIST_STOP_POLL_MS 200
/* The greeting window: how long rank 0 waits for the whole greeting of a connection it accepted
 * before it closes it as no rank of this run (DESIGN §17), at most half of ANDREA_DIST_TIMEOUT_S (at
 * the timeout itself, 32 silent connections held every place until rank 0 gave up, a rank queued
 * behind them never taken; at half, they are closed in time for it). A rank
 * sends its greeting the moment it is connected, before it reads rank 0's, so a real rank's 32
 * bytes follow its connection within a round trip; 10 s leaves room for a loaded machine and for
 * TCP to resend a lost segment several times. Greetings are read side by side (dist_accept_all),
 * so a connection that stays silent delays no rank: the window only bounds how long it holds one
 * of the DIST_PENDING_MAX places. */
#define DIST_GREETING_S 10.0
/* Connections whose greeting rank 0 reads at once; more wait in the kernel's listen queue. */
#define DIST_PENDING_MAX 32

typedef struct {
    int rank, world, local_rank;
    double timeout_s; /* longest wait for a peer (ANDREA_DIST_TIMEOUT_S) */
    uint32_t argv_crc; /* CRC-32C of the command line: every rank must be started with the same one */
    uint32_t state_crc; /* CRC-32C of the resumed checkpoint and sidecar (0: a fresh start): the same */
    uint32_t data_crc;  /* the training data's fingerprint (train_loop.h): the same on every rank */
    const char* engine; /* engine_name(): every rank must run the same engine (their messages differ) */
    int starting;      /* until the first step: a stop signal then ends the ranks, nothing to save */
    int* fds;         /* rank 0: fds[r] is rank r's socket (fds[0] unused); others: fds[0] is rank 0's */
    char* scratch;    /* rank 0's receive buffer for reductions, grown once */
    size_t scratch_bytes;
} Dist;

static Dist g_dist = {0, 1, 0, DIST_DEFAULT_TIMEOUT_S, 0, 0, 0, "", 1, NULL, NULL, 0};

/* What each side of a connection says first (rank 0 sends its own on accepting): a peer of
 * another run, one started with other flags, resuming from other files or reading other training
 * data, or one of the other engine is refused before any of its bytes is taken for a gradient or a
 * signal flag; another program on the port (another magic, no greeting) is closed by rank 0, which
 * waits on for the ranks, and refused by the other ranks. The engine's name: the flags alone do
 * not tell the engines apart, and after the greeting they say different things (the CPU engine
 * its gradients, the CUDA engine an NCCL id), so a CPU rank read a CUDA rank 0's id as a stop
 * signal and exited 0, and a CPU rank 0 and a CUDA rank each waited for the other until the
 * timeout. */
#define DIST_ENGINE_NAME_MAX 8
typedef struct {
    uint32_t magic, rank, world, argv_crc, state_crc, data_crc;
    char engine[DIST_ENGINE_NAME_MAX]; /* NUL-padded */
} DistHello;

/* A part of [0, n) for each rank: rank r takes [r·stride, (r+1)·stride) clipped to n, where the
 * stride is a whole number of units (dist_stride), the same for every rank as NCCL's reduce-scatter
 * and all-gather need (the last parts may be short or empty). A unit is never split: the CPU
 * engine's is its gradient-norm chunk, the CUDA engine's a word of the weight-decay mask. */
typedef struct { size_t lo, hi; } DistPart;

static size_t dist_stride(size_t n, size_t unit, int world) {
    size_t units = (n + unit - 1) / unit;
    return (units + (size_t)world - 1) / (size_t)world * unit;
}

static DistPart dist_part(size_t n, size_t unit, int rank, int world) {
    size_t stride = dist_stride(n, unit, world);
    DistPart p;
    p.lo = stride * (size_t)rank;
    p.hi = p.lo + stride;
    if (p.lo > n) p.lo = n;
    if (p.hi > n) p.hi = n;
    return p;
}

static int env_int(const char* name, int fallback) {
    const char* s = getenv(name);
    char* end;
    long x;
    if (!s || !*s) return fallback;
    errno = 0;
    x = strtol(s, &end, 10);
    if (*end || errno || x < 0 || x > 1 << 20) die_input("environment variable %s=%s is not a count", name, s);
    return (int)x;
}

static double dist_now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void dist_lost(int peer, const char* what) {
    if (g_dist.starting && g_stop_signal && g_dist.rank != 0) { /* rank 0 left on the same signal */
        info("rank %d: stopped by signal %d before the first step: nothing to save", g_dist.rank, (int)g_stop_signal);
        exit(0);
    }
    die_io("rank %d: lost rank %d (%s); the run stops (the last checkpoint is kept)", g_dist.rank, peer, what);
}

/* How a wait on a socket ended (dist_poll_until). */
enum { DIST_READY, DIST_TIMED_OUT, DIST_STOPPED, DIST_POLL_FAILED };

static struct pollfd dist_pollfd(int fd, short events) {
    struct pollfd p;
    p.fd = fd;
    p.events = events;
    p.revents = 0;
    return p;
}

/* Polls p[0, n) (poll's fds, events set) until one is ready or the deadline (dist_now_s) passes.
 * `stoppable`: a stop signal ends the wait too, read at least every DIST_STOP_POLL_MS. p[].revents:
 * poll's, when ready; errno stands where the poll failed. */
static int dist_poll_until(struct pollfd* p, nfds_t n, double deadline, int stoppable) {
    for (;;) {
        double left = deadline - dist_now_s();
        int rc, ms = left > 1000.0 ? 1000000 : (int)(left * 1000.0) + 1;
        if (stoppable && g_stop_signal) return DIST_STOPPED;
        if (left <= 0) return DIST_TIMED_OUT;
        if (stoppable && ms > DIST_STOP_POLL_MS) ms = DIST_STOP_POLL_MS;
        rc = poll(p, n, ms);
        if (rc < 0 && errno == EINTR) continue; /* a signal: its flag is read between steps (stoppable: above) */
        if (rc < 0) return DIST_POLL_FAILED;
        if (rc > 0) return DIST_READY;
    }
}

/* Waits until fd is ready for `events`, at most the timeout; a dead or silent peer ends the run.
 * `stoppable`: a stop signal ends the wait too; returns 1 then, else 0. */
static int dist_wait(int fd, short events, int peer, int stoppable) {
    struct pollfd p = dist_pollfd(fd, events);
    switch (dist_poll_until(&p, 1, dist_now_s() + g_dist.timeout_s, stoppable)) {
    case DIST_STOPPED: return 1;
    case DIST_TIMED_OUT: dist_lost(peer, "no answer within ANDREA_DIST_TIMEOUT_S"); break;
    case DIST_POLL_FAILED: dist_lost(peer, strerror(errno)); break;
    default: break;
    }
    if (p.revents & (POLLERR | POLLNVAL)) dist_lost(peer, "it exited or its connection broke");
    return 0; /* readable, writable, or hung up (then recv reads 0: "it exited") */
}

static void dist_send(int peer, const void* buf, size_t bytes) {
    int fd = g_dist.fds[g_dist.rank == 0 ? peer : 0];
    const char* p = (const char*)buf;
    while (bytes > 0) {
        ssize_t k;
        dist_wait(fd, POLLOUT, peer, 0);
        k = send(fd, p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (k <= 0) dist_lost(peer, "it exited");
        p += k;
        bytes -= (size_t)k;
    }
}

/* `stoppable` (dist_wait): returns 1 where a stop signal came before all of buf, else 0. */
static int dist_recv_or_stop(int peer, void* buf, size_t bytes, int stoppable) {
    int fd = g_dist.fds[g_dist.rank == 0 ? peer : 0];
    char* p = (char*)buf;
    while (bytes > 0) {
        ssize_t k;
        if (dist_wait(fd, POLLIN, peer, stoppable)) return 1;
        k = recv(fd, p, bytes, MSG_DONTWAIT);
        if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (k <= 0) dist_lost(peer, "it exited");
        p += k;
        bytes -= (size_t)k;
    }
    return 0;
}

static void dist_recv(int peer, void* buf, size_t bytes) { dist_recv_or_stop(peer, buf, bytes, 0); }

static struct sockaddr_in dist_master_address(void) {
    const char* host = getenv("MASTER_ADDR");
    int port = env_int("MASTER_PORT", -1);
    struct addrinfo hints, *res = NULL;
    struct sockaddr_in a;
    int rc;
    if (!host || !*host || port < 0)
        die_input("WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT (rank 0's address and a free TCP port)");
    if (port == 0 || port > 65535) die_input("MASTER_PORT=%s is not a TCP port (1 to 65535)", getenv("MASTER_PORT"));
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if ((rc = getaddrinfo(host, NULL, &hints, &res)) != 0 || !res)
        die_input("MASTER_ADDR %s: %s", host, gai_strerror(rc));
    memcpy(&a, res->ai_addr, sizeof a);
    freeaddrinfo(res);
    a.sin_port = htons((uint16_t)port);
    return a;
}

static void dist_set_socket_options(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* small control messages: no Nagle */
}

/* The error of ranks 0 and r (its %u) whose resumed states differ. The same flags name the same
 * checkpoint path, but not always the same file: each node of a multi-node run reads its own disk,
 * where a copy may be of another step; resumed from it, the ranks would train apart without a word. */
#define DIST_OTHER_STATE "rank %u resumed from another checkpoint or sidecar than rank 0 (every rank must read the " \
                         "same files: a stale copy on another node?)"
/* The same for the training data: the same --data flags (a relative glob, the same path on each
 * node's disk) may name other shards; each rank draws its micro-batches from its own, so the run
 * would train on, no longer any run on one rank, with nothing said. */
#define DIST_OTHER_DATA "rank %u trains on other data than rank 0 (the same data flags name other shards on its " \
                        "disk: a stale or partial copy on another node?)"

/* The peer's engine name (h->engine) into out, fit to print: a peer's bytes, so anything but a
 * lower-case letter, digit or '_' shows as '?'. */
static const char* dist_peer_engine(const DistHello* h, char out[DIST_ENGINE_NAME_MAX]) {
    int i;
    for (i = 0; i < DIST_ENGINE_NAME_MAX - 1 && h->engine[i]; i++) {
        char c = h->engine[i];
        out[i] = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ? c : '?';
    }
    out[i] = 0;
    return out;
}

/* Whether h names another engine than this rank's. */
static int dist_other_engine(const DistHello* h, const DistHello* mine) {
    return memcmp(h->engine, mine->engine, sizeof h->engine) != 0;
}

/* The peer's DistHello (peer 0's socket) into *h, its magic first: a peer whose magic differs
 * (another program, a rank of another build) is told apart without waiting for bytes it may never
 * send. Returns 1 where a stop signal came first, else 0. */
static int dist_recv_hello(DistHello* h) {
    if (dist_recv_or_stop(0, &h->magic, sizeof h->magic, 1)) return 1;
    return h->magic == DIST_MAGIC &&
           dist_recv_or_stop(0, (char*)h + sizeof h->magic, sizeof *h - sizeof h->magic, 1);
}

static DistHello dist_hello(void) {
    DistHello h;
    h.magic = DIST_MAGIC;
    h.rank = (uint32_t)g_dist.rank;
    h.world = (uint32_t)g_dist.world;
    h.argv_crc = g_dist.argv_crc;
    h.state_crc = g_dist.state_crc;
    h.data_crc = g_dist.data_crc;
    memset(h.engine, 0, sizeof h.engine);
    strncpy(h.engine, g_dist.engine, sizeof h.engine - 1);
    return h;
}

/* Rank 0: the greeting of a rank of this run (its magic is rank 0's) against rank 0's own. One that
 * disagrees is a rank started wrongly, not a stranger: refused, exit 2, since the launch is wrong. */
static void dist_check_rank(const DistHello* h, const DistHello* mine) {
    char name[DIST_ENGINE_NAME_MAX];
    /* unsigned: a rank of 2^31 or more was a negative int, below WORLD_SIZE, and indexed fds[]
     * far out of bounds (a crash without a word) */
    if (h->world != (uint32_t)g_dist.world || h->rank == 0 || h->rank >= (uint32_t)g_dist.world)
        die_input("rank 0: a connection announced rank %u of world %u (expected a new rank of %d)", h->rank, h->world,
                  g_dist.world);
    if (g_dist.fds[h->rank] >= 0)
        die_input("rank 0: rank %u connected twice (two processes started with RANK=%u?)", h->rank, h->rank);
    if (dist_other_engine(h, mine))
        die_input("rank 0: rank %u runs the %s engine, this rank the %s engine (every rank must run the same "
                  "engine)", h->rank, dist_peer_engine(h, name), g_dist.engine);
    if (h->argv_crc != mine->argv_crc)
        die_input("rank 0: rank %u was started with other flags than rank 0 (every rank needs the same command "
                  "line)", h->rank);
    if (h->state_crc != mine->state_crc) die_input("rank 0: " DIST_OTHER_STATE, h->rank);
    if (h->data_crc != mine->data_crc) die_input("rank 0: " DIST_OTHER_DATA, h->rank);
}

/* A connection rank 0 has accepted and sent its greeting to, whose own greeting is not all in. */
typedef struct {
    int fd;
    double deadline; /* the end of its greeting window */
    size_t got;      /* bytes of h read */
    DistHello h;
    char from[INET_ADDRSTRLEN + 8]; /* its address:port, for the warning */
} DistPending;

/* Closes c, a connection that is no rank of this run, with one warning line saying why. */
static void dist_drop(DistPending* c, const char* why) {
    warn("rank 0: closed a connection to MASTER_PORT from %s, not a rank of this run: %s (%zu of a greeting's %zu "
         "bytes came)", c->from, why, c->got, sizeof c->h);
    close(c->fd);
}

/* Reads what c has sent of its greeting, never past it (a rank sends more once it has rank 0's).
 * Returns 1 once c is a rank (its socket in g_dist.fds), -1 where it was closed as none, 0 while
 * its greeting is not all in. */
static int dist_take_greeting(DistPending* c, const DistHello* mine) {
    ssize_t k = recv(c->fd, (char*)&c->h + c->got, sizeof c->h - c->got, MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    if (k <= 0) {
        dist_drop(c, k == 0 ? "it closed before its greeting" : "its connection broke");
        return -1;
    }
    c->got += (size_t)k;
    /* the magic first: another program's bytes are no rank number to report */
    if (c->got >= sizeof c->h.magic && c->h.magic != DIST_MAGIC) {
        dist_drop(c, "another magic number (another program on the port, or a rank of another ANDREA build, which "
                     "refuses itself on reading rank 0's greeting)");
        return -1;
    }
    if (c->got < sizeof c->h) return 0;
    dist_check_rank(&c->h, mine);
    g_dist.fds[c->h.rank] = c->fd;
    return 1;
}

/* Accepts a connection waiting on lfd into *c and sends it rank 0's greeting (a new connection's
 * send buffer takes its 32 bytes at once). Returns 1 where c now waits for its greeting, -1 where no
 * descriptor (or kernel memory) was free to take it, which stays queued, else 0. */
static int dist_accept_one(int lfd, DistPending* c, const DistHello* mine, double window) {
    struct sockaddr_in from;
    socklen_t len = sizeof from;
    char addr[INET_ADDRSTRLEN];
    c->fd = accept(lfd, (struct sockaddr*)&from, &len);
    if (c->fd < 0) /* else gone before it was taken; the listener is non-blocking */
        return errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM ? -1 : 0;
    dist_set_socket_options(c->fd);
    c->deadline = dist_now_s() + window;
    c->got = 0;
    snprintf(c->from, sizeof c->from, "%s:%u", inet_ntop(AF_INET, &from.sin_addr, addr, sizeof addr) ? addr : "?",
             (unsigned)ntohs(from.sin_port));
    if (send(c->fd, mine, sizeof *mine, MSG_NOSIGNAL | MSG_DONTWAIT) == (ssize_t)sizeof *mine) return 1;
    dist_drop(c, "its connection broke");
    return 0;
}

/* Rank 0: accept the world-1 others, each announcing its DistHello (and hearing rank 0's first).
 * Anything may connect to MASTER_PORT (a port scanner, a health check, another program): it must
 * neither end the run nor keep a rank out. So greetings are read side by side: one poll() over the
 * listener and up to DIST_PENDING_MAX accepted connections, each read as its bytes come, and a rank
 * joins once its whole greeting is in, whatever the others still owe. A connection with another
 * magic, one that closes, or one whose greeting is not all in within the greeting window
 * (DIST_GREETING_S, at most half the timeout) is closed with a warning. With every place taken the
 * listener is left alone: new connections wait in the kernel's queue until a greeting is in or a
 * window ends, so a flood of silent ones costs a rank at most a window per DIST_PENDING_MAX of them
 * ahead of it (the queue as long as the kernel allows: a full one drops a rank's SYNs).
 * (Greetings read one after another, each within the window, would be simpler, but k silent
 * connections would hold a rank for k windows.) The wait for the next rank (ANDREA_DIST_TIMEOUT_S)
 * starts anew only when a rank joins, so strays do not prolong it either.
 * Returns 1 where a stop signal came first, else 0. */
static int dist_accept_all(struct sockaddr_in a) {
    DistHello mine = dist_hello();
    DistPending pend[DIST_PENDING_MAX];
    struct pollfd p[DIST_PENDING_MAX + 1];
    char expired[64];
    double window = g_dist.timeout_s / 2 < DIST_GREETING_S ? g_dist.timeout_s / 2 : DIST_GREETING_S;
    double until = dist_now_s() + g_dist.timeout_s; /* for the next rank; renewed as each joins */
    /* Where accept() found no descriptor free, the connection stays queued and the listener
     * readable: polled again at once, it was a core spinning until a window freed a place or the
     * timeout. The listener rests until `rested`, DIST_STOP_POLL_MS later; said once. */
    double rested = 0;
    int one = 1, n = 0, np = 0, i, said_full = 0, rc = DIST_READY, lfd = socket(AF_INET, SOCK_STREAM, 0);
    if (lfd < 0) die_io("rank 0: socket: %s", strerror(errno));
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    /* The longest queue the kernel allows (it cuts the backlog to net.core.somaxconn): in one of
     * WORLD_SIZE + 32, full while every place was taken, the kernel dropped a rank's SYNs, and a
     * flood that kept it full kept the rank out until the timeout; queued, it waits its turn */
    if (bind(lfd, (struct sockaddr*)&a, sizeof a) != 0 ||
        listen(lfd, g_dist.world + DIST_PENDING_MAX > SOMAXCONN ? g_dist.world + DIST_PENDING_MAX : SOMAXCONN) != 0 ||
        fcntl(lfd, F_SETFL, O_NONBLOCK) != 0)
        die_io("rank 0: cannot listen on MASTER_ADDR:MASTER_PORT (port %d): %s", ntohs(a.sin_port), strerror(errno));
    snprintf(expired, sizeof expired, "no whole greeting within %g s", window);
    while (n < g_dist.world - 1) {
        double next = until, now = dist_now_s();
        int listening = np < DIST_PENDING_MAX && now >= rested;
        if (now < rested && rested < next) next = rested; /* the listener's rest ends */
        p[0] = dist_pollfd(listening ? lfd : -1, POLLIN); /* poll() passes over a negative fd */
        for (i = 0; i < np; i++) {
            p[i + 1] = dist_pollfd(pend[i].fd, POLLIN);
            if (pend[i].deadline < next) next = pend[i].deadline;
        }
        /* stoppable: connections that never greet (no ranks) must not hold a stop signal */
        if ((rc = dist_poll_until(p, (nfds_t)np + 1, next, 1)) == DIST_STOPPED) break;
        if (rc == DIST_POLL_FAILED) die_io("rank 0: waiting for the ranks: poll: %s", strerror(errno));
        /* from the last: a place that closes takes pend[np - 1], already read */
        for (i = np; i-- > 0;) {
            int taken = p[i + 1].revents ? dist_take_greeting(&pend[i], &mine) : 0;
            if (taken == 0 && dist_now_s() >= pend[i].deadline) {
                dist_drop(&pend[i], expired);
                taken = -1;
            }
            if (taken == 1) {
                n++;
                until = dist_now_s() + g_dist.timeout_s;
            }
            if (taken != 0) pend[i] = pend[--np];
        }
        if (n == g_dist.world - 1) break;
        if (p[0].revents & POLLIN) {
            int accepted = dist_accept_one(lfd, &pend[np], &mine, window);
            if (accepted < 0) {
                if (!said_full)
                    warn("rank 0: cannot take a connection to MASTER_PORT now (%s): trying again every %d ms (out of file "
                         "descriptors: raise `ulimit -n`)", strerror(errno), DIST_STOP_POLL_MS);
                said_full = 1;
                rested = dist_now_s() + DIST_STOP_POLL_MS / 1000.0;
            } else
                np += accepted;
        }
        if (dist_now_s() >= until) break;
    }
    for (i = 0; i < np; i++) dist_drop(&pend[i], "its greeting was not all in when rank 0 stopped waiting for ranks");
    close(lfd);
    if (n < g_dist.world - 1 && rc != DIST_STOPPED) {
        int missing = 1;
        while (g_dist.fds[missing] >= 0) missing++;
        dist_lost(missing, "no answer within ANDREA_DIST_TIMEOUT_S");
    }
    return n < g_dist.world - 1;
}

/* One attempt to connect fd to a, non-blocking: a blocking connect() waits out the kernel's SYN
 * retries (about two minutes) where the port drops them (a listener whose backlog is full, a
 * firewall), past ANDREA_DIST_TIMEOUT_S and deaf to a stop signal (SA_RESTART restarts it).
 * Returns 0 once connected, 1 on a stop signal, -1 otherwise (refused, or the deadline passed). */
static int dist_try_connect(int fd, const struct sockaddr_in* a, double deadline) {
    int err = 0, flags = fcntl(fd, F_GETFL);
    socklen_t len = sizeof err;
    struct pollfd p = dist_pollfd(fd, POLLOUT);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) return -1;
    if (connect(fd, (const struct sockaddr*)a, sizeof *a) == 0) return 0;
    if (errno != EINPROGRESS && errno != EINTR) return -1;
    switch (dist_poll_until(&p, 1, deadline, 1)) {
    case DIST_READY: break;
    case DIST_STOPPED: return 1;
    default: return -1;
    }
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) return -1;
    return 0;
}

/* Rank r > 0: connect to rank 0, retrying until the timeout (rank 0 may start later). Returns 1
 * where a stop signal came first, else 0. */
static int dist_connect(struct sockaddr_in a) {
    double deadline = dist_now_s() + g_dist.timeout_s;
    DistHello mine = dist_hello(), h;
    char name[DIST_ENGINE_NAME_MAX];
    for (;;) {
        int fd, rc;
        if (g_stop_signal) return 1;
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) die_io("rank %d: socket: %s", g_dist.rank, strerror(errno));
        if ((rc = dist_try_connect(fd, &a, deadline)) == 0) {
            dist_set_socket_options(fd);
            g_dist.fds[0] = fd;
            break;
        }
        close(fd);
        if (rc > 0) return 1;
        if (dist_now_s() > deadline) dist_lost(0, "cannot connect to MASTER_ADDR:MASTER_PORT");
        {
            struct timespec pause = {0, 50000000}; /* 50 ms between attempts */
            nanosleep(&pause, NULL);
        }
    }
    dist_send(0, &mine, sizeof mine);
    if (dist_recv_hello(&h)) return 1; /* a silent program on the port: as above */
    if (h.magic != DIST_MAGIC || h.rank != 0)
        die_input("rank %d: MASTER_ADDR:MASTER_PORT (port %d) answers, but is not rank 0 of a run (another program on "
                  "that port, or a rank 0 of another ANDREA build?)", g_dist.rank, ntohs(a.sin_port));
    if ((int)h.world != g_dist.world)
        die_input("rank %d: rank 0 has WORLD_SIZE %u, this rank %d", g_dist.rank, h.world, g_dist.world);
    if (dist_other_engine(&h, &mine))
        die_input("rank %d: rank 0 runs the %s engine, this rank the %s engine (every rank must run the same engine)",
                  g_dist.rank, dist_peer_engine(&h, name), g_dist.engine);
    if (h.argv_crc != mine.argv_crc)
        die_input("rank %d: rank 0 was started with other flags than rank %d (every rank needs the same command line)",
                  g_dist.rank, g_dist.rank);
    if (h.state_crc != mine.state_crc) die_input("rank %d: " DIST_OTHER_STATE, g_dist.rank, (uint32_t)g_dist.rank);
    if (h.data_crc != mine.data_crc) die_input("rank %d: " DIST_OTHER_DATA, g_dist.rank, (uint32_t)g_dist.rank);
    return 0;
}

static void dist_shutdown(void) {
    int r;
    if (g_dist.world == 1) return;
    for (r = 0; r < g_dist.world; r++)
        if (g_dist.fds[r] >= 0) close(g_dist.fds[r]);
    free(g_dist.fds);
    free(g_dist.scratch);
    g_dist.fds = NULL;
    g_dist.scratch = NULL;
}

/* Reads the environment; with WORLD_SIZE > 1 connects every rank to rank 0, each started with
 * this command line (argv[1..], checked through its CRC), resuming from the same state
 * (state_crc: 0 for a fresh start), training on the same data (data_crc, their fingerprint) with
 * the same engine (its name, at most DIST_ENGINE_NAME_MAX - 1 characters). Returns 1 where a stop
 * signal came before the ranks were connected (then nothing is), else 0. */
static int dist_init(int argc, char** argv, uint32_t state_crc, uint32_t data_crc, const char* engine) {
    const char* t = getenv("ANDREA_DIST_TIMEOUT_S");
    int r;
    g_dist.world = env_int("WORLD_SIZE", 1);
    g_dist.rank = env_int("RANK", 0);
    g_dist.local_rank = env_int("LOCAL_RANK", g_dist.rank);
    if (g_dist.world < 1 || g_dist.rank >= g_dist.world)
        die_input("RANK %d is not below WORLD_SIZE %d", g_dist.rank, g_dist.world);
    if (t && *t) {
        char* end;
        g_dist.timeout_s = strtod(t, &end);
        if (*end || !(g_dist.timeout_s > 0) || !isfinite(g_dist.timeout_s))
            die_input("ANDREA_DIST_TIMEOUT_S=%s is not a positive number of seconds", t);
    }
    if (g_dist.world == 1) return 0;
    for (r = 1; r < argc; r++) g_dist.argv_crc = crc32c_update(g_dist.argv_crc, argv[r], strlen(argv[r]) + 1);
    g_dist.state_crc = state_crc;
    g_dist.data_crc = data_crc;
    g_dist.engine = engine;
    g_dist.fds = (int*)xmalloc((size_t)g_dist.world * sizeof(int), "rank sockets");
    for (r = 0; r < g_dist.world; r++) g_dist.fds[r] = -1;
    if (g_dist.rank == 0 ? dist_accept_all(dist_master_address()) : dist_connect(dist_master_address())) {
        dist_shutdown();
        return 1;
    }
    return 0;
}

/* A peer whose connection has closed (it exited), or -1. For waits that are not on a socket (the
 * CUDA engine's NCCL calls): a peeked byte is a message already on its way, not a death. */
static inline int dist_peer_gone(void) {
    int r;
    if (g_dist.world == 1) return -1;
    for (r = 0; r < g_dist.world; r++) {
        char byte;
        int fd = g_dist.fds[r];
        if (fd < 0) continue;
        if (recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0) return g_dist.rank == 0 ? r : 0;
    }
    return -1;
}

static void* dist_scratch(size_t bytes) {
    if (bytes > g_dist.scratch_bytes) {
        free(g_dist.scratch);
        g_dist.scratch = (char*)xmalloc(bytes, "reduction buffer");
        g_dist.scratch_bytes = bytes;
    }
    return g_dist.scratch;
}

/* ---------------------------------------------------------------------------------------------- */
/* Collectives: every rank calls the same ones in the same order. */

/* Rank 0's buf to every rank. */
static void dist_broadcast(void* buf, size_t bytes) {
    int r;
    if (g_dist.world == 1) return;
    if (g_dist.rank == 0)
        for (r = 1; r < g_dist.world; r++) dist_send(r, buf, bytes);
    else
        dist_recv(0, buf, bytes);
}

/* Each rank's `bytes` into rank 0's all[rank · bytes ...] (rank order); other ranks' all unused. */
static void dist_gather(const void* mine, size_t bytes, void* all) {
    int r;
    if (g_dist.world > 1 && g_dist.rank != 0) {
        dist_send(0, mine, bytes);
        return;
    }
    memmove(all, mine, bytes);
    for (r = 1; r < g_dist.world; r++) dist_recv(r, (char*)all + (size_t)r * bytes, bytes);
}

/* Each rank's part (dist_part(n, unit)) of buf, elements of `elem` bytes, into rank 0's buf. */
static inline void dist_gather_parts(void* buf, size_t elem, size_t n, size_t unit) {
    int r;
    if (g_dist.world == 1) return;
    for (r = g_dist.rank == 0 ? 1 : g_dist.rank; r < g_dist.world; r++) {
        DistPart p = dist_part(n, unit, r, g_dist.world);
        char* at = (char*)buf + p.lo * elem;
        if (g_dist.rank == 0) dist_recv(r, at, (p.hi - p.lo) * elem);
        else { dist_send(0, at, (p.hi - p.lo) * elem); break; }
    }
}

/* Every rank's part of buf to every rank: afterwards all hold the whole buf. */
static inline void dist_all_gather_parts(void* buf, size_t elem, size_t n, size_t unit) {
    dist_gather_parts(buf, elem, n, unit);
    dist_broadcast(buf, n * elem);
}

/* Sum of every rank's buf[0, n), added by rank 0 in rank order ((g0 + g1) + g2 ...); each rank
 * gets its part (dist_part(n, unit)) of the sum in place. Rank 0's buf holds the whole sum. */
static inline void dist_reduce_scatter_sum(float* buf, size_t n, size_t unit) {
    int r;
    size_t i;
    if (g_dist.world == 1) return;
    if (g_dist.rank != 0) {
        DistPart p = dist_part(n, unit, g_dist.rank, g_dist.world);
        dist_send(0, buf, n * sizeof(float));
        dist_recv(0, buf + p.lo, (p.hi - p.lo) * sizeof(float));
        return;
    }
    {
        float* other = (float*)dist_scratch(n * sizeof(float));
        for (r = 1; r < g_dist.world; r++) {
            dist_recv(r, other, n * sizeof(float));
            for (i = 0; i < n; i++) buf[i] += other[i];
        }
    }
    for (r = 1; r < g_dist.world; r++) {
        DistPart p = dist_part(n, unit, r, g_dist.world);
        dist_send(r, buf + p.lo, (p.hi - p.lo) * sizeof(float));
    }
}

/* Every rank's k doubles, in rank order, summed left to right by rank 0; the sum to every rank. */
static double dist_sum_in_rank_order(const double* mine, int k) {
    double sum = 0.0, *all = (double*)dist_scratch((size_t)g_dist.world * (size_t)k * sizeof(double));
    int i;
    dist_gather(mine, (size_t)k * sizeof(double), all);
    if (g_dist.rank == 0)
        for (i = 0; i < g_dist.world * k; i++) sum += all[i];
    dist_broadcast(&sum, sizeof sum);
    return sum;
}

/* The largest of every rank's flags[i], for each i, to every rank. */
static void dist_max_flags(int* flags, int k) {
    int r, i, *all;
    if (g_dist.world == 1) return;
    all = (int*)dist_scratch((size_t)g_dist.world * (size_t)k * sizeof(int));
    dist_gather(flags, (size_t)k * sizeof(int), all);
    if (g_dist.rank == 0)
        for (r = 1; r < g_dist.world; r++)
            for (i = 0; i < k; i++)
                if (all[r * k + i] > flags[i]) flags[i] = all[r * k + i];
    dist_broadcast(flags, (size_t)k * sizeof(int));
}

#endif
