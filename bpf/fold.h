/* A long request body's later reads, folded (included by http.c and tls.c).
 *
 * Past its first SITS_BODY_HEAD bytes a request body's reads are not sent one by one: the
 * connection's entry in `body_folds` counts their bytes and keeps the last read's last
 * SITS_TAIL_BYTES (a prompt's trailing fields), and one DATA_TAIL record (length: the bytes
 * folded) goes out when the connection's next write begins (the response), at close, or
 * once the fold is SITS_FOLD_FLUSH_NS old. Before, each read was a record: nginx discards
 * an unwanted body 4 KiB a read, 25,600 records for a 100 MiB upload (bench/hostile.py).
 * A full map leaves reads to their own records, as before. TLS connections fold their
 * SSL_reads the same way (tls.c), flushed by the response's first SSL_write. */

#ifndef SITS_FOLD_H
#define SITS_FOLD_H

#ifndef SITS_MAX_BODY_FOLDS
#define SITS_MAX_BODY_FOLDS 1024
#endif
#ifndef SITS_FOLD_FLUSH_NS
#define SITS_FOLD_FLUSH_NS 1000000000ULL
#endif
struct body_fold {
    __u64 conn_id;  /* a stale entry (the fd reused by a connection the close was missed of) */
    __u64 first_ns; /* the first folded read's start */
    __u64 last_ns;  /* the last one's end */
    __u64 bytes;
    __u32 tail_len;
    __u8 source;
    __u8 _pad[3];
    char tail[SITS_TAIL_BYTES];
};
BPF_HASH(body_folds, __u64, struct body_fold, SITS_MAX_BODY_FOLDS);
/* never written: the zeroes a new entry starts from (too big for the stack) */
BPF_PERCPU_ARRAY(body_fold_zero, struct body_fold, 1);

/* Send connection `key`'s folded reads as one record and forget them. */
static __always_inline void body_fold_flush(__u64 id, __u64 key, struct conn_state *st)
{
    st->fold = 0;
    struct body_fold *f = body_folds.lookup(&key);
    if (!f)
        return;
    struct data_event *ev = f->bytes && f->conn_id == st->conn_id ?
        data_event_init(id, st->conn_id, st->role) : 0;
    if (ev) {
        ev->flags = capture_flags(st) | DATA_TAIL;
        ev->fd = (__s32)(__u32)key;
        ev->ts_enter_ns = f->first_ns;
        ev->ts_exit_ns = f->last_ns;
        ev->len = (__u32)f->bytes;
        ev->direction = 0;
        ev->source = f->source;
        __u64 n = f->tail_len;
        if (n > SITS_TAIL_BYTES)
            n = SITS_TAIL_BYTES;
        asm volatile("" : "+r"(n));
        if (n <= SITS_TAIL_BYTES) {
            bpf_probe_read_kernel(ev->payload, n, f->tail);
            if (emit_data(ev, n) < 0)
                st->lost = 1; /* the next record of the connection carries DATA_LOST */
        }
    }
    body_folds.delete(&key);
}

/* Fold a read past the request body's head into the connection's entry. 1: folded, nothing
 * to send now; 0: no room, send it as before. */
static __always_inline int body_fold_add(__u64 id, __u64 key, struct conn_state *st, __u64 buf,
                                         __u64 ret, int vec, __u64 ts, __u64 now, __u8 source)
{
    struct body_fold *f = body_folds.lookup(&key);
    if (!f || f->conn_id != st->conn_id) {
        int zero = 0;
        struct body_fold *z = body_fold_zero.lookup(&zero);
        if (!z || body_folds.update(&key, z))
            return 0;
        f = body_folds.lookup(&key);
        if (!f)
            return 0;
        f->conn_id = st->conn_id;
        f->first_ns = ts;
        f->source = source;
    }
    st->fold = 1;
    f->bytes += ret;
    f->last_ns = now;
    __u64 n = 0;
    if (!vec) { /* an iovec read's tail is not kept: its length only, as before */
        n = ret > SITS_TAIL_BYTES ? SITS_TAIL_BYTES : ret;
        asm volatile("" : "+r"(n));
        if (n > SITS_TAIL_BYTES)
            return 1;
        bpf_probe_read_user(f->tail, n, (void *)(buf + ret - n));
    }
    f->tail_len = n;
    if (now - f->first_ns >= SITS_FOLD_FLUSH_NS || f->bytes >= (1ULL << 30))
        body_fold_flush(id, key, st);
    return 1;
}

#endif /* SITS_FOLD_H */
