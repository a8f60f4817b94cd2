/* TCP health of the node's connections, through tcp: and sock: tracepoints.
 *
 * sock:inet_sock_set_state    opens and closes: lifetimes (log2 histogram), TIME_WAIT entries
 *                             per port; ties a traced client fd to its 4-tuple (connect)
 * tcp:tcp_retransmit_skb      retransmitted segments (err == 0: what TcpRetransSegs counts)
 * tcp:tcp_retransmit_synack   retransmitted SYN-ACKs (also in TcpRetransSegs)
 * tcp:tcp_send_reset          RSTs sent (TcpOutRsts)
 * tcp:tcp_receive_reset       RSTs accepted by a socket (counted per connection once it has an
 *                             entry: established or carrying segments while watched)
 * tcp:tcp_probe               smoothed RTT (srtt) on every segment received in ESTABLISHED
 *
 * Counters live in the kernel: per connection in `tcp_conns` (LRU, keyed by 4-tuple, local
 * side first, IPv4 as v4-mapped IPv6, so the agent finds the counters of a span's connection),
 * node totals in `tcp_totals`, TIME_WAIT entries per port in `tcp_tw_ports`. Retransmits and
 * resets, rare events, are also sent as EV_TCP_EVENT records so the agent can place them inside
 * a span's time window: at most SITS_TCP_EVENTS_PER_S a CPU a second (the rest are counted,
 * TT_EVENTS_UNSENT), and no reset of a segment that found no live connection (a port nobody
 * listens on, TIME_WAIT, a half-open request socket: outside every span; counted only). A
 * client retrying a dead port made ~40k such resets a second, and the agent spent half a core
 * decoding them. Cost: one hash lookup/update per event. tcp_probe, per segment received
 * on the node, looks at traced connections only (sockio.h's `rtt_socks`, filled by http.c,
 * where the kernel's tcp_probe carries the socket), and copies each one's srtt at most once
 * in SITS_SRTT_EVERY_JIFFIES. No kernel struct is read. Uses sockio.h's `connect_inflight`
 * (filled by http.c).
 */
#include "events.h"
#include "sockio.h"

#ifndef IPPROTO_TCP
#define IPPROTO_TCP 6
#endif
#ifndef SITS_EPHEMERAL_LO
#define SITS_EPHEMERAL_LO 32768 /* net.ipv4.ip_local_port_range, passed by the agent */
#endif
#ifndef SITS_EPHEMERAL_HI
#define SITS_EPHEMERAL_HI 60999
#endif
#ifndef SITS_TCP_RETRANS_ERR
#define SITS_TCP_RETRANS_ERR 0 /* 1: tcp_retransmit_skb has `err` (fires on failures too) */
#endif
#ifndef SITS_TCP_RST_SOCKADDR
#define SITS_TCP_RST_SOCKADDR 1 /* 1: tcp_send_reset carries sockaddrs (6.10+), 0: sport/dport */
#endif
#ifndef SITS_TCP_RST_REASON
#define SITS_TCP_RST_REASON 0 /* 1: tcp_send_reset has `enum sk_rst_reason reason` */
#endif
#ifndef SITS_SRTT_EVERY_JIFFIES
#define SITS_SRTT_EVERY_JIFFIES 4 /* tcp_probe's copies of a connection's srtt: 16 ms at HZ=250 */
#endif
#ifndef SITS_TCP_EVENTS_PER_S
#define SITS_TCP_EVENTS_PER_S 4096 /* EV_TCP_EVENT records a CPU may send in a second (2^30 ns) */
#endif

#if SITS_TCP_RST_REASON
/* the tracefs format names this enum; the build headers may predate it */
enum sk_rst_reason { SITS_SK_RST_REASON_NOT_SPECIFIED = 0 };
#endif

enum sits_tcp_state { /* include/net/tcp_states.h */
    ST_ESTABLISHED = 1, ST_SYN_SENT = 2, ST_SYN_RECV = 3, ST_FIN_WAIT1 = 4, ST_FIN_WAIT2 = 5,
    ST_TIME_WAIT = 6, ST_CLOSE = 7, ST_CLOSE_WAIT = 8, ST_LAST_ACK = 9, ST_LISTEN = 10,
    ST_CLOSING = 11, ST_NEW_SYN_RECV = 12,
};

enum sits_tcp_ev { /* tcp_event.type */
    TCP_EV_RETRANS = 1,
    TCP_EV_SYNACK_RETRANS = 2,
    TCP_EV_RST_OUT = 3,
    TCP_EV_RST_IN = 4,
};

enum sits_tcp_total { /* index of tcp_totals */
    TT_RETRANS = 0,      /* segments retransmitted, SYN-ACKs included (= TcpRetransSegs) */
    TT_RETRANS_FAIL = 1, /* retransmit attempts that failed (err != 0) */
    TT_SYNACK_RETRANS = 2,
    TT_RST_OUT = 3,
    TT_RST_IN = 4,
    TT_OPEN_ACTIVE = 5,  /* SYN_SENT -> ESTABLISHED */
    TT_OPEN_PASSIVE = 6, /* SYN_RECV -> ESTABLISHED */
    TT_CLOSE = 7,        /* an established connection reached CLOSE */
    TT_TIME_WAIT = 8,    /* entries into TIME_WAIT */
    TT_RTT_SAMPLES = 9,  /* tcp_probe hits */
    TT_EVENTS_UNSENT = 10, /* retransmits and resets not sent as records: over the rate */
    TT_MAX = 16,
};

/* a connection, seen from this host: local address/port first; ports in host order */
struct tcp_key {
    __u8 laddr[16];
    __u8 raddr[16];
    __u16 lport;
    __u16 rport;
};

struct tcp_conn {
    __u64 opened_ns;   /* reached ESTABLISHED; 0: before the agent or not yet */
    __u64 closed_ns;   /* reached CLOSE; 0 while open */
    __u64 retransmits; /* segments and SYN-ACKs retransmitted by this side */
    __u32 srtt_us;     /* last smoothed RTT (tcp_probe); 0: unknown */
    __u32 resets_in;
    __u32 resets_out;
    __u8 state;        /* last TCP state seen */
    __u8 active;       /* 1: this side connected */
    __u8 time_wait;    /* 1: entered TIME_WAIT when it closed */
    __u8 rst_pending;  /* a reset since the last state change: its CLOSE is no TIME_WAIT */
};

/* EV_TCP_EVENT: one retransmit or reset */
struct tcp_event {
    __u32 kind;
    __u32 state; /* socket state at the event; 0: no socket (RST to a closed port) */
    __u64 ts_ns;
    struct tcp_key key;
    __u8 type;   /* enum sits_tcp_ev */
    __u8 _pad;
    __u16 reason; /* RST sent: enum sk_rst_reason; 0 otherwise */
};

/* server side: the agent knows peer address/port and local port, this gives the local address */
struct tcp_peer_key {
    __u8 raddr[16];
    __u16 rport;
    __u16 lport;
};
struct tcp_addr {
    __u8 addr[16];
};

/* TIME_WAIT entries by port: the local port (side 0: this host accepted the connection), or
 * the peer's port (side 1: this host connected, from an ephemeral port; a client's connections
 * to one service share the peer's port) */
struct tw_key {
    __u16 port;
    __u8 side;
    __u8 _pad;
};

BPF_TABLE("lru_hash", struct tcp_key, struct tcp_conn, tcp_conns, SITS_MAX_CONNS);
BPF_TABLE("lru_hash", struct tcp_peer_key, struct tcp_addr, tcp_peers, SITS_MAX_CONNS);
/* traced client connection (tgid << 32 | fd) -> its 4-tuple, and the socket between
 * connect() (SYN_SENT, no local port yet) and ESTABLISHED */
BPF_TABLE("lru_hash", __u64, struct tcp_key, tcp_fd_conns, SITS_MAX_CONNS);
BPF_TABLE("lru_hash", __u64, __u64, tcp_sk_fd, 10240);
BPF_HASH(tcp_tw_ports, struct tw_key, __u64, 4096);
BPF_PERCPU_ARRAY(tcp_totals, __u64, TT_MAX);
/* this CPU's EV_TCP_EVENT records in the current second (ns >> 30) */
struct tcp_ev_rate_t {
    __u64 sec;
    __u64 n;
};
BPF_PERCPU_ARRAY(tcp_ev_rate, struct tcp_ev_rate_t, 1);
BPF_HISTOGRAM(tcp_lifetime_us, int, 64); /* log2 buckets of ESTABLISHED -> CLOSE */
#ifdef SITS_LAYOUT_CHECK
BPF_ARRAY(layout_tcp_event, struct tcp_event, 1); /* lets a test read BCC's view of the record */
#endif

static __always_inline void tcp_total(int idx)
{
    int i = idx;
    __u64 *v = tcp_totals.lookup(&i);
    if (v)
        (*v)++;
}

static __always_inline void v4mapped(__u8 *dst, const void *v4)
{
    dst[10] = 0xff;
    dst[11] = 0xff;
    bpf_probe_read_kernel(dst + 12, 4, v4);
}

/* from the saddr_v6/daddr_v6 fields (v4-mapped for IPv4 sockets) and host-order ports */
static __always_inline void key_from_v6(struct tcp_key *k, const void *s6, const void *d6,
                                        __u16 sport, __u16 dport)
{
    bpf_probe_read_kernel(k->laddr, 16, s6);
    bpf_probe_read_kernel(k->raddr, 16, d6);
    k->lport = sport;
    k->rport = dport;
}

/* from a struct sockaddr_in / sockaddr_in6 copied into the event (tcp_probe, tcp_send_reset) */
static __always_inline __u16 from_sockaddr(__u8 *addr, const void *sa)
{
    __u16 family = 0, port = 0;
    bpf_probe_read_kernel(&family, sizeof(family), sa);
    bpf_probe_read_kernel(&port, sizeof(port), sa + 2);
    if (family == AF_INET)
        v4mapped(addr, sa + 4);
    else if (family == AF_INET6)
        bpf_probe_read_kernel(addr, 16, sa + 8);
    return __builtin_bswap16(port);
}

static __always_inline void key_from_sockaddrs(struct tcp_key *k, const void *src, const void *dst)
{
    k->lport = from_sockaddr(k->laddr, src);
    k->rport = from_sockaddr(k->raddr, dst);
}

/* The counters of a connection. create: make them if missing, and start afresh when the entry
 * belongs to an earlier connection on the same 4-tuple (it closed). */
static __always_inline struct tcp_conn *conn_get(struct tcp_key *k, int create)
{
    struct tcp_conn *c = tcp_conns.lookup(k);
    if (c) {
        if (create && c->closed_ns)
            __builtin_memset(c, 0, sizeof(*c));
        return c;
    }
    if (!create)
        return 0;
    struct tcp_conn zero = {};
    tcp_conns.update(k, &zero);
    return tcp_conns.lookup(k);
}

/* room for one more record this second on this CPU? (per CPU: no atomics, no sharing) */
static __always_inline int tcp_ev_room(__u64 now)
{
    int zero = 0;
    struct tcp_ev_rate_t *r = tcp_ev_rate.lookup(&zero);
    if (!r)
        return 0;
    if (r->sec != now >> 30) {
        r->sec = now >> 30;
        r->n = 0;
    }
    if (r->n >= SITS_TCP_EVENTS_PER_S) {
        tcp_total(TT_EVENTS_UNSENT);
        return 0;
    }
    r->n++;
    return 1;
}

static __always_inline void emit_tcp(struct tcp_key *k, __u8 type, __u32 state, __u16 reason)
{
    __u64 now = bpf_ktime_get_ns();
    if (!tcp_ev_room(now))
        return;
    struct tcp_event ev = {};
    ev.kind = EV_TCP_EVENT;
    ev.state = state;
    ev.ts_ns = now;
    ev.key = *k;
    ev.type = type;
    ev.reason = reason;
    submit(&ev, sizeof(ev), EV_TCP_EVENT);
}

/* ---- retransmits ---- */

#ifndef SITS_NO_TCP_TCP_RETRANSMIT_SKB
TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)
{
#if SITS_TCP_RETRANS_ERR
    if (args->err) {
        tcp_total(TT_RETRANS_FAIL);
        return 0;
    }
#endif
    struct tcp_key k = {};
    key_from_v6(&k, args->saddr_v6, args->daddr_v6, args->sport, args->dport);
    struct tcp_conn *c = conn_get(&k, 1);
    if (c)
        c->retransmits++;
    tcp_total(TT_RETRANS);
    emit_tcp(&k, TCP_EV_RETRANS, args->state, 0);
    return 0;
}
#endif

#ifndef SITS_NO_TCP_TCP_RETRANSMIT_SYNACK
TRACEPOINT_PROBE(tcp, tcp_retransmit_synack)
{
    struct tcp_key k = {};
    key_from_v6(&k, args->saddr_v6, args->daddr_v6, args->sport, args->dport);
    struct tcp_conn *c = conn_get(&k, 1);
    if (c)
        c->retransmits++;
    tcp_total(TT_RETRANS);
    tcp_total(TT_SYNACK_RETRANS);
    emit_tcp(&k, TCP_EV_SYNACK_RETRANS, ST_SYN_RECV, 0);
    return 0;
}
#endif

/* ---- resets ---- */

#ifndef SITS_NO_TCP_TCP_SEND_RESET
TRACEPOINT_PROBE(tcp, tcp_send_reset)
{
    struct tcp_key k = {};
    __u16 reason = 0;
#if SITS_TCP_RST_SOCKADDR
    key_from_sockaddrs(&k, args->saddr, args->daddr);
#else
    key_from_v6(&k, args->saddr_v6, args->daddr_v6, args->sport, args->dport);
#endif
#if SITS_TCP_RST_REASON
    reason = (__u16)args->reason;
#endif
    __u32 state = args->state;
    /* no socket, a closed one (an abort sends its RST after CLOSE), a TIME_WAIT or a request
     * socket: count on what exists, create nothing */
    int live = state != 0 && state != ST_CLOSE && state != ST_TIME_WAIT &&
               state != ST_NEW_SYN_RECV;
    struct tcp_conn *c = conn_get(&k, live);
    if (c) {
        c->resets_out++;
        c->rst_pending = 1;
    }
    tcp_total(TT_RST_OUT);
    /* a reset from no live connection (no socket: a port nobody listens on; TIME_WAIT; a
     * request socket) is outside every span: counted, not sent. CLOSE is sent: an abort */
    if (live || state == ST_CLOSE)
        emit_tcp(&k, TCP_EV_RST_OUT, state, reason);
    return 0;
}
#endif

#ifndef SITS_NO_TCP_TCP_RECEIVE_RESET
TRACEPOINT_PROBE(tcp, tcp_receive_reset)
{
    struct tcp_key k = {};
    key_from_v6(&k, args->saddr_v6, args->daddr_v6, args->sport, args->dport);
    /* no entry: the connection was never established nor received a segment while we
     * watched (a connect() refused: SYN_SENT); outside every span, and a client retrying a
     * dead port would otherwise make an entry per attempt and push live ones out of the LRU;
     * an entry of a connection that closed is an earlier one on the same 4-tuple */
    struct tcp_conn *c = conn_get(&k, 0);
    tcp_total(TT_RST_IN);
    if (!c || c->closed_ns)
        return 0;
    c->resets_in++;
    c->rst_pending = 1;
    emit_tcp(&k, TCP_EV_RST_IN, c->state, 0);
    return 0;
}
#endif

/* ---- RTT ---- */

#ifndef SITS_NO_TCP_TCP_PROBE
TRACEPOINT_PROBE(tcp, tcp_probe)
{
#if SITS_RTT_SOCKS
    /* traced connections only, each at most once in SITS_SRTT_EVERY_JIFFIES: the agent reads
     * the value at most once a second a connection (agent/signals/tcp.py) */
    __u64 skaddr = (__u64)args->skaddr;
    __u32 hi = rtt_hint_index(skaddr);
    __u32 *hint = rtt_hints.lookup(&hi);
    if (!hint || !*hint)
        return 0; /* no traced socket in this bucket */
    __u64 *last = rtt_socks.lookup(&skaddr);
    if (!last)
        return 0;
    /* the jiffies counter, not the clock: a load, where a clock read was 40% of this
     * program's time on this VM (bench/prog_cost.py under perf) */
    __u64 now = bpf_jiffies64();
    if (*last && now - *last < SITS_SRTT_EVERY_JIFFIES)
        return 0;
    *last = now;
#endif
    struct tcp_key k = {};
    key_from_sockaddrs(&k, args->saddr, args->daddr);
    struct tcp_conn *c = conn_get(&k, 1);
    if (c) {
        c->srtt_us = args->srtt; /* tp->srtt_us >> 3: microseconds */
        if (!c->state)
            c->state = ST_ESTABLISHED;
    }
    tcp_total(TT_RTT_SAMPLES);
    return 0;
}
#endif

/* ---- states ---- */

static __always_inline void on_established(struct tcp_key *k, int old, __u64 skaddr)
{
    struct tcp_conn *c = conn_get(k, 1);
    if (!c)
        return;
    c->opened_ns = bpf_ktime_get_ns();
    c->state = ST_ESTABLISHED;
    c->rst_pending = 0;
    if (old == ST_SYN_SENT) {
        c->active = 1;
        tcp_total(TT_OPEN_ACTIVE);
        __u64 *ck = tcp_sk_fd.lookup(&skaddr);
        if (ck) {
            __u64 conn = *ck;
            tcp_fd_conns.update(&conn, k);
            tcp_sk_fd.delete(&skaddr);
        }
        return;
    }
    tcp_total(TT_OPEN_PASSIVE);
    struct tcp_peer_key pk = {};
    struct tcp_addr la = {};
    __builtin_memcpy(pk.raddr, k->raddr, 16);
    pk.rport = k->rport;
    pk.lport = k->lport;
    __builtin_memcpy(la.addr, k->laddr, 16);
    tcp_peers.update(&pk, &la);
}

static __always_inline void count_time_wait(struct tcp_key *k, struct tcp_conn *c)
{
    struct tw_key tk = {};
    /* the side that connected has an ephemeral local port: count it under the peer's port;
     * for a connection opened before the agent, judge by the ephemeral range */
    int by_peer = (c && c->opened_ns) ? c->active
                  : (k->lport >= SITS_EPHEMERAL_LO && k->lport <= SITS_EPHEMERAL_HI);
    tk.port = by_peer ? k->rport : k->lport;
    tk.side = by_peer ? 1 : 0;
    tcp_tw_ports.increment(tk);
    tcp_total(TT_TIME_WAIT);
}

static __always_inline void on_close(struct tcp_key *k, int old, __u64 skaddr)
{
    tcp_sk_fd.delete(&skaddr);
#if SITS_RTT_SOCKS
    if (rtt_socks.delete(&skaddr) == 0)
        rtt_hint(skaddr, 0);
#endif
    struct tcp_conn *c = conn_get(k, 0);
    /* FIN_WAIT2 or CLOSING -> CLOSE hands the connection to a TIME_WAIT socket, unless a
     * reset ended it */
    int tw = (old == ST_FIN_WAIT2 || old == ST_CLOSING) && !(c && c->rst_pending);
    if (tw)
        count_time_wait(k, c);
    if (!c)
        return;
    __u64 now = bpf_ktime_get_ns();
    c->closed_ns = now;
    c->state = ST_CLOSE;
    c->time_wait = tw;
    if (c->opened_ns) {
        tcp_total(TT_CLOSE);
        tcp_lifetime_us.increment(bpf_log2l((now - c->opened_ns) / 1000));
    }
}

#ifndef SITS_NO_SOCK_INET_SOCK_SET_STATE
TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    if (args->protocol != IPPROTO_TCP)
        return 0;
    int old = args->oldstate, st = args->newstate;
    __u64 skaddr = (__u64)args->skaddr;
    if (st == ST_SYN_SENT) {
        /* inside connect(): no local port yet; remember which traced fd this socket is */
        __u64 id = bpf_get_current_pid_tgid();
        struct connect_args *ca = connect_inflight.lookup(&id);
        if (ca) {
            __u64 conn = conn_key(id >> 32, ca->fd);
            tcp_sk_fd.update(&skaddr, &conn);
        }
        return 0;
    }
    if (old == ST_LISTEN || st == ST_LISTEN)
        return 0;
    struct tcp_key k = {};
    key_from_v6(&k, args->saddr_v6, args->daddr_v6, args->sport, args->dport);
    if (st == ST_ESTABLISHED) {
        on_established(&k, old, skaddr);
    } else if (st == ST_CLOSE) {
        on_close(&k, old, skaddr);
    } else {
        struct tcp_conn *c = conn_get(&k, 1);
        if (c) {
            c->state = st;
            c->rst_pending = 0;
        }
    }
    return 0;
}
#endif
