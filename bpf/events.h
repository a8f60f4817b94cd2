/* Event records and maps shared by every sits-trace program.
 *
 * Layout rules: a kind field first, then the largest fields first, explicit
 * _pad, never packed. agent/capture/wire.py mirrors every record, map key/value the
 * agent reads and enum of bpf/ with ctypes; tests/integration/test_layout.py checks the
 * mirror against what BCC derives from the C (sizes, offsets, enum values).
 *
 * All programs write to one ring buffer, `events`. The agent reads it on a timer
 * (trace.poll_ms), in batches; a record is committed without waking the reader
 * unless SITS_WAKEUP_BYTES have been written on this CPU since its last wakeup, so
 * a burst that would fill the ring before the timer is still read in time. Every
 * failed reserve/output is counted in `lost`, indexed by event kind.
 */
#ifndef SITS_EVENTS_H
#define SITS_EVENTS_H

#include <uapi/linux/ptrace.h>
#include <linux/sched.h>

#ifndef SITS_RINGBUF_PAGES
#define SITS_RINGBUF_PAGES 4096 /* 16 MiB with 4 KiB pages */
#endif
#ifndef SITS_MAX_PAYLOAD
#define SITS_MAX_PAYLOAD 4096 /* bytes captured per read/write; a power of two */
#endif
#ifndef SITS_AGENT_PID
#define SITS_AGENT_PID 0
#endif
#ifndef SITS_MAX_CONNS
#define SITS_MAX_CONNS 65536
#endif
#ifndef SITS_WAKEUP_BYTES
#define SITS_WAKEUP_BYTES (SITS_RINGBUF_PAGES * 4096ULL / 8) /* per CPU, between wakeups */
#endif
#ifndef SITS_FILTER_PIDS
#define SITS_FILTER_PIDS 0 /* 1: only processes in `target_pids` */
#endif

#ifndef AF_INET
#define AF_INET 2
#endif
#ifndef AF_INET6
#define AF_INET6 10
#endif

enum sits_kind {
    EV_CONN_OPEN = 1,
    EV_CONN_CLOSE = 2,
    EV_DATA = 3,
    EV_PROC_EXEC = 4,
    EV_PROC_EXIT = 5,
    EV_TCP_EVENT = 6, /* tcp.c: one retransmit or reset (struct tcp_event) */
    /* 7: tcp.c, 8: sched.c (reserved) */
    EV_CUDA_COPY = 9,  /* cuda.c: one host<->device copy (struct cuda_copy_event) */
    EV_CUDA_MEM = 10,  /* cuda.c: an allocation or free (struct cuda_mem_event) */
    EV_CUDA_INIT = 11, /* cuda.c: cuInit (struct cuda_init_event) */
    EV_STREAM = 12,    /* stream.h: the folded body writes of a streamed response */
    EV_KIND_MAX = 16,
};

enum sits_source {
    SRC_SYSCALL = 0,
    SRC_TLS = 1,
    SRC_SENDFILE = 2, /* bytes moved, none captured */
};

enum sits_role {
    ROLE_UNKNOWN = 0,
    ROLE_SERVER = 1,
    ROLE_CLIENT = 2,
};

/* EV_CONN_OPEN / EV_CONN_CLOSE */
struct conn_event {
    __u32 kind;
    __u32 tgid;
    __u64 conn_id;
    __u64 ts_ns;
    __u64 bytes_in;  /* close: bytes read over the connection's life */
    __u64 bytes_out; /* close: bytes written */
    __u32 tid;
    __s32 fd;
    __s32 listen_fd; /* accept: the listening socket; -1 otherwise */
    __u16 family;    /* AF_INET / AF_INET6 / 0 when unknown */
    __u16 peer_port; /* host byte order */
    __u8 peer_addr[16];
    char comm[TASK_COMM_LEN];
    __u8 role;
    __u8 tls;
    __u16 local_port; /* host byte order; 0 when unknown */
    __u8 _pad[4];
};

/* EV_DATA: one read or write on a traced connection, with its payload prefix */
struct data_event {
    __u32 kind;
    __u32 tgid;
    __u64 conn_id;
    __u64 ts_enter_ns;
    __u64 ts_exit_ns;
    __u64 ssl; /* SSL* for TLS plaintext, 0 otherwise */
    __u32 tid;
    __s32 fd;
    __u32 len;      /* bytes that really moved */
    __u32 captured; /* bytes of payload that follow */
    __u8 direction; /* 0 ingress (read), 1 egress (write) */
    __u8 source;    /* enum sits_source */
    __u8 role;
    __u8 flags;     /* DATA_SAMPLE_SHIFT: this exchange stands for 2^shift (load shedding);
                     * DATA_GAP: whole exchanges were skipped on the connection before it;
                     * DATA_LOST: records of the connection were lost (ring full) before it,
                     * so its bytes resume at an unknown offset */
    __u32 runq_us;  /* the thread's run-queue wait so far (sched.c), low 32 bits of
                     * microseconds: subtract modulo 2^32; 0 without sched.c */
    char payload[SITS_MAX_PAYLOAD];
};
#define DATA_HDR_SIZE (sizeof(struct data_event) - SITS_MAX_PAYLOAD)
#define DATA_SAMPLE_SHIFT 0x1f
#define DATA_GAP 0x80
#define DATA_LOST 0x40
#define DATA_TAIL 0x20 /* the payload is the last `captured` bytes of `len`, not the first */

#ifndef SITS_STREAM_TAIL
#define SITS_STREAM_TAIL 1024 /* bytes kept of each of a stream's last two writes */
#endif
#ifndef SITS_STREAM_HEAD
#define SITS_STREAM_HEAD 384 /* bytes kept of a stream's first folded write */
#endif

/* EV_STREAM: the body writes of one streamed response after its head, folded in the
 * kernel (stream.h). Gaps are from a write's entry to the previous write's exit. */
struct stream_event {
    __u32 kind;
    __u32 tgid;
    __u64 conn_id;
    __u64 ssl;            /* SSL* for TLS plaintext, 0 otherwise */
    __u64 first_enter_ns; /* first folded write carrying body bytes */
    __u64 first_exit_ns;
    __u64 last_enter_ns;  /* last folded write carrying body bytes */
    __u64 last_exit_ns;
    __u64 end_ns;         /* exit of the write that ended with 0\r\n\r\n; 0: not seen */
    __u64 max_gap_ns;     /* largest pause between two folded body writes */
    __u64 sum_gap_ns;     /* all pauses between folded body writes */
    __u64 wire_bytes;     /* bytes written, chunk framing included */
    __u64 body_bytes;     /* chunk data bytes */
    __u32 tid;
    __s32 fd;
    __u32 writes;         /* folded writes carrying body bytes */
    __u32 events;         /* of them, writes whose chunk data begins with `data:` */
    __u32 inexact;        /* 0: only whole chunks fold (stream.h); kept in the layout */
    __u32 runq_us;        /* 0 for now (not read: it doubled the verifier's paths) */
    __u16 tail0_len;
    __u16 tail1_len;
    __u8 tail_last;       /* 0/1: the slot holding the newest write */
    __u8 end;             /* enum stream_end (stream.h) */
    __u8 role;
    __u8 source;
    char tail0[SITS_STREAM_TAIL];
    char tail1[SITS_STREAM_TAIL];
    /* after the tails, so records made before these fields still decode */
    __u64 second_enter_ns; /* the second folded write: the first token after a preamble
                              event (OpenAI chat's role chunk); 0: one write */
    __u16 head_len;
    __u8 _pad2[6];
    char head[SITS_STREAM_HEAD]; /* first bytes of the first folded write */
};

/* EV_PROC_EXEC / EV_PROC_EXIT: lets the agent find libraries in new processes */
struct proc_event {
    __u32 kind;
    __u32 tgid;
    __u64 ts_ns;
    char comm[TASK_COMM_LEN];
};

/* A traced connection: key (tgid << 32 | fd) */
struct conn_state {
    __u64 conn_id;
    __u64 bytes_in;
    __u64 bytes_out;
    __u64 ssl;
    __u8 role;
    __u8 tls;
    __u8 last_dir; /* direction of the last plaintext seen + 1; 0 before any */
    __u8 skip;     /* the current exchange is not captured (load shedding) */
    __u8 gap;      /* exchanges were skipped since the last record sent */
    __u8 shift;    /* the current exchange was captured as 1 in 2^shift */
    __u8 lost;     /* a record of this connection failed to reserve since the last one sent */
    __u8 dribble;  /* small request reads in the current exchange (slowloris bound) */
    __u8 agg;      /* a streamed response is being folded in `streams` (stream.h) */
    __u8 tail;     /* this read/write is past SITS_BODY_HEAD bytes of its request: tail only */
    __u8 fold;     /* reads of a long request body are being folded in `body_folds` (fold.h) */
    __u8 mute;     /* set by the agent: no HTTP here (another protocol, a tunnel, TLS nobody
                    * probes); its reads and writes are counted, never sent (http.c) */
    __u8 sk_known; /* 1: its struct sock was looked for (sockio.h's rtt_socks) */
    __u8 _pad[3];
    __u64 run;     /* bytes moved in the exchange's current direction, this transfer's included */
};

BPF_RINGBUF_OUTPUT(events, SITS_RINGBUF_PAGES);
BPF_PERCPU_ARRAY(lost, __u64, EV_KIND_MAX);
BPF_PERCPU_ARRAY(seen, __u64, EV_KIND_MAX);
BPF_HASH(conns, __u64, struct conn_state, SITS_MAX_CONNS);
#ifndef SITS_MAX_TARGETS
#define SITS_MAX_TARGETS 16384
#endif
/* --pid: the traced processes and, by sched_process_fork, every task they start (threads
 * too: the tracepoint cannot tell them apart), each removed when it exits */
BPF_HASH(target_pids, __u32, __u8, SITS_MAX_TARGETS);
BPF_ARRAY(next_conn_id, __u64, 1);
/* scratch for building EV_DATA: the slack lets the verifier accept an iovec copy at
 * a variable offset (offset and size each masked below SITS_MAX_PAYLOAD) */
struct data_scratch_t {
    struct data_event ev;
    char slack[SITS_MAX_PAYLOAD];
};
BPF_PERCPU_ARRAY(data_scratch, struct data_scratch_t, 1);
BPF_PERCPU_ARRAY(since_wakeup, __u64, 1);
/* Load shedding, set by the agent when it cannot keep up: capture one exchange in
 * 2^capture_shift (0: all). Decided at each exchange's first byte, so a connection's
 * stream is cut only between exchanges, never inside one. */
BPF_ARRAY(capture_shift, __u32, 1);
BPF_PERCPU_ARRAY(exchange_seq, __u64, 1);
/* exchanges not captured, per process and role: key tgid << 8 | role */
BPF_PERCPU_HASH(shed, __u64, __u64, 4096);
/* A request that arrives in more than SITS_MAX_DRIBBLE reads of fewer than SITS_DRIBBLE_BYTES
 * (a slowloris: 1 byte / 100 ms) stops being captured there, so an exchange captured before
 * shedding began cannot keep costing the agent a record per byte; the rest of the exchange is
 * skipped like a shed one (the next record carries DATA_GAP) and counted here. */
#ifndef SITS_MAX_DRIBBLE
#define SITS_MAX_DRIBBLE 64
#endif
#ifndef SITS_DRIBBLE_BYTES
#define SITS_DRIBBLE_BYTES 128
#endif
BPF_PERCPU_ARRAY(dribbles, __u64, 1);
/* A request body is captured in full for its first SITS_BODY_HEAD bytes (what GenAI
 * attributes and the parser need: headers and the start of the JSON); each later read of
 * the same request (bytes moved one way with no reply between) sends only its last
 * SITS_TAIL_BYTES, flagged DATA_TAIL: the length stays exact and the body's tail (a prompt's
 * trailing "model" or "max_tokens") is still seen. A 30 MiB upload read 4 KiB at a time sent
 * 30 MiB of payload into a 16 MiB ring before, and the ring overflowed (test_hostile).
 * Those later reads are folded into one such record (fold.h body_folds). A
 * server's writes of a response past its first SITS_BODY_HEAD bytes send their last bytes
 * too, when longer than the capture (capture_exchange). */
#ifndef SITS_BODY_HEAD
#define SITS_BODY_HEAD 65536
#endif
#ifndef SITS_TAIL_BYTES
#define SITS_TAIL_BYTES (SITS_MAX_PAYLOAD < 512 ? SITS_MAX_PAYLOAD : 512)
#endif

/* A transfer longer than the capture sends its last bytes as a second record: the rest after
 * the capture, at most SITS_TAIL_BYTES (a 10 KB prompt read at once keeps the "max_tokens"
 * the openai SDK writes after the messages; a non-streamed completion's write, and a client's
 * read of it, keep the "usage" that ends it; a 4.5 KB one is captured whole). A write only
 * in its direction's first SITS_BODY_HEAD bytes (later ones send their last bytes alone:
 * capture_exchange). Returns how many bytes the second record takes, 0 for none. `st` may be
 * 0 (tls.c before the connection is known). */
static __always_inline __u64 split_tail(struct conn_state *st, __u8 dir, __u64 len)
{
    if (len <= SITS_MAX_PAYLOAD || (dir == 1 && st && st->run - len >= SITS_BODY_HEAD))
        return 0;
    __u64 n = len - SITS_MAX_PAYLOAD;
    return n > SITS_TAIL_BYTES ? SITS_TAIL_BYTES : n;
}

#ifndef SITS_SCHED
#define SITS_SCHED 0 /* 1: sched.c is loaded */
#endif
#ifndef SITS_MAX_THREADS
#define SITS_MAX_THREADS 16384
#endif
/* per thread, kept by sched.c: run-queue wait, like /proc/<tid>/schedstat's second field */
struct runq_thread {
    __u64 delay_ns; /* waits completed since the thread was first tracked */
    __u64 count;    /* waits timed */
    __u32 tgid;
    __u32 untimed;  /* runs on a CPU whose wait went unseen (a probe run the kernel skipped) */
};
#if SITS_SCHED
BPF_TABLE("lru_hash", __u32, struct runq_thread, runq_threads, SITS_MAX_THREADS);
BPF_HASH(sched_tgids, __u32, __u8, 4096); /* processes whose threads sched.c tracks */
/* Threads with an entry in `runq_threads`, a bit each (thread ids below PID_MAX_LIMIT, 2^22):
 * sched.c's programs run at every context switch and wakeup on the node, and return after a
 * bit test for a thread that is not tracked, where they made hash lookups. A bit may outlive
 * its entry (an LRU eviction): the lookup that follows misses, as before. A tracked thread
 * whose bit is missing (the agent's read-modify-write of a word at start can race with the
 * kernel's) gets it back the next time it leaves a CPU (sched.c's on_switch_out). */
#define SITS_TID_WORDS 65536
BPF_ARRAY(runq_tid_bits, __u64, SITS_TID_WORDS);

static __always_inline int runq_tid_on(__u32 tid)
{
    __u32 i = (tid >> 6) & (SITS_TID_WORDS - 1);
    __u64 *w = runq_tid_bits.lookup(&i);
    return w && ((*w >> (tid & 63)) & 1);
}

static __always_inline void runq_tid_mark(__u32 tid, int on)
{
    __u32 i = (tid >> 6) & (SITS_TID_WORDS - 1);
    __u64 *w = runq_tid_bits.lookup(&i);
    __u64 bit = 1ULL << (tid & 63);
    if (!w)
        return;
    if (on && !(*w & bit))
        __sync_fetch_and_or(w, bit);
    else if (!on && (*w & bit))
        __sync_fetch_and_and(w, ~bit);
}
#endif

/* The calling thread's run-queue wait so far, for EV_DATA (the agent takes differences).
 * With the kernel's BTF: the scheduler's own total, task_struct.sched_info.run_delay (what
 * /proc/<tid>/schedstat's second field shows), one load from `current`, which the verifier
 * lets a program make directly from the BTF pointer (written in assembly so that no rewriter
 * turns it into a probe read). It replaced a lookup in sched.c's per-thread counters, whose
 * waits sched.c timed itself and missed 1-2% of. Without BTF: those counters (a thread's first
 * traced I/O starts tracking it and its process, so its counter starts at 0 here). */
static __always_inline __u64 runq_snapshot(__u64 id)
{
#if SITS_SCHED
#ifdef SITS_OFF_TASK_RUN_DELAY
    __u64 task = (__u64)bpf_get_current_task_btf(), v;
    asm volatile("%0 = *(u64 *)(%1 + %2)" : "=r"(v) : "r"(task), "i"(SITS_OFF_TASK_RUN_DELAY));
    return v;
#else
    __u32 tid = (__u32)id, tgid = id >> 32;
    struct runq_thread *t = runq_threads.lookup(&tid);
    if (t)
        return t->delay_ns;
    struct runq_thread fresh = {.tgid = tgid};
    __u8 one = 1;
    runq_threads.update(&tid, &fresh);
    runq_tid_mark(tid, 1);
    sched_tgids.update(&tgid, &one);
#endif
#endif
    return 0;
}

/* sched.c tracks the threads of processes with traced connections (without --pid filtering):
 * a process is added when one of its connections is registered */
static __always_inline void sched_track(__u32 tgid)
{
#if SITS_SCHED
    if (!sched_tgids.lookup(&tgid)) {
        __u8 one = 1;
        sched_tgids.update(&tgid, &one);
    }
#endif
}

static __always_inline __u64 conn_key(__u32 tgid, int fd)
{
    return ((__u64)tgid << 32) | (__u32)fd;
}

static __always_inline void count_lost(int kind)
{
    int k = kind;
    __u64 *v = lost.lookup(&k);
    if (v)
        (*v)++;
}

static __always_inline void count_seen(int kind)
{
    int k = kind;
    __u64 *v = seen.lookup(&k);
    if (v)
        (*v)++;
}

/* Wake the reader once SITS_WAKEUP_BYTES were written on this CPU since the last
 * wakeup. Waking it per record (the ring's default when the reader has caught up)
 * makes it spin on a few records at a time, a CPU taken from the traced server. */
static __always_inline __u64 wakeup_flag(__u64 size)
{
    int zero = 0;
    __u64 *n = since_wakeup.lookup(&zero);
    if (!n)
        return 0;
    *n += size;
    if (*n < SITS_WAKEUP_BYTES)
        return BPF_RB_NO_WAKEUP;
    *n = 0;
    return BPF_RB_FORCE_WAKEUP;
}

/* Send one record; count it as seen, or as lost when the ring is full (returns -1). */
static __always_inline int submit(void *rec, __u64 size, int kind)
{
    __u64 flags = wakeup_flag(size);
    count_seen(kind);
    if (events.ringbuf_output(rec, size, flags) < 0) {
        count_lost(kind);
        return -1;
    }
    return 0;
}

/* Processes that own a traced connection, one bit per tgid (PID_MAX_LIMIT is 2^22 on
 * 64-bit). An array lookup the verifier inlines: a read or write of any other process
 * (a load generator beside the traced server) returns after a few instructions, before
 * any hash lookup. Set when a connection is registered, cleared when the process exits. */
#define SITS_TGID_WORDS 65536
BPF_ARRAY(conn_tgids, __u64, SITS_TGID_WORDS);

static __always_inline int has_conns(__u32 tgid)
{
    __u32 i = (tgid >> 6) & (SITS_TGID_WORDS - 1);
    __u64 *w = conn_tgids.lookup(&i);
    return w && ((*w >> (tgid & 63)) & 1);
}

static __always_inline void mark_conns(__u32 tgid, int on)
{
    __u32 i = (tgid >> 6) & (SITS_TGID_WORDS - 1);
    __u64 *w = conn_tgids.lookup(&i);
    __u64 bit = 1ULL << (tgid & 63);
    if (!w)
        return;
    if (on && !(*w & bit))
        __sync_fetch_and_or(w, bit);
    else if (!on && (*w & bit))
        __sync_fetch_and_and(w, ~bit);
}

/* Should events of this process be traced at all? */
static __always_inline int traced_tgid(__u32 tgid)
{
    if (tgid == SITS_AGENT_PID)
        return 0;
#if SITS_FILTER_PIDS
    if (!target_pids.lookup(&tgid))
        return 0;
#endif
    return 1;
}

/* At the first byte of each exchange (a request read by a server, written by a client),
 * decide whether the exchange is captured. Returns 0 when its bytes are not to be sent. */
static __always_inline int capture_exchange(__u32 tgid, struct conn_state *st, __u8 direction,
                                            __u64 len)
{
    __u8 cur = direction + 1;
    __u8 req = st->role == ROLE_CLIENT ? 2 : 1;
    if (cur == req && st->last_dir != req) {
        int zero = 0;
        __u32 *shift = capture_shift.lookup(&zero);
        __u32 s = shift ? *shift & DATA_SAMPLE_SHIFT : 0;
        __u8 skip = 0;
        /* counted whether or not shedding is on: the agent's measure of exchanges offered */
        __u64 *seq = exchange_seq.lookup(&zero);
        if (seq) {
            __u64 n = (*seq)++;
            if (s)
                skip = (n & ((1ULL << s) - 1)) != 0;
        }
        st->skip = skip;
        st->shift = s;
        st->dribble = 0;
        st->run = 0;
        if (skip) {
            st->gap = 1;
            __u64 key = ((__u64)tgid << 8) | st->role, one = 1;
            __u64 *c = shed.lookup(&key);
            if (c)
                (*c)++;
            else
                shed.update(&key, &one);
        }
    }
    /* `run` counts the bytes of the exchange's current direction: it restarts when the
     * response begins (x = 0 when the direction is the same as the last one's) */
    __u64 x = st->last_dir ^ cur;
    asm volatile("" : "+r"(x));
    st->run *= 1 - (((x | (0 - x)) >> 63) & 1);
    st->last_dir = cur;
    /* tail = only this transfer's last bytes are sent: SITS_BODY_HEAD bytes of its direction
     * went before, and it is the request's direction, or it is a server's write of the
     * response longer than the capture (its first bytes would be the middle of a body; its
     * last may end it: a completion's "usage", after 300 KB of embeddings). Computed without
     * branches: each branch here multiplies the verifier's paths in every caller (cur, req
     * are 1 or 2: cur ^ req is 0 or 3; a client's writes are its request) */
    __u64 same = cur ^ req;
    asm volatile("" : "+r"(same)); /* nor may the compiler thread it into the branches */
    same = 1 - (same & 1);
    __u64 past = ((__u64)SITS_BODY_HEAD - 1 - st->run) >> 63;
    __u64 big = ((__u64)SITS_MAX_PAYLOAD - len) >> 63;
    st->tail = (__u8)(past & (same | (big & direction)));
    st->run += len;
    if (cur == req && len < SITS_DRIBBLE_BYTES && !st->skip && ++st->dribble > SITS_MAX_DRIBBLE) {
        int zero = 0;
        __u64 *d = dribbles.lookup(&zero);
        if (d)
            (*d)++;
        st->skip = 1;
        st->gap = 1;
    }
    return !st->skip;
}

/* flags for the next record sent on the connection (clears the gap and the loss; a caller
 * whose record is then lost sets st->lost again, so the flag reaches the agent) */
static __always_inline __u8 capture_flags(struct conn_state *st)
{
    __u8 f = st->shift & DATA_SAMPLE_SHIFT;
    if (st->gap) {
        f |= DATA_GAP;
        st->gap = 0;
    }
    if (st->lost) {
        f |= DATA_LOST;
        st->lost = 0;
    }
    return f;
}

static __always_inline __u64 new_conn_id(void)
{
    int zero = 0;
    __u64 *ctr = next_conn_id.lookup(&zero);
    if (!ctr)
        return 0;
    return __sync_fetch_and_add(ctr, 1) + 1;
}

#endif /* SITS_EVENTS_H */
