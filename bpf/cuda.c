/* CUDA driver activity of traced processes, through uprobes on libcuda.so (the driver API that
 * the CUDA runtime, PyTorch, JAX and CuPy all end in).
 *
 * launches   cuLaunchKernel, cuLaunchKernelEx, cuGraphLaunch (+ _ptsz): entry only, counted
 * copies     cuMemcpy{HtoD,DtoH,DtoD}_v2, cuMemcpy (+ _ptds), their Async forms and cuMemcpyAsync
 *            (+ _ptsz): entry + return; bytes by direction, and one EV_CUDA_COPY record each
 *            (pointers, stream, enqueue/copy time) so the agent can place a copy in a span's
 *            window and resolve the direction of cuMemcpy/cuMemcpyAsync (not in their args)
 * syncs      cuStreamSynchronize (+ _ptsz), cuCtxSynchronize, cuEventSynchronize: entry +
 *            return; the wait is return - entry
 * memory     cuMemAlloc_v2, cuMemAllocAsync, cuMemAllocManaged, cuMemHostAlloc,
 *            cuMemAllocHost_v2, cuMemHostRegister_v2, cuMemMap and their frees: one EV_CUDA_MEM
 *            record each (rare: allocators cache), the address ranges for that resolution
 * cuInit     one EV_CUDA_INIT record: from then on the agent has seen every allocation
 *
 * Kept in the kernel: per process totals in `cuda_procs`, and launches and sync waits per
 * time slot of 2^SITS_CUDA_SLOT_SHIFT ns in `cuda_slots` (LRU; the agent drains finished slots)
 * so a span can count those of its own window without a record per launch. Cost: one
 * uprobe (~1-3 us) per launch plus two hash updates; copies, syncs and allocations add a
 * uretprobe and one record. Requires events.h only.
 */
#include "events.h"

#ifndef SITS_CUDA_SLOT_SHIFT
#define SITS_CUDA_SLOT_SHIFT 20 /* 1.05 ms slots */
#endif
#ifndef SITS_CUDA_SLOTS
#define SITS_CUDA_SLOTS 65536
#endif
#ifndef SITS_CUDA_PROCS
#define SITS_CUDA_PROCS 4096
#endif

enum cuda_dir { CD_UNKNOWN = 0, CD_H2D = 1, CD_D2H = 2, CD_D2D = 3 };

/* which entry point a call came through (EV_CUDA_COPY.api, EV_CUDA_MEM.api) */
enum cuda_api {
    CA_MEMCPY_HTOD = 1, CA_MEMCPY_DTOH, CA_MEMCPY_DTOD, CA_MEMCPY,
    CA_MEMCPY_HTOD_ASYNC, CA_MEMCPY_DTOH_ASYNC, CA_MEMCPY_DTOD_ASYNC, CA_MEMCPY_ASYNC,
    CA_STREAM_SYNC = 16, CA_CTX_SYNC, CA_EVENT_SYNC,
    CA_MEM_ALLOC = 32, CA_MEM_ALLOC_ASYNC, CA_MEM_ALLOC_MANAGED, CA_MEM_HOST_ALLOC,
    CA_MEM_ALLOC_HOST, CA_MEM_HOST_REGISTER, CA_MEM_MAP,
    CA_MEM_FREE = 48, CA_MEM_FREE_ASYNC, CA_MEM_FREE_HOST, CA_MEM_HOST_UNREGISTER, CA_MEM_UNMAP,
};

enum cuda_mem_kind { CM_DEVICE = 1, CM_HOST = 2, CM_MANAGED = 3, CM_REGISTERED = 4, CM_MAPPED = 5 };
enum cuda_mem_op { CMO_ALLOC = 1, CMO_FREE = 2 };

/* EV_CUDA_COPY: one host<->device or device<->device copy that returned CUDA_SUCCESS */
struct cuda_copy_event {
    __u32 kind;
    __u32 tgid;
    __u64 ts_enter_ns;
    __u64 ts_exit_ns; /* async: enqueued; sync: copied */
    __u64 bytes;
    __u64 dst;
    __u64 src;
    __u64 stream; /* 0: the legacy default stream (or a sync copy) */
    __u32 tid;
    __s32 result;
    __u8 direction; /* enum cuda_dir, as far as the arguments say */
    __u8 api;       /* enum cuda_api */
    __u8 is_async;
    __u8 _pad[5];
};

/* EV_CUDA_MEM: an allocation or free (ptr 0 when an allocation failed: not sent) */
struct cuda_mem_event {
    __u32 kind;
    __u32 tgid;
    __u64 ts_ns;
    __u64 ptr;
    __u64 bytes; /* 0 for frees but cuMemUnmap */
    __u32 tid;
    __s32 result;
    __u8 op;  /* enum cuda_mem_op */
    __u8 mem; /* enum cuda_mem_kind */
    __u8 api;
    __u8 _pad[5];
};

/* EV_CUDA_INIT: cuInit was called */
struct cuda_init_event {
    __u32 kind;
    __u32 tgid;
    __u64 ts_ns;
    __u32 tid;
    __u32 _pad;
};

/* per process totals since the agent started */
struct cuda_proc {
    __u64 launches;       /* cuLaunchKernel* calls */
    __u64 graph_launches; /* cuGraphLaunch calls */
    __u64 h2d_bytes;
    __u64 h2d_copies;
    __u64 d2h_bytes;
    __u64 d2h_copies;
    __u64 d2d_bytes;
    __u64 d2d_copies;
    __u64 other_bytes; /* cuMemcpy / cuMemcpyAsync: direction not in the arguments */
    __u64 other_copies;
    __u64 copy_call_ns; /* time inside copy calls (sync copies: the copy itself) */
    __u64 sync_ns;      /* time inside cu*Synchronize */
    __u64 syncs;
    __u64 failed; /* copy/sync/alloc calls that did not return CUDA_SUCCESS */
};

struct cuda_slot_key {
    __u64 slot; /* bpf_ktime_get_ns() >> SITS_CUDA_SLOT_SHIFT */
    __u32 tgid;
    __u32 _pad;
};

/* launches and sync waits of one process in one slot (a wait goes to the slot it ended in);
 * first_ns/last_ns bound the slot's activity so a window that holds all of it counts all of
 * it (updated without atomics: a concurrent CPU may leave them a little narrow) */
struct cuda_slot {
    __u64 launches;
    __u64 graph_launches;
    __u64 syncs;
    __u64 sync_ns;
    __u64 first_ns;
    __u64 last_ns;
};

/* a copy, sync or allocation call in progress on a thread */
struct cuda_call {
    __u64 ts_ns;
    __u64 a0;
    __u64 a1;
    __u64 a2;
    __u64 a3;
    __u32 api;
    __u32 _pad;
};

BPF_HASH(cuda_procs, __u32, struct cuda_proc, SITS_CUDA_PROCS);
BPF_TABLE("lru_hash", struct cuda_slot_key, struct cuda_slot, cuda_slots, SITS_CUDA_SLOTS);
BPF_HASH(cuda_calls, __u64, struct cuda_call, 10240);
#ifdef SITS_LAYOUT_CHECK
BPF_ARRAY(layout_cuda_copy, struct cuda_copy_event, 1);
BPF_ARRAY(layout_cuda_mem, struct cuda_mem_event, 1);
BPF_ARRAY(layout_cuda_init, struct cuda_init_event, 1);
#endif

static __always_inline struct cuda_proc *cuda_proc_of(__u32 tgid)
{
    struct cuda_proc zero = {};
    return cuda_procs.lookup_or_try_init(&tgid, &zero);
}

static __always_inline struct cuda_slot *cuda_slot_of(__u32 tgid, __u64 ts)
{
    struct cuda_slot_key k = {};
    struct cuda_slot zero = {};
    k.slot = ts >> SITS_CUDA_SLOT_SHIFT;
    k.tgid = tgid;
    zero.first_ns = ts;
    struct cuda_slot *s = cuda_slots.lookup_or_try_init(&k, &zero);
    if (s) {
        if (ts < s->first_ns)
            s->first_ns = ts;
        if (ts > s->last_ns)
            s->last_ns = ts;
    }
    return s;
}

/* ---- launches: entry only ---- */

static __always_inline int on_launch(int graph)
{
    __u64 id = bpf_get_current_pid_tgid();
    __u32 tgid = id >> 32;
    if (!traced_tgid(tgid))
        return 0;
    struct cuda_proc *p = cuda_proc_of(tgid);
    struct cuda_slot *s = cuda_slot_of(tgid, bpf_ktime_get_ns());
    if (graph) {
        if (p)
            __sync_fetch_and_add(&p->graph_launches, 1);
        if (s)
            __sync_fetch_and_add(&s->graph_launches, 1);
    } else {
        if (p)
            __sync_fetch_and_add(&p->launches, 1);
        if (s)
            __sync_fetch_and_add(&s->launches, 1);
    }
    return 0;
}

int sits_cuda_launch(struct pt_regs *ctx) { return on_launch(0); }
int sits_cuda_graph_launch(struct pt_regs *ctx) { return on_launch(1); }

/* ---- calls with a return: remember the arguments on entry ---- */

static __always_inline int call_enter(struct pt_regs *ctx, __u32 api)
{
    __u64 id = bpf_get_current_pid_tgid();
    if (!traced_tgid(id >> 32))
        return 0;
    struct cuda_call c = {};
    c.ts_ns = bpf_ktime_get_ns();
    c.a0 = PT_REGS_PARM1(ctx);
    c.a1 = PT_REGS_PARM2(ctx);
    c.a2 = PT_REGS_PARM3(ctx);
    c.a3 = PT_REGS_PARM4(ctx);
    c.api = api;
    cuda_calls.update(&id, &c);
    return 0;
}

static __always_inline __u8 copy_direction(__u32 api)
{
    switch (api) {
    case CA_MEMCPY_HTOD:
    case CA_MEMCPY_HTOD_ASYNC:
        return CD_H2D;
    case CA_MEMCPY_DTOH:
    case CA_MEMCPY_DTOH_ASYNC:
        return CD_D2H;
    case CA_MEMCPY_DTOD:
    case CA_MEMCPY_DTOD_ASYNC:
        return CD_D2D;
    }
    return CD_UNKNOWN;
}

static __always_inline void count_copy(struct cuda_proc *p, __u8 dir, __u64 bytes, __u64 ns)
{
    __sync_fetch_and_add(&p->copy_call_ns, ns);
    if (dir == CD_H2D) {
        __sync_fetch_and_add(&p->h2d_bytes, bytes);
        __sync_fetch_and_add(&p->h2d_copies, 1);
    } else if (dir == CD_D2H) {
        __sync_fetch_and_add(&p->d2h_bytes, bytes);
        __sync_fetch_and_add(&p->d2h_copies, 1);
    } else if (dir == CD_D2D) {
        __sync_fetch_and_add(&p->d2d_bytes, bytes);
        __sync_fetch_and_add(&p->d2d_copies, 1);
    } else {
        __sync_fetch_and_add(&p->other_bytes, bytes);
        __sync_fetch_and_add(&p->other_copies, 1);
    }
}

/* every copy entry point takes (dst, src, bytes[, stream]) */
static __always_inline void copy_exit(struct cuda_call *c, __u64 id, __u64 now, int rc,
                                      struct cuda_proc *p)
{
    __u8 dir = copy_direction(c->api);
    if (rc != 0) {
        if (p)
            __sync_fetch_and_add(&p->failed, 1);
        return;
    }
    if (p)
        count_copy(p, dir, c->a2, now - c->ts_ns);
    struct cuda_copy_event ev = {};
    ev.kind = EV_CUDA_COPY;
    ev.tgid = id >> 32;
    ev.tid = (__u32)id;
    ev.ts_enter_ns = c->ts_ns;
    ev.ts_exit_ns = now;
    ev.dst = c->a0;
    ev.src = c->a1;
    ev.bytes = c->a2;
    ev.is_async = c->api >= CA_MEMCPY_HTOD_ASYNC;
    ev.stream = ev.is_async ? c->a3 : 0;
    ev.direction = dir;
    ev.api = c->api;
    submit(&ev, sizeof(ev), EV_CUDA_COPY);
}

static __always_inline void sync_exit(struct cuda_call *c, __u32 tgid, __u64 now, int rc,
                                      struct cuda_proc *p)
{
    __u64 ns = now - c->ts_ns;
    if (p) {
        __sync_fetch_and_add(&p->sync_ns, ns);
        __sync_fetch_and_add(&p->syncs, 1);
        if (rc != 0)
            __sync_fetch_and_add(&p->failed, 1);
    }
    struct cuda_slot *s = cuda_slot_of(tgid, now);
    if (s) {
        __sync_fetch_and_add(&s->sync_ns, ns);
        __sync_fetch_and_add(&s->syncs, 1);
    }
}

static __always_inline void emit_mem(__u64 id, __u64 ts, __u64 ptr, __u64 bytes, int rc,
                                     __u8 op, __u8 mem, __u32 api)
{
    struct cuda_mem_event ev = {};
    ev.kind = EV_CUDA_MEM;
    ev.tgid = id >> 32;
    ev.tid = (__u32)id;
    ev.ts_ns = ts;
    ev.ptr = ptr;
    ev.bytes = bytes;
    ev.result = rc;
    ev.op = op;
    ev.mem = mem;
    ev.api = api;
    submit(&ev, sizeof(ev), EV_CUDA_MEM);
}

/* allocations return the address through their first argument; frees name it */
static __always_inline void mem_exit(struct cuda_call *c, __u64 id, __u64 now, int rc,
                                     struct cuda_proc *p)
{
    __u64 ptr = 0, bytes = c->a1;
    __u8 mem = CM_DEVICE, op = CMO_ALLOC;
    if (rc != 0 && p)
        __sync_fetch_and_add(&p->failed, 1);
    switch (c->api) {
    case CA_MEM_ALLOC_MANAGED:
        mem = CM_MANAGED;
        break;
    case CA_MEM_HOST_ALLOC:
    case CA_MEM_ALLOC_HOST:
        mem = CM_HOST;
        break;
    case CA_MEM_HOST_REGISTER:
        mem = CM_REGISTERED;
        ptr = c->a0;
        break;
    case CA_MEM_MAP: /* cuMemMap(ptr, size, offset, handle, flags) */
        mem = CM_MAPPED;
        ptr = c->a0;
        break;
    case CA_MEM_FREE:
    case CA_MEM_FREE_ASYNC:
        op = CMO_FREE;
        ptr = c->a0;
        bytes = 0;
        break;
    case CA_MEM_FREE_HOST:
    case CA_MEM_HOST_UNREGISTER:
        op = CMO_FREE;
        mem = CM_HOST;
        ptr = c->a0;
        bytes = 0;
        break;
    case CA_MEM_UNMAP:
        op = CMO_FREE;
        mem = CM_MAPPED;
        ptr = c->a0;
        break;
    }
    if (rc != 0)
        return;
    if (op == CMO_ALLOC && !ptr)
        bpf_probe_read_user(&ptr, sizeof(ptr), (void *)c->a0); /* CUdeviceptr* / void** */
    if (!ptr)
        return;
    emit_mem(id, now, ptr, bytes, rc, op, mem, c->api);
}

int sits_cuda_call_exit(struct pt_regs *ctx)
{
    __u64 id = bpf_get_current_pid_tgid();
    struct cuda_call *cp = cuda_calls.lookup(&id);
    if (!cp)
        return 0;
    struct cuda_call c = *cp;
    cuda_calls.delete(&id);
    __u64 now = bpf_ktime_get_ns();
    int rc = (int)PT_REGS_RC(ctx);
    __u32 tgid = id >> 32;
    struct cuda_proc *p = cuda_proc_of(tgid);
    if (c.api < CA_STREAM_SYNC)
        copy_exit(&c, id, now, rc, p);
    else if (c.api < CA_MEM_ALLOC)
        sync_exit(&c, tgid, now, rc, p);
    else
        mem_exit(&c, id, now, rc, p);
    return 0;
}

#define CUDA_CALL(name, api) \
    int sits_cuda_##name(struct pt_regs *ctx) { return call_enter(ctx, api); }

CUDA_CALL(memcpy_htod, CA_MEMCPY_HTOD)
CUDA_CALL(memcpy_dtoh, CA_MEMCPY_DTOH)
CUDA_CALL(memcpy_dtod, CA_MEMCPY_DTOD)
CUDA_CALL(memcpy, CA_MEMCPY)
CUDA_CALL(memcpy_htod_async, CA_MEMCPY_HTOD_ASYNC)
CUDA_CALL(memcpy_dtoh_async, CA_MEMCPY_DTOH_ASYNC)
CUDA_CALL(memcpy_dtod_async, CA_MEMCPY_DTOD_ASYNC)
CUDA_CALL(memcpy_async, CA_MEMCPY_ASYNC)
CUDA_CALL(stream_sync, CA_STREAM_SYNC)
CUDA_CALL(ctx_sync, CA_CTX_SYNC)
CUDA_CALL(event_sync, CA_EVENT_SYNC)
CUDA_CALL(mem_alloc, CA_MEM_ALLOC)
CUDA_CALL(mem_alloc_async, CA_MEM_ALLOC_ASYNC)
CUDA_CALL(mem_alloc_managed, CA_MEM_ALLOC_MANAGED)
CUDA_CALL(mem_host_alloc, CA_MEM_HOST_ALLOC)
CUDA_CALL(mem_alloc_host, CA_MEM_ALLOC_HOST)
CUDA_CALL(mem_host_register, CA_MEM_HOST_REGISTER)
CUDA_CALL(mem_map, CA_MEM_MAP)
CUDA_CALL(mem_free, CA_MEM_FREE)
CUDA_CALL(mem_free_async, CA_MEM_FREE_ASYNC)
CUDA_CALL(mem_free_host, CA_MEM_FREE_HOST)
CUDA_CALL(mem_host_unregister, CA_MEM_HOST_UNREGISTER)
CUDA_CALL(mem_unmap, CA_MEM_UNMAP)

/* ---- cuInit: entry only ---- */

int sits_cuda_init(struct pt_regs *ctx)
{
    __u64 id = bpf_get_current_pid_tgid();
    if (!traced_tgid(id >> 32))
        return 0;
    struct cuda_init_event ev = {};
    ev.kind = EV_CUDA_INIT;
    ev.tgid = id >> 32;
    ev.tid = (__u32)id;
    ev.ts_ns = bpf_ktime_get_ns();
    submit(&ev, sizeof(ev), EV_CUDA_INIT);
    return 0;
}
