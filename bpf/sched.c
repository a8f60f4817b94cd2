/* Run-queue delay of the threads of traced processes, through sched: tracepoints.
 *
 * sched:sched_wakeup, sched:sched_wakeup_new  a thread became runnable: stamp it
 * sched:sched_switch  the thread leaving the CPU (the current one) is stamped again when it
 *                     stays runnable (preempted, yield); the one arriving ends its wait
 *
 * A wait is added to the thread's cumulative counter in `runq_threads` (events.h; the same
 * quantity as /proc/<tid>/schedstat's second field), to its process's totals in `runq_procs`
 * and to a per-process log2 histogram in microseconds (`runq_hist`, like bcc's runqlat -P).
 * Which processes: those in `target_pids` when --pid filtering is on; else every process with
 * SITS_SCHED_ALL=1; else those in `sched_tgids` (processes with traced connections: http.c
 * adds them when it registers a connection, the agent at start). Threads are learned when
 * they leave a CPU (then `current` names their process). Costs, node-wide: a bit test per
 * wakeup; two bit tests and one hash lookup (is the leaving thread's process tracked?) per
 * context switch; more for tracked threads. Nothing is sent through the ring and no kernel
 * struct is read. Each EV_DATA carries the calling thread's wait total too: the scheduler's own
 * (task_struct.sched_info.run_delay) with the kernel's BTF, else this file's counter.
 */
#ifndef SITS_SCHED
#define SITS_SCHED 1 /* this file is loaded: events.h keeps the per-thread run-queue counters */
#endif
#include "events.h"

#ifndef SITS_SCHED_ALL
#define SITS_SCHED_ALL 0
#endif
#ifndef SITS_MAX_PROCS
#define SITS_MAX_PROCS 4096
#endif
#define RUNQ_SLOTS 32
/* sched_switch's prev_state: TASK_REPORT_MAX marks a preemption; 0 is TASK_RUNNING */
#define PREV_STATE_PREEMPTED 0x100
#define PREV_STATE_MASK 0xff
#define PREV_STATE_EXITING 0x30 /* EXIT_DEAD | EXIT_ZOMBIE */

struct runq_proc {
    __u64 delay_ns;
    __u64 count;
};

struct runq_hist_key {
    __u32 tgid;
    __u32 slot; /* log2 of the wait in microseconds */
};

/* tid -> when it became runnable */
BPF_TABLE("lru_hash", __u32, __u64, runq_start, SITS_MAX_THREADS);
BPF_HASH(runq_procs, __u32, struct runq_proc, SITS_MAX_PROCS);
BPF_HASH(runq_hist, struct runq_hist_key, __u64, SITS_MAX_PROCS * 8);

static __always_inline int sched_traced(__u32 tgid)
{
    if (!traced_tgid(tgid))
        return 0;
#if SITS_FILTER_PIDS || SITS_SCHED_ALL
    return 1;
#else
    return sched_tgids.lookup(&tgid) != 0;
#endif
}

static __always_inline struct runq_thread *track(__u32 tid, __u32 tgid)
{
    struct runq_thread fresh = {.tgid = tgid};
    runq_threads.update(&tid, &fresh);
    runq_tid_mark(tid, 1);
    return runq_threads.lookup(&tid);
}

static __always_inline void account(struct runq_thread *t, __u64 delta)
{
    t->delay_ns += delta; /* only the CPU switching this thread in writes here */
    t->count++;
    __u32 tgid = t->tgid;
    struct runq_proc *p = runq_procs.lookup(&tgid);
    if (!p) {
        struct runq_proc zero = {};
        runq_procs.insert(&tgid, &zero);
        p = runq_procs.lookup(&tgid);
        if (!p)
            return;
    }
    __sync_fetch_and_add(&p->delay_ns, delta);
    __sync_fetch_and_add(&p->count, 1);
    __u64 slot = bpf_log2l(delta / 1000);
    if (slot >= RUNQ_SLOTS)
        slot = RUNQ_SLOTS - 1;
    struct runq_hist_key hk = {.tgid = tgid, .slot = (__u32)slot};
    runq_hist.increment(hk);
}

static __always_inline int on_wakeup(__u32 tid)
{
    /* a thread waking itself is on its CPU: a sleep whose timer fired before it could leave
     * (a nap of a few microseconds), no wait */
    if ((__u32)bpf_get_current_pid_tgid() == tid)
        return 0;
    if (!runq_tid_on(tid) || !runq_threads.lookup(&tid))
        return 0;
    __u64 now = bpf_ktime_get_ns();
    /* keep an earlier stamp: a wakeup of a thread already queued (preempted) does not
     * restart its wait; a sleeping thread has none (removed when it slept). A thread woken
     * while still on its CPU, about to sleep, gets a stamp here too: it is replaced when the
     * thread leaves the CPU (on_switch_out), never counted from here */
    runq_start.insert(&tid, &now);
    return 0;
}

static __always_inline int on_wakeup_new(__u32 tid)
{
    /* `current` is the parent: right for a new thread; a forked process is corrected when
     * it first leaves a CPU, its first wait counted in the parent's histogram */
    __u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!sched_traced(tgid))
        return 0;
    if (!track(tid, tgid))
        return 0;
    __u64 now = bpf_ktime_get_ns();
    runq_start.update(&tid, &now);
    return 0;
}

/* the clock, read at most once a switch and only when a tracked thread needs it */
static __always_inline __u64 clock_once(__u64 *now)
{
    if (!*now)
        *now = bpf_ktime_get_ns();
    return *now;
}

/* the thread leaving the CPU is `current` */
static __always_inline void on_switch_out(__u32 tid, long state, __u64 *now)
{
    __u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct runq_thread *t = 0;
    if (runq_tid_on(tid)) {
        t = runq_threads.lookup(&tid);
        if (t && t->tgid != tgid) {
            t->tgid = tgid; /* a forked child, tracked as its parent's */
            if (!sched_traced(tgid)) {
                runq_threads.delete(&tid);
                runq_tid_mark(tid, 0);
                t = 0;
            }
        }
    } else if (sched_traced(tgid)) {
        /* a thread of a tracked process: new, or tracked with its bit missing */
        t = runq_threads.lookup(&tid);
        if (t)
            runq_tid_mark(tid, 1);
        else
            t = track(tid, tgid);
    }
    if (!t)
        return;
    if ((state & PREV_STATE_MASK) == 0) {
        /* still runnable: waits from now. Any stamp it has is older and wrong: the thread
         * was on this CPU until now (a wakeup that found it still running, about to sleep,
         * stamped it, and it ran on; counted from there, its next wait took in the time it
         * ran: sched.c read 1.4-1.6x schedstat for a thread napping 1 us between 2-ms
         * spins under stress-ng) */
        __u64 ts = clock_once(now);
        runq_start.update(&tid, &ts);
        return;
    }
    runq_start.delete(&tid);
    if (state & PREV_STATE_EXITING) {
        runq_threads.delete(&tid);
        runq_tid_mark(tid, 0);
    }
}

static __always_inline void on_switch_in(__u32 tid, __u64 *now)
{
    if (!runq_tid_on(tid))
        return;
    __u64 *ts = runq_start.lookup(&tid);
    if (!ts) {
        /* a tracked thread arrives with no stamp: its wakeup or preemption was not seen */
        struct runq_thread *u = runq_threads.lookup(&tid);
        if (u)
            __sync_fetch_and_add(&u->untimed, 1);
        return;
    }
    __u64 delta = clock_once(now) - *ts;
    runq_start.delete(&tid);
    struct runq_thread *t = runq_threads.lookup(&tid);
    if (t)
        account(t, delta);
}

#ifndef SITS_NO_SCHED_SCHED_WAKEUP
TRACEPOINT_PROBE(sched, sched_wakeup)
{
    return on_wakeup(args->pid);
}
#endif

#ifndef SITS_NO_SCHED_SCHED_WAKEUP_NEW
TRACEPOINT_PROBE(sched, sched_wakeup_new)
{
    return on_wakeup_new(args->pid);
}
#endif

#ifndef SITS_NO_SCHED_SCHED_SWITCH
TRACEPOINT_PROBE(sched, sched_switch)
{
    __u64 now = 0;
    if (args->prev_pid)
        on_switch_out(args->prev_pid, args->prev_state, &now);
    if (args->next_pid)
        on_switch_in(args->next_pid, &now);
    return 0;
}
#endif
