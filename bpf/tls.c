/* TLS plaintext through uprobes on OpenSSL: SSL_read, SSL_write, SSL_read_ex,
 * SSL_write_ex (entry and return).
 *
 * An SSL* is tied to its connection in one of two ways:
 *  - socket BIO (nginx, curl, CPython's blocking ssl): the read/write syscall
 *    made inside the SSL call names the fd (http.c records SSL* -> conn);
 *  - memory BIO (asyncio, anyio, uvloop): no syscall inside the call. The bytes name
 *    the fd: SSL_set_bio(ssl, rbio, wbio) gives rbio -> SSL*, and the event loop feeds
 *    the ciphertext a socket read returned into rbio with BIO_write. http.c keeps the
 *    first 16 bytes of each such read -> its connection (read_prefixes); BIO_write(rbio,
 *    buf, n) whose first 16 bytes are one of those ties SSL* to that connection. Order
 *    does not matter: anyio queues the reads of several sockets before it writes them
 *    to their BIOs, uvloop defers the first SSL_read after the handshake. A BIO_write
 *    that starts inside a record (a read that split one) falls back to length: n equal
 *    to the thread's last read, kept from overriding a live connection that holds the
 *    SSL* (two streams of one client get records of one size). For an SSL* made before
 *    the agent attached, or one no BIO_write named yet (node's own BIO), the thread's
 *    last read is the last resort.
 * SSL* and BIO* are keyed with their process (struct ssl_key): forked workers share
 * addresses.
 * Either way the connection is marked TLS and its ciphertext is no longer
 * emitted. Costs a task-storage write per SSL call plus one EV_DATA record, and per
 * ciphertext read of 16 bytes or more a 16-byte read, an LRU lookup and an update.
 * Shares sockio.h with http.c (per-thread state, SSL* -> connection).
 */
#include "events.h"
#include "sockio.h"
#include "stream.h"
#include "fold.h"

static __always_inline int ssl_enter(struct pt_regs *ctx, __u8 dir, int ex)
{
    __u64 id = bpf_get_current_pid_tgid();
    if (!traced_tgid(id >> 32))
        return 0;
    struct thread_io *t = thread_state(id, 1);
    if (!t)
        return 0;
    struct ssl_active a = {};
    a.ssl = PT_REGS_PARM1(ctx);
    a.buf = PT_REGS_PARM2(ctx);
    a.out_len = ex ? PT_REGS_PARM4(ctx) : 0;
    a.ts_ns = bpf_ktime_get_ns();
    a.direction = dir;
    t->ssl = a;
    t->ssl_active = 1;
    return 0;
}

/* memory BIO (read side) -> the SSL* it feeds; LRU: BIO_free is not traced */
BPF_TABLE("lru_hash", struct ssl_key, __u64, bio_ssl, SITS_MAX_CONNS);

static __always_inline int set_bio(struct pt_regs *ctx)
{
    __u64 id = bpf_get_current_pid_tgid();
    if (!traced_tgid(id >> 32))
        return 0;
    __u64 ssl = PT_REGS_PARM1(ctx);
    __u64 rbio = PT_REGS_PARM2(ctx);
    struct ssl_key sk = ssl_key_of(id >> 32, ssl);
    /* SSL_set_bio starts an SSL*'s life. The allocator hands a freed SSL*'s address to
     * the next SSL_new while the old one's socket may still be open (asyncio frees the
     * object before the transport closes): a tie left from that life would make the
     * BIO_write below refuse the new connection and send its records to the old one */
    __u64 *prev = ssl_conns.lookup(&sk);
    if (prev) {
        __u64 pk = *prev;
        struct conn_state *old = conns.lookup(&pk);
        if (old && old->ssl == ssl)
            old->ssl = 0;
        ssl_conns.delete(&sk);
    }
    /* BIO_free is not traced: a freed read BIO's address comes back as another SSL's write
     * BIO, into which the handshake writes its replies, or as a socket BIO (SSL_set_fd: one
     * BIO both ways, whose BIO_write is this SSL's own output). Only a read BIO of its own
     * is fed from outside. */
    __u64 wbio = PT_REGS_PARM3(ctx);
    struct ssl_key wk = ssl_key_of(id >> 32, wbio);
    bio_ssl.delete(&wk);
    if (rbio && rbio != wbio) {
        struct ssl_key bk = ssl_key_of(id >> 32, rbio);
        bio_ssl.update(&bk, &ssl);
    }
    return 0;
}

static __always_inline int bio_write(struct pt_regs *ctx)
{
    __u64 id = bpf_get_current_pid_tgid();
    if (!traced_tgid(id >> 32))
        return 0;
    struct ssl_key bk = ssl_key_of(id >> 32, PT_REGS_PARM1(ctx));
    __u64 *ssl = bio_ssl.lookup(&bk);
    if (!ssl)
        return 0; /* not a read BIO the agent saw attached (socket BIOs end here) */
    struct ssl_key sk = ssl_key_of(id >> 32, *ssl);
    __u64 s = *ssl;
    __u32 len = (__u32)PT_REGS_PARM3(ctx);
    if (len >= sizeof(struct read_prefix)) {
        struct read_prefix rp = {};
        if (!bpf_probe_read_user(&rp, sizeof(rp), (void *)PT_REGS_PARM2(ctx))) {
            __u64 *src = read_prefixes.lookup(&rp);
            if (src && (*src >> 32) == (id >> 32)) {
                /* these bytes came from that socket of this process: a name, whatever the
                 * tie said */
                __u64 k = *src;
                read_prefixes.delete(&rp);
                struct conn_state *st = conns.lookup(&k);
                if (!st)
                    return 0;
                ssl_conns.update(&sk, &k);
                st->tls = 1;
                st->ssl = s;
                return 0;
            }
        }
    }
    struct thread_io *t = thread_state(id, 0);
    if (!t || !t->last_read_conn || t->last_read_len != len)
        return 0;
    __u64 k = t->last_read_conn;
    /* a length is not a name: two streams of one client get records of one size. An SSL*
     * already tied to a live connection that holds it keeps its tie (a tie is made at the
     * handshake's first record, and undone when its connection closes) */
    __u64 *cur = ssl_conns.lookup(&sk);
    if (cur && *cur != k) {
        __u64 ck = *cur;
        struct conn_state *owner = conns.lookup(&ck);
        if (owner && owner->ssl == s)
            return 0;
    }
    struct conn_state *st = conns.lookup(&k);
    if (!st)
        return 0;
    ssl_conns.update(&sk, &k);
    st->tls = 1;
    st->ssl = s;
    return 0;
}

/* the connection an SSL* belongs to, learning it from the last recv if needed */
static __always_inline struct conn_state *ssl_conn(struct thread_io *t, __u64 ssl,
                                                  __u64 *key_out)
{
    __u64 k = 0;
    struct ssl_key sk = ssl_key_of(bpf_get_current_pid_tgid() >> 32, ssl);
    __u64 *key = ssl_conns.lookup(&sk);
    if (key) {
        k = *key;
    } else {
        k = t->last_read_conn;
        if (!k)
            return 0;
        ssl_conns.update(&sk, &k);
    }
    struct conn_state *st = conns.lookup(&k);
    if (!st)
        return 0;
    st->tls = 1;
    st->ssl = ssl;
    *key_out = k;
    return st;
}

static __always_inline int ssl_exit(struct pt_regs *ctx)
{
    __u64 id = bpf_get_current_pid_tgid();
    struct thread_io *t = thread_state(id, 0);
    if (!t || !t->ssl_active)
        return 0;
    struct ssl_active a = t->ssl;
    t->ssl_active = 0;
    int rc = (int)PT_REGS_RC(ctx); /* SSL_* return int: the upper half of rax is not theirs */
    __u64 len = 0;
    if (a.out_len) {
        if (rc != 1)
            return 0;
        bpf_probe_read_user(&len, sizeof(len), (void *)a.out_len);
    } else {
        if (rc <= 0)
            return 0;
        len = rc;
    }
    if (len == 0)
        return 0;
    __u64 key = 0;
    struct conn_state *st = ssl_conn(t, a.ssl, &key);
    __u64 now = bpf_ktime_get_ns();
    if (st) {
        int first = st->last_dir != a.direction + 1;
        if (a.direction == 0)
            stream_end(key, st, STREAM_END_NEXT);
        if (!capture_exchange(id >> 32, st, a.direction, len))
            return 0;
        /* a request body's reads past its head are folded as on plain sockets (fold.h);
         * the response's first write sends them first */
        if (a.direction == 0 && (st->tail & 1) &&
            body_fold_add(id, key, st, a.buf, len, 0, a.ts_ns, now, SRC_TLS))
            return 0;
        if (a.direction == 1 && st->fold)
            body_fold_flush(id, key, st);
        if (a.direction == 1 && stream_write(id, key, st, first, a.buf, len, a.ts_ns, now, a.ssl))
            return 0;
    }
    struct data_event *ev = data_event_init(id, st ? st->conn_id : 0, st ? st->role : ROLE_UNKNOWN);
    if (!ev)
        return 0;
    ev->flags = st ? capture_flags(st) : 0;
    ev->fd = st ? (__s32)(__u32)key : -1;
    ev->ssl = a.ssl;
    ev->ts_enter_ns = a.ts_ns;
    ev->ts_exit_ns = now;
    ev->len = len;
    ev->direction = a.direction;
    ev->source = SRC_TLS;
    __u64 n = 0, split = 0;
    if (st && st->tail) {
        /* past a body's head (events.h SITS_BODY_HEAD, capture_exchange): the last bytes only */
        ev->flags |= DATA_TAIL;
        n = len > SITS_TAIL_BYTES ? SITS_TAIL_BYTES : len;
        asm volatile("" : "+r"(n));
        if (n > SITS_TAIL_BYTES)
            return 0;
        bpf_probe_read_user(ev->payload, n, (void *)(a.buf + len - n));
    } else {
        n = len > SITS_MAX_PAYLOAD ? SITS_MAX_PAYLOAD : len;
        asm volatile("" : "+r"(n));
        if (n > SITS_MAX_PAYLOAD)
            return 0;
        bpf_probe_read_user(ev->payload, n, (void *)a.buf);
        split = split_tail(st, a.direction, len);
        ev->len = len - split;
    }
    if (emit_data(ev, n) < 0 && st)
        st->lost = 1; /* the next record of the connection carries DATA_LOST */
    if (split) {
        ev->flags = st ? capture_flags(st) : 0;
        ev->len = split;
        asm volatile("" : "+r"(split));
        if (split > SITS_TAIL_BYTES)
            return 0;
        bpf_probe_read_user(ev->payload, split, (void *)(a.buf + len - split));
        if (emit_data(ev, split) < 0 && st)
            st->lost = 1;
    }
    return 0;
}

int sits_ssl_read_enter(struct pt_regs *ctx) { return ssl_enter(ctx, 0, 0); }
int sits_ssl_write_enter(struct pt_regs *ctx) { return ssl_enter(ctx, 1, 0); }
int sits_ssl_read_ex_enter(struct pt_regs *ctx) { return ssl_enter(ctx, 0, 1); }
int sits_ssl_write_ex_enter(struct pt_regs *ctx) { return ssl_enter(ctx, 1, 1); }
int sits_ssl_exit(struct pt_regs *ctx) { return ssl_exit(ctx); }
int sits_ssl_set_bio(struct pt_regs *ctx) { return set_bio(ctx); }
int sits_bio_write(struct pt_regs *ctx) { return bio_write(ctx); }
