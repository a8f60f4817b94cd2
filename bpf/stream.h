/* Streamed responses aggregated in the kernel (included by http.c and tls.c).
 *
 * A server's response to a model-serving request is written one event (one token) at a
 * time: N writes, N ring records, N decodes and parses in the agent. Instead, the first
 * write of a response (its head) goes out as an EV_DATA record as usual; each later write
 * of the same response that is exactly one chunk (`1a\r\n...\r\n`, chunked
 * transfer-encoding, the framing of SSE and of most streamed bodies; the terminator may
 * follow it) is folded into one `struct stream_event` kept per connection in `streams`
 * (a write that is not, from a runtime that merges or splits chunks, goes out as a record
 * after what was folded, so every count stays exact): writes counted, first
 * and last write times, the largest and total pause between writes, body bytes (the
 * chunk sizes), writes whose data begins with `data:` (SSE events), and the first
 * SITS_STREAM_TAIL bytes of the last two writes (the final event that carries `usage`,
 * and `data: [DONE]`). The summary is sent as one record when the response visibly ends
 * (a write that ends with the chunked terminator `0\r\n\r\n`), when the next request is
 * read, when the connection closes, or after SITS_STREAM_FLUSH_NS or a write it cannot
 * fold (an iovec write, or one that is not a whole chunk), so a head plus one summary
 * stand for the whole stream.
 *
 * Cost per folded write: one LRU-hash lookup and three small user reads (16 bytes of
 * head, 5 bytes of tail, up to SITS_STREAM_TAIL bytes kept), against a ring record of up
 * to SITS_MAX_PAYLOAD bytes and its decode before. Responses written in one write (most
 * non-streamed ones) never reach this file past one comparison.
 */
#ifndef SITS_STREAM_H
#define SITS_STREAM_H

#include "events.h"

#ifndef SITS_STREAM_AGG
#define SITS_STREAM_AGG 1 /* 0: every write is its own record, as before */
#endif
#ifndef SITS_MAX_STREAMS
#define SITS_MAX_STREAMS 2048 /* responses folded at once (LRU: the oldest is dropped) */
#endif
#ifndef SITS_STREAM_FLUSH_NS
#define SITS_STREAM_FLUSH_NS 20000000000ULL /* a summary at least this often (< idle 30 s) */
#endif

enum stream_end {
    STREAM_END_TERMINATOR = 1, /* a write ended with 0\r\n\r\n: the response is complete */
    STREAM_END_NEXT = 2,       /* the next request was read: the response had ended */
    STREAM_END_CLOSE = 3,      /* the connection closed */
    STREAM_END_FLUSH = 4,      /* time, or a write that could not be folded: more follows */
};

#if SITS_STREAM_AGG
BPF_TABLE("lru_hash", __u64, struct stream_event, streams, SITS_MAX_STREAMS);
/* never written: the zeroes a new `streams` entry starts from (too big for the stack) */
BPF_PERCPU_ARRAY(stream_zero, struct stream_event, 1);

/* Send the folded writes of connection `key` and stop folding. */
static __always_inline void stream_flush(__u64 key, struct conn_state *st, __u8 end)
{
    st->agg = 0;
    struct stream_event *s = streams.lookup(&key);
    if (!s)
        return;
    s->end = end;
    if (submit(s, sizeof(*s), EV_STREAM) < 0)
        st->lost = 1; /* the next record of the connection carries DATA_LOST */
    streams.delete(&key);
}

/* Chunk-size line at the start of `h`: its length with CRLF (0: none), the size, and
 * whether the chunk data begins with `data:` (an SSE event). Constant indices only. */
static __always_inline __u32 chunk_line(__u64 lo, __u64 hi, __u32 *size, int *sse)
{
    __u32 v = 0;
    /* lo holds bytes i..i+7 of the write, hi the ones after: scalars only, no stack
     * indexing for the verifier to refuse */
#pragma unroll
    for (int i = 0; i < 9; i++) {
        __u8 c = lo & 0xff;
        __u32 d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if (c >= 'a' && c <= 'f')
            d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F')
            d = c - 'A' + 10;
        else {
            if (i == 0 || c != '\r' || ((lo >> 8) & 0xff) != '\n')
                return 0;
            *size = v;
            __u64 rest = (lo >> 16) | (hi << 48);
            *sse = (rest & 0xffffffffffULL) == 0x3a61746164ULL; /* "data:" */
            return i + 2;
        }
        v = (v << 4) | d;
        lo = (lo >> 8) | (hi << 56);
        hi >>= 8;
    }
    return 0;
}

static __always_inline int is_terminator(const __u8 *t)
{
    return t[0] == '0' && t[1] == '\r' && t[2] == '\n' && t[3] == '\r' && t[4] == '\n';
}

static __always_inline void stream_tail(struct stream_event *s, __u64 buf, __u64 len)
{
    __u64 n = len > SITS_STREAM_TAIL ? SITS_STREAM_TAIL : len;
    asm volatile("" : "+r"(n));
    if (n > SITS_STREAM_TAIL)
        return;
    __u8 slot = s->tail_last ^ 1;
    if (slot) {
        bpf_probe_read_user(s->tail1, n, (void *)buf);
        s->tail1_len = n;
    } else {
        bpf_probe_read_user(s->tail0, n, (void *)buf);
        s->tail0_len = n;
    }
    s->tail_last = slot;
}

/* Fold one body write into `s`: 1 when it ended the response, 0 when folded, -1 when it
 * is not a whole chunk (with or without the terminator after it) and was not folded. */
static __always_inline int stream_add(struct stream_event *s, __u64 buf, __u64 len,
                                      __u64 t_enter, __u64 t_exit, const __u64 *head)
{
    __u8 tail[5] = {};
    if (len >= 5)
        bpf_probe_read_user(tail, 5, (void *)(buf + len - 5));
    int term = len >= 5 && is_terminator(tail);
    if (term && len == 5) {
        s->end_ns = t_exit; /* the terminator alone: no body bytes */
        return 1;
    }
    __u32 size = 0;
    int sse = 0;
    __u32 hl = chunk_line(head[0], head[1], &size, &sse);
    if (!hl || (__u64)hl + size + 2 + (term ? 5 : 0) != len)
        return -1;
    if (s->writes == 0) {
        s->first_enter_ns = t_enter;
        s->first_exit_ns = t_exit;
        __u64 n = len > SITS_STREAM_HEAD ? SITS_STREAM_HEAD : len;
        asm volatile("" : "+r"(n));
        if (n <= SITS_STREAM_HEAD) {
            bpf_probe_read_user(s->head, n, (void *)buf);
            s->head_len = n;
        }
    } else {
        if (s->writes == 1)
            s->second_enter_ns = t_enter;
        __u64 gap = t_enter > s->last_exit_ns ? t_enter - s->last_exit_ns : 0;
        s->sum_gap_ns += gap;
        if (gap > s->max_gap_ns)
            s->max_gap_ns = gap;
    }
    s->writes++;
    s->last_enter_ns = t_enter;
    s->last_exit_ns = t_exit;
    s->wire_bytes += len;
    s->body_bytes += size;
    s->events += sse;
    stream_tail(s, buf, len);
    if (term)
        s->end_ns = t_exit;
    return term;
}

/* A write of a server's response, after capture_exchange said it is captured. `first`:
 * it is the response's first write (its head). Returns 1 when the write was folded (send
 * nothing), 0 when it goes out as an EV_DATA record. `buf` 0: an iovec or sendfile write. */
static __always_inline int stream_write(__u64 id, __u64 key, struct conn_state *st, int first,
                                        __u64 buf, __u64 len, __u64 t_enter, __u64 t_exit,
                                        __u64 ssl)
{
    if (st->role != ROLE_SERVER)
        return 0;
    if (first) {
        if (st->agg) /* a new response: the one being folded had ended */
            stream_flush(key, st, STREAM_END_NEXT);
        return 0;
    }
    if (!buf || len < 5) {
        if (st->agg)
            stream_flush(key, st, STREAM_END_FLUSH);
        return 0;
    }
    __u64 head[2] = {}; /* the write's first 16 bytes */
    bpf_probe_read_user(head, len < 16 ? (len & 15) : 16, (void *)buf);
    struct stream_event *s = 0;
    if (st->agg) {
        s = streams.lookup(&key);
        if (!s)
            st->agg = 0; /* evicted: the LRU held more streams than SITS_MAX_STREAMS */
    }
    if (!s) {
        __u32 size = 0;
        int sse = 0;
        if (!chunk_line(head[0], head[1], &size, &sse))
            return 0; /* not chunked framing: the parser counts it as before */
        int zero = 0;
        struct stream_event *z = stream_zero.lookup(&zero);
        if (!z)
            return 0;
        streams.update(&key, z);
        s = streams.lookup(&key);
        if (!s)
            return 0;
        s->kind = EV_STREAM;
        s->tgid = id >> 32;
        s->conn_id = st->conn_id;
        s->fd = (__s32)(__u32)key;
        s->role = st->role;
        s->ssl = ssl;
        s->source = ssl ? SRC_TLS : SRC_SYSCALL;
        s->tail_last = 1;
        st->agg = 1;
    }
    s->tid = (__u32)id;
    /* runq_us stays 0: a run-queue read here doubled the verifier's paths (sched.c on) */
    int added = stream_add(s, buf, len, t_enter, t_exit, head);
    if (added < 0) {
        /* merged or split chunks: the write goes out as a record, after what was folded */
        if (s->writes) {
            stream_flush(key, st, STREAM_END_FLUSH);
        } else {
            st->agg = 0;
            streams.delete(&key);
        }
        return 0;
    }
    if (added) {
        stream_flush(key, st, STREAM_END_TERMINATOR);
    } else if (t_exit - s->first_enter_ns > SITS_STREAM_FLUSH_NS) {
        stream_flush(key, st, STREAM_END_FLUSH);
    }
    return 1;
}

/* A write that cannot be folded (iovec, sendfile): send what was folded before it. */
static __always_inline void stream_cut(__u64 key, struct conn_state *st, int first)
{
    if (st->agg)
        stream_flush(key, st, first ? STREAM_END_NEXT : STREAM_END_FLUSH);
}

/* A read on the connection, or its close: a response being folded has ended. */
static __always_inline void stream_end(__u64 key, struct conn_state *st, __u8 end)
{
    if (st->agg)
        stream_flush(key, st, end);
}
#else
static __always_inline int stream_write(__u64 id, __u64 key, struct conn_state *st, int first,
                                        __u64 buf, __u64 len, __u64 t_enter, __u64 t_exit,
                                        __u64 ssl)
{
    return 0;
}
static __always_inline void stream_end(__u64 key, struct conn_state *st, __u8 end) {}
static __always_inline void stream_cut(__u64 key, struct conn_state *st, int first) {}
#endif

#endif /* SITS_STREAM_H */
