/* Per-thread socket I/O state and EV_DATA emission, shared by http.c (syscalls), tls.c
 * (OpenSSL uprobes) and tcp.c (which socket a traced connect() made). Each of those files
 * includes this header, so each compiles on its own; the agent inlines it once
 * (agent/capture/bpfsrc.py) when it loads them together.
 */
#ifndef SITS_SOCKIO_H
#define SITS_SOCKIO_H

#include "events.h"

struct accept_args {
    __u64 addr; /* struct sockaddr __user * */
    __s32 listen_fd;
    __u32 _pad;
};

struct connect_args {
    __u64 addr;
    __s32 fd;
    __u32 _pad;
};

/* a read/write in flight on a traced fd */
struct io_args {
    __u64 buf;    /* buffer, or struct iovec array when iov */
    __u64 ts_ns;  /* at syscall entry (traced at exit alone, SITS_EXIT_ARGS: at its exit) */
    __u64 conn;   /* conn key */
    __u32 iovcnt; /* 0: plain buffer */
    __u8 direction;
    __u8 source;
    __u8 _pad[2];
};

struct ssl_active {
    __u64 ssl;
    __u64 buf;
    __u64 out_len; /* size_t * for the _ex variants, 0 otherwise */
    __u64 ts_ns;
    __u8 direction;
    __u8 _pad[7];
};

/* tcp:tcp_probe fires on every TCP segment the node receives, whoever owns the socket. With
 * the tracepoint's `skaddr` (6.x) and the fd walk's offsets (SITS_SOCK_WALK), the struct sock
 * of each traced connection is kept here (http.c adds it at the open event, or at the first
 * read or write of a connection registered from user space), and tcp_probe returns after one
 * 8-byte-key lookup for every other socket (a load generator's, a database's). The value: when
 * tcp_probe last copied the socket's srtt (jiffies; 0: never). An LRU: tcp.c deletes at CLOSE. */
#if defined(SITS_SOCK_WALK) && defined(SITS_TCP_PROBE_SK) && SITS_TCP_PROBE_SK
#define SITS_RTT_SOCKS 1
BPF_TABLE("lru_hash", __u64, __u64, rtt_socks, SITS_MAX_CONNS);
/* Ahead of the LRU, a count per bucket of socket addresses: how many of rtt_socks' sockets
 * fall in it. tcp_probe returns at a zero count: for a segment of a socket that is not
 * traced (a load generator's, half the segments beside a traced server) an array load the
 * verifier inlines, not the LRU's hash lookup (107 -> 60 ns a run, bench/prog_cost.py
 * --untraced). A count errs only high (an entry the LRU evicts keeps its count; each count
 * taken back pairs with an insert that added it), so a traced socket is never skipped. */
#define SITS_RTT_HINTS 16384
BPF_ARRAY(rtt_hints, __u32, SITS_RTT_HINTS);

static __always_inline __u32 rtt_hint_index(__u64 sk)
{
    /* struct sock is slab memory, cache-line aligned: the line number, and the page's bits */
    return (__u32)((sk >> 6) ^ (sk >> 20)) & (SITS_RTT_HINTS - 1);
}

static __always_inline void rtt_hint(__u64 sk, int add)
{
    __u32 i = rtt_hint_index(sk);
    __u32 *n = rtt_hints.lookup(&i);
    if (n)
        __sync_fetch_and_add(n, add ? 1 : -1);
}
#else
#define SITS_RTT_SOCKS 0
#endif

/* a registered connection's struct sock (0: not found) is tcp_probe's from now on */
static __always_inline void rtt_sock_add(struct conn_state *st, __u64 sk)
{
    st->sk_known = 1;
#if SITS_RTT_SOCKS
    if (sk) {
        __u64 never = 0;
        if (rtt_socks.insert(&sk, &never) == 0) /* new: counted once */
            rtt_hint(sk, 1);
    }
#endif
}

BPF_HASH(accept_inflight, __u64, struct accept_args, 10240);
BPF_HASH(connect_inflight, __u64, struct connect_args, 10240);
/* Per thread: the read/write in flight on a traced fd, the SSL call in flight (tls.c) and
 * the last traced connection read from (memory-BIO TLS, asyncio). */
struct thread_io {
    struct io_args io;
    struct ssl_active ssl;
    __u64 last_read_conn; /* conn key; 0: none */
    __u32 last_read_len;  /* bytes that read returned (tls.c matches them to BIO_write) */
    __u8 io_active;
    __u8 ssl_active;
    __u8 _pad[2];
};
#ifndef SITS_TASK_STORAGE
#define SITS_TASK_STORAGE 1
#endif
#if SITS_TASK_STORAGE
/* task-local storage: one pointer chase per lookup, where a hash keyed by thread id cost
 * three hash operations per traced syscall (update, lookup, delete) */
BPF_TASK_STORAGE(thread_io, struct thread_io);
static __always_inline struct thread_io *thread_state(__u64 id, int create)
{
    struct task_struct *t = bpf_get_current_task_btf();
    return thread_io.task_storage_get(t, 0, create ? BPF_LOCAL_STORAGE_GET_F_CREATE : 0);
}
#else
/* kernels without task storage in tracing programs (before 5.11): a hash by thread id */
BPF_TABLE("lru_hash", __u64, struct thread_io, thread_io, 16384);
static __always_inline struct thread_io *thread_state(__u64 id, int create)
{
    struct thread_io *t = thread_io.lookup(&id);
    if (t || !create)
        return t;
    struct thread_io zero = {};
    thread_io.update(&id, &zero);
    return thread_io.lookup(&id);
}
#endif
/* An SSL* or BIO* address in one process. Workers forked from one master (gunicorn) make
 * the same allocations: one address is a live SSL* in two workers at once, and an address
 * alone handed one worker's connection the other's plaintext. */
struct ssl_key {
    __u64 ptr;
    __u32 tgid;
    __u32 pad;
};
static __always_inline struct ssl_key ssl_key_of(__u32 tgid, __u64 ptr)
{
    struct ssl_key k = {};
    k.ptr = ptr;
    k.tgid = tgid;
    return k;
}
/* SSL* -> conn key (tls.c learns it; http.c records it from syscalls inside SSL calls) */
BPF_HASH(ssl_conns, struct ssl_key, __u64, SITS_MAX_CONNS);
/* Memory-BIO TLS (tls.c): the first 16 bytes of a socket read of 16 bytes or more that
 * began with a TLS record header (or was on a TLS connection) -> the connection it came
 * from. The event loop later
 * feeds those same bytes to the SSL*'s read BIO with BIO_write, perhaps after reading other
 * sockets (anyio queues reads; uvloop defers): the bytes, not the order, name the socket.
 * LRU: a read no BIO_write claims ages out. */
struct read_prefix {
    __u64 a;
    __u64 b;
};
BPF_TABLE("lru_hash", struct read_prefix, __u64, read_prefixes, 8192);

/* -1 when the ring was full: the caller marks the connection (st->lost), so its next record
 * carries DATA_LOST and the agent resyncs instead of reading on at a wrong offset */
static __always_inline int emit_data(struct data_event *ev, __u64 captured)
{
    __u64 n = captured;
    if (n > SITS_MAX_PAYLOAD)
        n = SITS_MAX_PAYLOAD;
    asm volatile("" : "+r"(n));
    if (n > SITS_MAX_PAYLOAD)
        return 0; /* never: a bound the verifier can see on the register it checks */
    ev->captured = n;
    return submit(ev, DATA_HDR_SIZE + n, EV_DATA);
}

static __always_inline struct data_event *data_event_init(__u64 id, __u64 conn_id, __u8 role)
{
    int zero = 0;
    struct data_scratch_t *sc = data_scratch.lookup(&zero);
    if (!sc)
        return 0;
    struct data_event *ev = &sc->ev;
    ev->kind = EV_DATA;
    ev->tgid = id >> 32;
    ev->tid = (__u32)id;
    ev->conn_id = conn_id;
    ev->role = role;
    ev->ssl = 0;
    ev->runq_us = (__u32)(runq_snapshot(id) / 1000);
    return ev;
}

#endif /* SITS_SOCKIO_H */
