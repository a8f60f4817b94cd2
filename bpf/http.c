/* Plaintext socket I/O of traced processes, through syscall tracepoints.
 *
 * accept/accept4 and connect register a connection (tgid, fd) in `conns`;
 * read/readv/recvfrom/recvmsg and write/writev/sendto/sendmsg/sendfile on a
 * registered fd emit EV_DATA with up to SITS_MAX_PAYLOAD bytes of payload; close
 * emits EV_CONN_CLOSE. Reads and writes on any other fd cost one hash lookup.
 * Reads and writes are traced at their exit alone where the kernel lets a program
 * read the thread's saved registers (SITS_EXIT_ARGS), else at enter and exit.
 * No kernel struct is read (addresses come from the syscalls' own user
 * buffers), so the program needs no headers matching the running kernel.
 * While a thread is inside SSL_read/SSL_write (tls.c), the ciphertext it moves
 * is not emitted: tls.c emits the plaintext instead.
 */
#include "events.h"
#include "sockio.h"
#include "stream.h"
#include "fold.h"

#ifndef SITS_EXIT_ARGS
#define SITS_EXIT_ARGS 0 /* the agent sets 1 on x86-64 kernels with bpf_task_pt_regs (5.15) */
#endif

#ifndef SITS_MAX_IOV
#define SITS_MAX_IOV 32 /* node corks 4 iovecs a chunk; hyper writes up to 16 buffers */
#endif

static __always_inline void read_sockaddr(struct conn_event *ev, __u64 uaddr)
{
    __u16 family = 0;
    if (!uaddr)
        return;
    bpf_probe_read_user(&family, sizeof(family), (void *)uaddr);
    ev->family = family;
    if (family == AF_INET) {
        __u16 port = 0;
        bpf_probe_read_user(&port, sizeof(port), (void *)(uaddr + 2));
        ev->peer_port = __builtin_bswap16(port);
        bpf_probe_read_user(ev->peer_addr, 4, (void *)(uaddr + 4));
    } else if (family == AF_INET6) {
        __u16 port = 0;
        bpf_probe_read_user(&port, sizeof(port), (void *)(uaddr + 2));
        ev->peer_port = __builtin_bswap16(port);
        bpf_probe_read_user(ev->peer_addr, 16, (void *)(uaddr + 8));
    }
}

#ifdef SITS_SOCK_WALK
/* The struct socket behind a fd of the current task, walking task -> files -> fdtable ->
 * file -> private_data with offsets the agent read from the running kernel's BTF
 * (agent/capture/btf.py): no compiled-in struct layout. 0 when any step is missing. */
static __always_inline __u64 fd_socket(int fd)
{
    __u64 task = (__u64)bpf_get_current_task();
    __u64 files = 0, fdt = 0, fds = 0, file = 0, sock = 0;
    __u32 max_fds = 0;
    bpf_probe_read_kernel(&files, sizeof(files), (void *)(task + SITS_OFF_TASK_FILES));
    if (!files)
        return 0;
    bpf_probe_read_kernel(&fdt, sizeof(fdt), (void *)(files + SITS_OFF_FILES_FDT));
    if (!fdt)
        return 0;
    bpf_probe_read_kernel(&max_fds, sizeof(max_fds), (void *)(fdt + SITS_OFF_FDT_MAX_FDS));
    if (fd < 0 || (__u32)fd >= max_fds)
        return 0;
    bpf_probe_read_kernel(&fds, sizeof(fds), (void *)(fdt + SITS_OFF_FDT_FD));
    bpf_probe_read_kernel(&file, sizeof(file), (void *)(fds + (__u64)fd * 8));
    if (!file)
        return 0;
    bpf_probe_read_kernel(&sock, sizeof(sock), (void *)(file + SITS_OFF_FILE_PRIVATE));
    return sock;
}

/* the socket's type (SOCK_STREAM 1, SOCK_DGRAM 2, ...), 0 when unknown */
static __always_inline int sock_type(__u64 sock)
{
    __s16 type = 0;
    if (sock)
        bpf_probe_read_kernel(&type, sizeof(type), (void *)(sock + SITS_OFF_SOCKET_TYPE));
    return type;
}

/* Local port always; the peer too when the syscall's own buffer did not give it (accept4
 * with a NULL address, as libuv calls it). Read at the source, in the accepting or
 * connecting thread, so no later close or fd reuse can mix connections up. `sock`: the
 * fd's struct socket when the caller walked to it already (connect), else 0: walked here.
 * Returns the struct sock of an IPv4 or IPv6 socket, else 0. */
static __always_inline __u64 sock_addrs(struct conn_event *ev, int fd, __u64 sock)
{
    __u64 sk = 0;
    if (!sock)
        sock = fd_socket(fd);
    if (sock)
        bpf_probe_read_kernel(&sk, sizeof(sk), (void *)(sock + SITS_OFF_SOCKET_SK));
    if (!sk)
        return 0;
    __u16 family = 0, num = 0, dport = 0;
    bpf_probe_read_kernel(&family, sizeof(family), (void *)(sk + SITS_OFF_SKC_FAMILY));
    if (family != AF_INET && family != AF_INET6)
        return 0;
    bpf_probe_read_kernel(&num, sizeof(num), (void *)(sk + SITS_OFF_SKC_NUM));
    ev->local_port = num;
    if (ev->family)
        return sk;
    bpf_probe_read_kernel(&dport, sizeof(dport), (void *)(sk + SITS_OFF_SKC_DPORT));
    ev->peer_port = __builtin_bswap16(dport);
    ev->family = family;
    if (family == AF_INET)
        bpf_probe_read_kernel(ev->peer_addr, 4, (void *)(sk + SITS_OFF_SKC_DADDR));
    else
        bpf_probe_read_kernel(ev->peer_addr, 16, (void *)(sk + SITS_OFF_SKC_V6_DADDR));
    return sk;
}

/* the struct sock behind a fd of the current task, 0 when any step is missing */
static __always_inline __u64 fd_sk(int fd)
{
    __u64 sock = fd_socket(fd), sk = 0;
    if (sock)
        bpf_probe_read_kernel(&sk, sizeof(sk), (void *)(sock + SITS_OFF_SOCKET_SK));
    return sk;
}
#endif

/* returns the connection's struct sock (an open event's, where the fd table is walked), or 0 */
static __always_inline __u64 emit_conn(int kind, __u32 tgid, int fd, struct conn_state *st,
                                       __u64 uaddr, int listen_fd, __u64 sock)
{
    __u64 sk = 0;
    struct conn_event ev = {};
    ev.kind = kind;
    ev.tgid = tgid;
    ev.tid = (__u32)bpf_get_current_pid_tgid();
    ev.fd = fd;
    ev.listen_fd = listen_fd;
    ev.conn_id = st->conn_id;
    ev.ts_ns = bpf_ktime_get_ns();
    ev.bytes_in = st->bytes_in;
    ev.bytes_out = st->bytes_out;
    ev.role = st->role;
    ev.tls = st->tls;
    bpf_get_current_comm(&ev.comm, sizeof(ev.comm));
    read_sockaddr(&ev, uaddr);
#ifdef SITS_SOCK_WALK
    if (kind == EV_CONN_OPEN)
        sk = sock_addrs(&ev, fd, sock);
#endif
    submit(&ev, sizeof(ev), kind);
    return sk;
}

static __always_inline void register_conn(__u32 tgid, int fd, __u8 role, __u64 uaddr, int lfd,
                                          __u64 sock)
{
    struct conn_state st = {};
    __u64 key = conn_key(tgid, fd);
    st.conn_id = new_conn_id();
    st.role = role;
    /* the open event walks to the socket: its struct sock is tcp_probe's key (sockio.h) */
    rtt_sock_add(&st, emit_conn(EV_CONN_OPEN, tgid, fd, &st, uaddr, lfd, sock));
    conns.update(&key, &st);
    mark_conns(tgid, 1);
    sched_track(tgid);
}

/* ---- accept / accept4 ---- */

static __always_inline int on_accept_enter(int lfd, __u64 uaddr)
{
    __u64 id = bpf_get_current_pid_tgid();
    if (!traced_tgid(id >> 32))
        return 0;
    struct accept_args a = {.addr = uaddr, .listen_fd = lfd};
    accept_inflight.update(&id, &a);
    return 0;
}

static __always_inline int on_accept_exit(long ret)
{
    __u64 id = bpf_get_current_pid_tgid();
    struct accept_args *a = accept_inflight.lookup(&id);
    if (!a) {
        /* the thread was already blocked in accept() when the agent attached: trace the
         * connection anyway; the agent finds its addresses in /proc */
        if (ret >= 0 && traced_tgid(id >> 32))
            register_conn(id >> 32, (int)ret, ROLE_SERVER, 0, -1, 0);
        return 0;
    }
    if (ret >= 0)
        register_conn(id >> 32, (int)ret, ROLE_SERVER, a->addr, a->listen_fd, 0);
    accept_inflight.delete(&id);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_accept4)
{
    return on_accept_enter(args->fd, (__u64)args->upeer_sockaddr);
}

TRACEPOINT_PROBE(syscalls, sys_exit_accept4)
{
    return on_accept_exit(args->ret);
}

#ifndef SITS_NO_SYSCALLS_SYS_ENTER_ACCEPT
TRACEPOINT_PROBE(syscalls, sys_enter_accept)
{
    return on_accept_enter(args->fd, (__u64)args->upeer_sockaddr);
}
#endif

#ifndef SITS_NO_SYSCALLS_SYS_EXIT_ACCEPT
TRACEPOINT_PROBE(syscalls, sys_exit_accept)
{
    return on_accept_exit(args->ret);
}
#endif

/* ---- connect ---- */

TRACEPOINT_PROBE(syscalls, sys_enter_connect)
{
    __u64 id = bpf_get_current_pid_tgid();
    if (!traced_tgid(id >> 32))
        return 0;
    __u16 family = 0;
    bpf_probe_read_user(&family, sizeof(family), (void *)args->uservaddr);
    if (family != AF_INET && family != AF_INET6)
        return 0;
    struct connect_args c = {.addr = (__u64)args->uservaddr, .fd = args->fd};
    connect_inflight.update(&id, &c);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_connect)
{
    __u64 id = bpf_get_current_pid_tgid();
    struct connect_args *c = connect_inflight.lookup(&id);
    if (!c)
        return 0;
    /* non-blocking connect returns -EINPROGRESS (-115) and completes later */
    int stream = 1;
    __u64 sock = 0;
#ifdef SITS_SOCK_WALK
    /* a connected UDP socket (a resolver's query, a statsd client) carries no HTTP: each
     * lookup was a connection opened and closed and two records the parser could not use.
     * The socket found here is the one whose addresses the open event reads: one walk of
     * the fd table a connect, not two */
    sock = fd_socket(c->fd);
    int type = sock_type(sock);
    stream = type == 0 || type == 1; /* unknown, or SOCK_STREAM */
#endif
    if (stream && (args->ret == 0 || args->ret == -115))
        register_conn(id >> 32, c->fd, ROLE_CLIENT, c->addr, -1, sock);
    connect_inflight.delete(&id);
    return 0;
}

/* ---- close ---- */

TRACEPOINT_PROBE(syscalls, sys_enter_close)
{
    __u64 id = bpf_get_current_pid_tgid();
    __u32 tgid = id >> 32;
    __u64 key = conn_key(tgid, args->fd);
    struct conn_state *st = conns.lookup(&key);
    if (!st)
        return 0;
    if (st->ssl) {
        /* only a tie to this connection: its SSL may have been freed before the socket
         * closed, and the address already tied to a new connection */
        struct ssl_key sk = ssl_key_of(tgid, st->ssl);
        __u64 *tied = ssl_conns.lookup(&sk);
        if (tied && *tied == key)
            ssl_conns.delete(&sk);
    }
    if (st->fold)
        body_fold_flush(id, key, st);
    stream_end(key, st, STREAM_END_CLOSE);
    emit_conn(EV_CONN_CLOSE, tgid, args->fd, st, 0, -1, 0);
    conns.delete(&key);
    return 0;
}

/* ---- data ---- */

#if !SITS_EXIT_ARGS
static __always_inline int io_enter(int fd, __u64 buf, __u32 iovcnt, __u8 dir, __u8 src)
{
    __u64 id = bpf_get_current_pid_tgid();
    if (!has_conns(id >> 32))
        return 0;
    __u64 key = conn_key(id >> 32, fd);
    struct conn_state *st = conns.lookup(&key);
    if (!st)
        return 0;
    if (dir == 1 && st->fold)
        body_fold_flush(id, key, st); /* the response begins: the request's folded reads first */
    struct thread_io *t = thread_state(id, 1);
    if (!t)
        return 0;
    struct io_args io = {
        .buf = buf, .ts_ns = bpf_ktime_get_ns(), .conn = key, .iovcnt = iovcnt,
        .direction = dir, .source = src,
    };
    t->io = io;
    t->io_active = 1;
    return 0;
}
#endif

/* one iovec entry's bytes into ev->payload at *at (the running offset); 1 when the capture
 * is full and the walk stops */
static __always_inline int copy_entry(struct data_event *ev, volatile __u32 *at, __u64 base,
                                      __u64 len, __u64 total)
{
    __u64 off = *at;
    if (off >= total || off >= SITS_MAX_PAYLOAD)
        return 1;
    __u64 room = SITS_MAX_PAYLOAD - off;
    if (len > room)
        len = room;
    if (len > total - off)
        len = total - off;
    if (len == 0)
        return 0;
    __u64 o = off;
    __u64 n = len;
    /* keep the masks: the verifier must see both bounds at the call */
    asm volatile("%0 &= %1" : "+r"(o) : "i"(SITS_MAX_PAYLOAD - 1));
    asm volatile("%0 &= %1" : "+r"(n) : "i"(SITS_MAX_PAYLOAD - 1));
    if (n == 0) {
        /* len == SITS_MAX_PAYLOAD, only when off == 0: a first entry as long as the
         * capture or longer fills it (before, it was taken for a full buffer and
         * nothing was copied: node's writev of a long response lost its head) */
        bpf_probe_read_user(ev->payload, SITS_MAX_PAYLOAD, (void *)base);
        *at = SITS_MAX_PAYLOAD;
        return 1;
    }
    bpf_probe_read_user(ev->payload + o, n, (void *)base);
    *at = off + n;
    return 0;
}

/* copy up to SITS_MAX_PAYLOAD bytes from an iovec array into ev->payload */
static __always_inline __u64 copy_iov(struct data_event *ev, __u64 iov, __u32 iovcnt, __u64 total)
{
    /* the running offset lives in the record (a volatile load the verifier cannot follow):
     * each entry then starts from one state whatever the paths before it, where a register
     * offset with a range per path kept them apart (the readv/writev/sendmsg programs took
     * 780k of the verifier's 1M instructions) */
    volatile __u32 *at = &ev->captured;
    *at = 0;
    for (int i = 0; i < SITS_MAX_IOV; i += 2) {
        if (i >= iovcnt)
            break;
        /* two entries a read (struct iovec: base, len): nginx's head and body in one helper
         * call, not two (bench/prog_cost.py). When the count is odd the last read takes 16
         * bytes past the array, unused; should those fault, the entry is read alone. */
        __u64 ent[4] = {};
        if (bpf_probe_read_user(ent, sizeof(ent), (void *)(iov + i * 16)))
            bpf_probe_read_user(ent, 16, (void *)(iov + i * 16));
        if (copy_entry(ev, at, ent[0], ent[1], total) || i + 1 >= iovcnt ||
            copy_entry(ev, at, ent[2], ent[3], total))
            break;
    }
    return *at;
}

/* the last `n` bytes (at most SITS_TAIL_BYTES) of an iovec transfer of `total` bytes into
 * ev->payload, when the entry they end in holds them all (a writev of a response's head and
 * body: the body's end). Walks the entries' lengths to the one where `total` ends, so a
 * partial write sends the bytes it wrote, not the entry's end. 1 when read, 0 when not. */
static __always_inline int iov_tail(struct data_event *ev, __u64 iov, __u32 iovcnt, __u64 total,
                                    __u64 n)
{
    __u64 sum = 0;
    for (int i = 0; i < SITS_MAX_IOV; i++) {
        if (i >= iovcnt)
            break;
        __u64 ent[2] = {};
        bpf_probe_read_user(ent, sizeof(ent), (void *)(iov + i * 16));
        if (sum + ent[1] >= total) {
            __u64 inside = total - sum; /* this entry's bytes that were transferred */
            asm volatile("" : "+r"(n));
            if (inside < n || n > SITS_TAIL_BYTES)
                return 0;
            return bpf_probe_read_user(ev->payload, n, (void *)(ent[0] + inside - n)) == 0;
        }
        sum += ent[1];
    }
    return 0;
}

/* does the write start with a TLS record header (content type 20..23, version 3.x)? */
static __always_inline int tls_record_at(__u64 buf, __u32 iovcnt)
{
    __u64 p = buf;
    if (iovcnt)
        bpf_probe_read_user(&p, sizeof(p), (void *)buf); /* iov[0].iov_base */
    __u8 h[3] = {};
    if (!p || bpf_probe_read_user(h, sizeof(h), (void *)p))
        return 0;
    return h[0] >= 20 && h[0] <= 23 && h[1] == 3 && h[2] <= 4;
}

/* the first 16 bytes of a TLS read -> its connection, for tls.c's BIO_write. Only reads
 * of 16 bytes or more: past a shorter read the buffer holds stale bytes, and OpenSSL's
 * 5-byte header reads land in memory another thread's read just left (two ServerHellos
 * of one server share their first 5 bytes: a key of one connection's record header and
 * the other's stale bytes took the other's tie). Bytes two connections share (a
 * HelloRetryRequest's fixed random) name neither: the key is dropped. */
static __always_inline void note_prefix(struct read_prefix *k, __u64 conn)
{
    __u64 *have = read_prefixes.lookup(k);
    if (have) {
        if (*have != conn)
            read_prefixes.delete(k);
        return;
    }
    read_prefixes.update(k, &conn);
}

/* a read of a TLS connection tied to a memory BIO (handshake reads, before the tie, are
 * keyed from the copy made for user space below: plaintext reads pay no extra read) */
static __always_inline void note_read_prefix(__u64 conn, __u64 buf, __u32 iovcnt)
{
    __u64 p = buf;
    if (iovcnt)
        bpf_probe_read_user(&p, sizeof(p), (void *)buf); /* iov[0].iov_base */
    struct read_prefix k = {};
    if (bpf_probe_read_user(&k, sizeof(k), (void *)p))
        return;
    note_prefix(&k, conn);
}

/* Memory BIO without BIO_write (node's TLSWrap reads ciphertext straight into its BIO):
 * the ciphertext an SSL call produced (the handshake's reply, then every response) is
 * written out by the same thread right after the call returned, on the SSL*'s own socket.
 * An SSL* nothing tied yet is tied to that socket; each SSL call ties at most one write. */
static __always_inline void tie_written_ssl(struct thread_io *t, struct conn_state *st, __u64 conn)
{
    __u64 s = t->ssl.ssl;
    t->ssl.ssl = 0;
    /* only the ciphertext of an SSL_write: the last SSL call being a read (a handshake's
     * SSL_read that wanted more, of another client) says nothing of whose reply this is */
    if (t->ssl.direction != 1)
        return;
    struct ssl_key sk = ssl_key_of(conn >> 32, s);
    if (ssl_conns.lookup(&sk))
        return;
    ssl_conns.update(&sk, &conn);
    st->ssl = s;
    st->tls = 1;
}

/* `dir` and `vec` are constants of each exit tracepoint: the compiler drops the paths a
 * program cannot take (a read never folds a write, a plain read never walks an iovec),
 * which keeps each program's verification well inside the verifier's budget (one program
 * for all took 556k of its 1M instructions at 727277a) */
static __always_inline int io_done(__u64 id, long ret, struct io_args a, struct thread_io *t,
                                   struct conn_state *st, const __u8 dir, const int vec)
{
    if (dir == 0)
        st->bytes_in += ret;
    else
        st->bytes_out += ret;
#if SITS_RTT_SOCKS
    if (!st->sk_known) /* registered from user space (open before the agent): once */
        rtt_sock_add(st, fd_sk((int)(__u32)a.conn));
#endif
    if (t && t->ssl_active) {
        /* ciphertext under SSL_read/SSL_write: learn SSL* -> conn, emit nothing */
        __u64 s = t->ssl.ssl;
        struct ssl_key sk = ssl_key_of(id >> 32, s);
        ssl_conns.update(&sk, &a.conn);
        st->ssl = s;
        st->tls = 1;
        return 0;
    }
    if (dir == 0) {
        if (t) {
            t->last_read_conn = a.conn;
            t->last_read_len = (__u32)ret;
        }
    } else if (t && t->ssl.ssl && !st->tls && tls_record_at(a.buf, a.iovcnt)) {
        tie_written_ssl(t, st, a.conn);
    }
    if (st->tls) {
        /* a memory-BIO TLS connection: tls.c emits the plaintext */
        if (dir == 0 && ret >= (long)sizeof(struct read_prefix))
            note_read_prefix(a.conn, a.buf, a.iovcnt);
        return 0;
    }
    if (st->mute)
        return 0;
    int first = st->last_dir != dir + 1;
    if (dir == 0)
        stream_end(a.conn, st, STREAM_END_NEXT);
    if (!capture_exchange(id >> 32, st, dir, ret))
        return 0;
    __u64 now = bpf_ktime_get_ns();
#if SITS_EXIT_ARGS
    a.ts_ns = now; /* traced at the exit alone: the call's start is not seen */
#endif
    if (!dir && (st->tail & 1) && a.source != SRC_SENDFILE &&
        body_fold_add(id, a.conn, st, a.buf, ret, vec, a.ts_ns, now, a.source))
        return 0;
    /* plain writes may be folded; the iovec copy below never follows a fold attempt, which
     * keeps the verifier's paths through this program apart */
    if (dir == 1 && !vec && a.source != SRC_SENDFILE) {
        if (stream_write(id, a.conn, st, first, a.buf, ret, a.ts_ns, now, 0))
            return 0;
    } else if (dir == 1) {
        stream_cut(a.conn, st, first);
    }
    struct data_event *ev = data_event_init(id, st->conn_id, st->role);
    if (!ev)
        return 0;
    ev->flags = capture_flags(st);
    ev->fd = (__s32)(__u32)a.conn;
    ev->ts_enter_ns = a.ts_ns;
    ev->ts_exit_ns = now;
    ev->len = ret;
    ev->direction = dir;
    ev->source = a.source;
    __u64 captured = 0, split = 0;
    /* past a body's first SITS_BODY_HEAD bytes (events.h: the request's transfers, a server's
     * long writes of the response): the last bytes only, computed without branches (each
     * branch here multiplies the verifier's paths) */
    __u64 tail = st->tail & 1;
    ev->flags |= tail << 5; /* DATA_TAIL */
    if (a.source == SRC_SENDFILE) {
        captured = 0;
    } else if (vec) {
        if (!tail) {
            captured = copy_iov(ev, a.buf, a.iovcnt, ret);
            split = split_tail(st, dir, ret); /* a second record, when one entry holds it */
            ev->len = ret - split;
        } else if (dir == 1) {
            /* a long write past the body's head: its last bytes, when one entry holds them
             * (past the request's head, an iovec read sends its length only) */
            captured = iov_tail(ev, a.buf, a.iovcnt, ret, SITS_TAIL_BYTES) ? SITS_TAIL_BYTES : 0;
        }
    } else {
        __u64 cap = SITS_MAX_PAYLOAD - tail * (SITS_MAX_PAYLOAD - SITS_TAIL_BYTES);
        __u64 n = ret > cap ? cap : ret;
        asm volatile("" : "+r"(n));
        if (n > SITS_MAX_PAYLOAD)
            return 0;
        bpf_probe_read_user(ev->payload, n, (void *)(a.buf + tail * (ret - n)));
        captured = n;
        if (!tail) {
            split = split_tail(st, dir, ret);
            ev->len = ret - split;
        }
    }
    if (dir == 0 && captured >= sizeof(struct read_prefix) && !tail &&
        ev->payload[0] >= 20 && ev->payload[0] <= 23 && ev->payload[1] == 3) {
        /* a TLS record on a connection not tied yet (a handshake): for tls.c's BIO_write */
        struct read_prefix k = {};
        __builtin_memcpy(&k, ev->payload, sizeof(k));
        note_prefix(&k, a.conn);
    }
    if (emit_data(ev, captured) < 0)
        st->lost = 1; /* the next record of the connection carries DATA_LOST */
    if (split) {
        ev->flags = capture_flags(st);
        ev->len = split;
        __u64 n = split;
        asm volatile("" : "+r"(n));
        if (n > SITS_TAIL_BYTES)
            return 0;
        if (vec) /* not held by one entry: the length alone (uncaptured bytes) */
            n = iov_tail(ev, a.buf, a.iovcnt, ret, n) ? n : 0;
        else
            bpf_probe_read_user(ev->payload, n, (void *)(a.buf + ret - n));
        if (emit_data(ev, n) < 0)
            st->lost = 1;
    }
    return 0;
}

#define SITS_MSG_PEEK 2

#if SITS_EXIT_ARGS
/* Exit only: each read and write is one tracepoint, not two. An attached syscall
 * tracepoint costs every process on the node ~100 ns a call whether its program returns at
 * once or not (a load generator, a database beside the server), and the enter program was
 * there only to keep the arguments until the exit. They are still in the thread's saved
 * user registers when the syscall returns (x86-64: di, si, dx, r10; the return value goes
 * to ax): read there. The cost: a transfer's start is not seen, so its enter time is its
 * exit time (a write that blocked on a full socket buffer counts from when it returned). */
/* one of the thread's saved user registers (struct pt_regs, x86-64: r10 at 56, dx 96, si 104,
 * di 112). bpf_task_pt_regs gives a BTF pointer, which the verifier lets a program load from
 * directly (a fault-checked load): no helper call, where bpf_probe_read_kernel of the
 * registers was 6-10% of each read and write program (bench/prog_cost.py under perf). The
 * load is written in assembly so that no rewriter turns it into a probe read. */
#define REG_R10 56
#define REG_DX 96
#define REG_SI 104
#define REG_DI 112
static __always_inline __u64 user_reg(__u64 regs, const int off)
{
    __u64 v;
    asm volatile("%0 = *(u64 *)(%1 + %2)" : "=r"(v) : "r"(regs), "i"(off));
    return v;
}

static __always_inline __u64 user_regs(void)
{
    return (__u64)bpf_task_pt_regs(bpf_get_current_task_btf());
}

/* peek: the flags argument's bit for MSG_PEEK is checked (0: none); msg: `buf` is a msghdr */
static __always_inline int io_exit(long ret, const __u8 dir, const int vec, const __u8 src,
                                   const int peek_in_r10, const int peek_in_dx, const int msg)
{
    if (ret <= 0)
        return 0;
    __u64 id = bpf_get_current_pid_tgid();
    if (!has_conns(id >> 32))
        return 0;
    __u64 regs = user_regs();
    if (!regs)
        return 0;
    __u64 key = conn_key(id >> 32, (int)user_reg(regs, REG_DI));
    struct conn_state *st = conns.lookup(&key);
    if (!st)
        return 0;
    if ((peek_in_r10 && (user_reg(regs, REG_R10) & SITS_MSG_PEEK)) ||
        (peek_in_dx && (user_reg(regs, REG_DX) & SITS_MSG_PEEK)))
        return 0;
    __u64 si = user_reg(regs, REG_SI);
    struct io_args a = {
        .buf = si, .conn = key,  /* ts_ns: io_done's one clock read */
        .iovcnt = vec ? (__u32)user_reg(regs, REG_DX) : 0, .direction = dir, .source = src,
    };
    if (src == SRC_SENDFILE)
        a.buf = 0;
    if (msg) {
        /* msghdr: msg_iov at offset 16, msg_iovlen at 24 */
        __u64 iov = 0, iovlen = 0;
        if (!si)
            return 0;
        bpf_probe_read_user(&iov, sizeof(iov), (void *)(si + 16));
        bpf_probe_read_user(&iovlen, sizeof(iovlen), (void *)(si + 24));
        if (!iov || !iovlen)
            return 0;
        a.buf = iov;
        a.iovcnt = (__u32)iovlen;
    }
    if (dir == 1 && st->fold)
        body_fold_flush(id, key, st); /* the response: the request's folded reads first */
    return io_done(id, ret, a, thread_state(id, dir == 0), st, dir, vec);
}

TRACEPOINT_PROBE(syscalls, sys_exit_read) { return io_exit(args->ret, 0, 0, SRC_SYSCALL, 0, 0, 0); }
/* a MSG_PEEK read is read again for real later (nginx peeks one byte to tell TLS from
 * plaintext): sending it would hand the parser those bytes twice */
TRACEPOINT_PROBE(syscalls, sys_exit_recvfrom) { return io_exit(args->ret, 0, 0, SRC_SYSCALL, 1, 0, 0); }
#ifndef SITS_NO_SYSCALLS_SYS_EXIT_READV
TRACEPOINT_PROBE(syscalls, sys_exit_readv) { return io_exit(args->ret, 0, 1, SRC_SYSCALL, 0, 0, 0); }
#endif
TRACEPOINT_PROBE(syscalls, sys_exit_write) { return io_exit(args->ret, 1, 0, SRC_SYSCALL, 0, 0, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_sendto) { return io_exit(args->ret, 1, 0, SRC_SYSCALL, 0, 0, 0); }
#ifndef SITS_NO_SYSCALLS_SYS_EXIT_WRITEV
TRACEPOINT_PROBE(syscalls, sys_exit_writev) { return io_exit(args->ret, 1, 1, SRC_SYSCALL, 0, 0, 0); }
#endif
#ifndef SITS_NO_SYSCALLS_SYS_EXIT_SENDFILE64
TRACEPOINT_PROBE(syscalls, sys_exit_sendfile64) { return io_exit(args->ret, 1, 0, SRC_SENDFILE, 0, 0, 0); }
#endif
#ifndef SITS_NO_SYSCALLS_SYS_EXIT_RECVMSG
TRACEPOINT_PROBE(syscalls, sys_exit_recvmsg) { return io_exit(args->ret, 0, 1, SRC_SYSCALL, 0, 1, 1); }
#endif
#ifndef SITS_NO_SYSCALLS_SYS_EXIT_SENDMSG
TRACEPOINT_PROBE(syscalls, sys_exit_sendmsg) { return io_exit(args->ret, 1, 1, SRC_SYSCALL, 0, 0, 1); }
#endif

#else /* !SITS_EXIT_ARGS: the arguments kept from the enter tracepoint to the exit */

static __always_inline int io_exit(long ret, const __u8 dir, const int vec)
{
    __u64 id = bpf_get_current_pid_tgid();
    if (!has_conns(id >> 32))
        return 0;
    struct thread_io *t = thread_state(id, 0);
    if (!t || !t->io_active)
        return 0;
    struct io_args a = t->io;
    t->io_active = 0;
    if (ret <= 0 || a.direction != dir || (!vec && a.iovcnt))
        return 0; /* an enter this exit does not belong to (probes attached mid-call) */
    struct conn_state *st = conns.lookup(&a.conn);
    if (!st)
        return 0;
    return io_done(id, ret, a, t, st, dir, vec);
}

TRACEPOINT_PROBE(syscalls, sys_enter_read)
{
    return io_enter(args->fd, (__u64)args->buf, 0, 0, SRC_SYSCALL);
}
TRACEPOINT_PROBE(syscalls, sys_exit_read) { return io_exit(args->ret, 0, 0); }

/* a MSG_PEEK read is read again for real later (nginx peeks one byte to tell TLS from
 * plaintext): sending it would hand the parser those bytes twice */
TRACEPOINT_PROBE(syscalls, sys_enter_recvfrom)
{
    if (args->flags & SITS_MSG_PEEK)
        return 0;
    return io_enter(args->fd, (__u64)args->ubuf, 0, 0, SRC_SYSCALL);
}
TRACEPOINT_PROBE(syscalls, sys_exit_recvfrom) { return io_exit(args->ret, 0, 0); }

#ifndef SITS_NO_SYSCALLS_SYS_ENTER_READV
TRACEPOINT_PROBE(syscalls, sys_enter_readv)
{
    return io_enter(args->fd, (__u64)args->vec, args->vlen, 0, SRC_SYSCALL);
}
#endif
#ifndef SITS_NO_SYSCALLS_SYS_EXIT_READV
TRACEPOINT_PROBE(syscalls, sys_exit_readv) { return io_exit(args->ret, 0, 1); }
#endif

TRACEPOINT_PROBE(syscalls, sys_enter_write)
{
    return io_enter(args->fd, (__u64)args->buf, 0, 1, SRC_SYSCALL);
}
TRACEPOINT_PROBE(syscalls, sys_exit_write) { return io_exit(args->ret, 1, 0); }

TRACEPOINT_PROBE(syscalls, sys_enter_sendto)
{
    return io_enter(args->fd, (__u64)args->buff, 0, 1, SRC_SYSCALL);
}
TRACEPOINT_PROBE(syscalls, sys_exit_sendto) { return io_exit(args->ret, 1, 0); }

#ifndef SITS_NO_SYSCALLS_SYS_ENTER_WRITEV
TRACEPOINT_PROBE(syscalls, sys_enter_writev)
{
    return io_enter(args->fd, (__u64)args->vec, args->vlen, 1, SRC_SYSCALL);
}
#endif
#ifndef SITS_NO_SYSCALLS_SYS_EXIT_WRITEV
TRACEPOINT_PROBE(syscalls, sys_exit_writev) { return io_exit(args->ret, 1, 1); }
#endif

#ifndef SITS_NO_SYSCALLS_SYS_ENTER_SENDFILE64
TRACEPOINT_PROBE(syscalls, sys_enter_sendfile64)
{
    return io_enter(args->out_fd, 0, 0, 1, SRC_SENDFILE);
}
#endif
#ifndef SITS_NO_SYSCALLS_SYS_EXIT_SENDFILE64
TRACEPOINT_PROBE(syscalls, sys_exit_sendfile64) { return io_exit(args->ret, 1, 0); }
#endif

/* msghdr: msg_iov at offset 16, msg_iovlen at 24 (x86-64 and arm64 alike) */
static __always_inline int msg_enter(int fd, __u64 msg, __u8 dir)
{
    __u64 iov = 0, iovlen = 0;
    if (!msg)
        return 0;
    bpf_probe_read_user(&iov, sizeof(iov), (void *)(msg + 16));
    bpf_probe_read_user(&iovlen, sizeof(iovlen), (void *)(msg + 24));
    if (!iov || !iovlen)
        return 0;
    return io_enter(fd, iov, (__u32)iovlen, dir, SRC_SYSCALL);
}

#ifndef SITS_NO_SYSCALLS_SYS_ENTER_RECVMSG
TRACEPOINT_PROBE(syscalls, sys_enter_recvmsg)
{
    if (args->flags & SITS_MSG_PEEK)
        return 0;
    return msg_enter(args->fd, (__u64)args->msg, 0);
}
#endif
#ifndef SITS_NO_SYSCALLS_SYS_EXIT_RECVMSG
TRACEPOINT_PROBE(syscalls, sys_exit_recvmsg) { return io_exit(args->ret, 0, 1); }
#endif

#ifndef SITS_NO_SYSCALLS_SYS_ENTER_SENDMSG
TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg)
{
    return msg_enter(args->fd, (__u64)args->msg, 1);
}
#endif
#ifndef SITS_NO_SYSCALLS_SYS_EXIT_SENDMSG
TRACEPOINT_PROBE(syscalls, sys_exit_sendmsg) { return io_exit(args->ret, 1, 1); }
#endif

#endif /* SITS_EXIT_ARGS */

/* ---- processes: exec (new libraries to probe) and exit (forget state) ---- */

static __always_inline void emit_proc(int kind)
{
    struct proc_event ev = {};
    __u64 id = bpf_get_current_pid_tgid();
    ev.kind = kind;
    ev.tgid = id >> 32;
    ev.ts_ns = bpf_ktime_get_ns();
    bpf_get_current_comm(&ev.comm, sizeof(ev.comm));
    if (kind == EV_PROC_EXEC && traced_tgid(ev.tgid)) {
        /* the reader is woken now, not at its next interval (trace.poll_ms): the agent
         * looks for OpenSSL in the new program, whose first connections can come within
         * ~100 ms of the exec (node listens that soon); execs are rare enough to wake for */
        count_seen(kind);
        if (events.ringbuf_output(&ev, sizeof(ev), BPF_RB_FORCE_WAKEUP) < 0)
            count_lost(kind);
        return;
    }
    submit(&ev, sizeof(ev), kind);
}

#ifndef SITS_NO_SCHED_SCHED_PROCESS_EXEC
TRACEPOINT_PROBE(sched, sched_process_exec)
{
    emit_proc(EV_PROC_EXEC);
    return 0;
}
#endif

#ifndef SITS_NO_SCHED_SCHED_PROCESS_EXIT
TRACEPOINT_PROBE(sched, sched_process_exit)
{
    __u64 id = bpf_get_current_pid_tgid();
#if SITS_FILTER_PIDS
    __u32 task = (__u32)id;
    target_pids.delete(&task); /* the entry fork added: the table holds live tasks only */
#endif
    if ((__u32)id != (id >> 32))
        return 0; /* a thread, not the process */
    mark_conns(id >> 32, 0);
    emit_proc(EV_PROC_EXIT);
    return 0;
}
#endif

#ifndef SITS_NO_SCHED_SCHED_PROCESS_FORK
/* --pid follows children: a traced process's new child is traced too */
TRACEPOINT_PROBE(sched, sched_process_fork)
{
#if SITS_FILTER_PIDS
    /* the forking task's process, not args->parent_pid (the forking thread's id) */
    __u32 parent = bpf_get_current_pid_tgid() >> 32, child = args->child_pid;
    __u8 one = 1;
    if (target_pids.lookup(&parent))
        target_pids.update(&child, &one);
#endif
    return 0;
}
#endif
