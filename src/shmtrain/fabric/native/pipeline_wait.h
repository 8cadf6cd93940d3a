/* The compiled pipeline's plan, progress record and waits (included by pipeline_native.c, and by
 * call_native.c, the shm backend's call hand-off, which waits the same way).
 *
 * Waiting: a hand-off waits for all its ranks' words at once, never one sleep per peer in
 * a row. Spin (mode 0, yielding the core every 32 scans, so that a peer sharing this core
 * posts instead of waiting out the spin) or yield the core (mode 1) briefly while scanning
 * every word, then
 * sleep on the hand-off's completion word. Every poster stores its word (seq_cst) and
 * reads the others': the last poster sees them all, stores the completion word and wakes
 * its sleepers with one system call, so a waiter sleeps and wakes at most once per
 * hand-off. A sleeper announces the completion word in its own line of the pipeline
 * segment (seq_cst store, then re-read it); the completer stores it and then reads every
 * announcement: one of the two always sees the other, so no wake-up is lost. Posters
 * also honour the control block's own sleeper lines (Python waiters).
 *
 * The C side never decides about failures: when a wait has used its time budget it
 * returns 1 (the Python caller checks aborts, peer liveness and the timeout, then
 * calls again: the progress record says where to resume); it returns -1 at once when
 * the control block's abort word is set.
 */
#ifndef SHMTRAIN_PIPELINE_WAIT_H
#define SHMTRAIN_PIPELINE_WAIT_H

#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sched.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>
#include <pthread.h>

#define RING 2
#define MAXL 64
#define ANY (-1)
#define LINE_I32 16 /* one 64-byte line per rank for announcements */
#define ABORT_WORD 2 /* control block header: abort rank + 1 */

struct plan {
    float *ring;         /* RING x L x per floats */
    float *results;      /* RING x per floats (split path) */
    int32_t *ctrl;       /* the host's control block, as int32 words */
    int32_t *announce;   /* L lines of LINE_I32 words: -(1 + completion word) a rank sleeps on */
    int32_t *done;       /* completion words: posted at 0, reduced at LINE_I32 */
    int64_t per;         /* elements per block */
    int32_t posted[MAXL];    /* index in ctrl of each rank's word of the "posted" channel */
    int32_t reduced[MAXL];   /* ... of the "reduced" channel (split path) */
    int32_t sleepers[MAXL];  /* index in ctrl of each rank's Python sleeper line */
    int32_t L;
    int32_t me;
    int32_t mode;        /* 0: spin first, 1: yield first, 2: sleep at once */
    int32_t spin_ns;     /* how long mode 0 spins */
    int32_t yields;      /* how often mode 1 yields */
    float *partials;     /* RING x S x per floats (two-level path) */
    int32_t S;           /* groups of ranks (NUMA nodes), two-level path */
    int32_t G;           /* ranks in this rank's group */
    int32_t gindex;      /* this rank's index in its group */
    int32_t group;       /* its group */
    int32_t members[MAXL]; /* the local ranks of its group, in order */
    int32_t all[MAXL];   /* 0, 1, ..., L - 1 */
};

struct progress {
    int64_t pos;         /* element offset of the current block */
    int64_t seq;         /* sequence number of the last block begun (mod 2**32 on the wire) */
    int32_t phase;       /* 0: not posted, 1: posted (waiting for inputs), 2: reduced posted */
    int32_t waiting;     /* local rank waited for, when returning 1 */
    int32_t wakes;       /* times a sleeping wait was woken by a post (not by its time slice) */
};

static inline int reached(int32_t value, uint32_t target) {
    return (uint32_t)((uint32_t)value - target) < 0x80000000u;
}

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* 0 when woken by a FUTEX_WAKE, else -1 (time slice over, value already changed, signal) */
static long futex_wait(int32_t *word, int32_t expected, double seconds) {
    struct timespec ts;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    return syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

static void futex_wake(int32_t *word) {
    syscall(SYS_futex, word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

/* If every rank of `ranks` (n of them) has posted value on the channel `words`, store the
 * completion word `done` and wake the sleepers announced on it. */
static void complete(const struct plan *p, const int32_t *words, const int32_t *ranks, int n,
                     int32_t *done, uint32_t value) {
    for (int i = 0; i < n; i++)
        if (!reached(__atomic_load_n(p->ctrl + words[ranks[i]], __ATOMIC_SEQ_CST), value))
            return; /* not the last: the last poster completes the hand-off */
    int32_t tag = -(int32_t)(1 + (done - p->done));
    int32_t old = __atomic_load_n(done, __ATOMIC_SEQ_CST);
    if (!reached(old, value)) /* several completers may store the same value */
        __atomic_store_n(done, (int32_t)value, __ATOMIC_SEQ_CST);
    for (int r = 0; r < p->L; r++) {
        if (__atomic_load_n(p->announce + r * LINE_I32, __ATOMIC_SEQ_CST) == tag) {
            futex_wake(done);
            return;
        }
    }
}

/* Store this rank's word of a channel, and complete the hand-off of all L ranks if this
 * post was the last one. */
static void post(const struct plan *p, const int32_t *words, int32_t *done, uint32_t value) {
    int32_t idx = words[p->me];
    __atomic_store_n(p->ctrl + idx, (int32_t)value, __ATOMIC_SEQ_CST);
    for (int r = 0; r < p->L; r++) { /* Python waiters on this word (other paths' threads) */
        int32_t s = __atomic_load_n(p->ctrl + p->sleepers[r], __ATOMIC_SEQ_CST);
        if (s == idx + 1 || s == ANY) {
            futex_wake(p->ctrl + idx);
            break;
        }
    }
    complete(p, words, p->all, p->L, done, value);
}

static int all_reached(const struct plan *p, const int32_t *words, const int32_t *ranks, int n,
                       uint32_t target, int *late) {
    for (int i = 0; i < n; i++) {
        if (!reached(__atomic_load_n(p->ctrl + words[ranks[i]], __ATOMIC_ACQUIRE), target)) {
            *late = ranks[i];
            return 0;
        }
    }
    return 1;
}

/* Wait until the n ranks of `ranks` posted target on the channel `words`, whose hand-off
 * over those ranks completes into `done`: 0; 1: budget used up (the caller checks and
 * calls again; s->waiting names a rank not there yet); -1: aborted. */
static int wait_set(const struct plan *p, const int32_t *words, const int32_t *ranks, int n,
                    int32_t *done, uint32_t target, double deadline, struct progress *s) {
    int late = 0;
#define DONE() (reached(__atomic_load_n(done, __ATOMIC_ACQUIRE), target) || \
                all_reached(p, words, ranks, n, target, &late))
    if (DONE())
        return 0;
    if (p->mode == 0) {
        double stop = now_s() + p->spin_ns * 1e-9;
        for (int i = 0;; i++) {
            if (DONE())
                return 0;
            if ((i & 15) == 15 && now_s() > stop)
                break;
            if ((i & 31) == 31)
                sched_yield(); /* a peer the scheduler put on this core (a futex wake-up pulls
                                  the wakee to the waker's core) runs now, not after the spin */
            cpu_relax();
        }
    } else if (p->mode == 1) {
        for (int i = 0; i < p->yields; i++) {
            sched_yield(); /* a runnable peer on this core posts first */
            if (DONE())
                return 0;
        }
    }
    int32_t *mine = p->announce + p->me * LINE_I32;
    double slice = 0.001;
    int rc;
    __atomic_store_n(mine, -(int32_t)(1 + (done - p->done)), __ATOMIC_SEQ_CST);
    for (;;) {
        int32_t value = __atomic_load_n(done, __ATOMIC_SEQ_CST);
        if (reached(value, target) || all_reached(p, words, ranks, n, target, &late)) { rc = 0; break; }
        if (__atomic_load_n(p->ctrl + ABORT_WORD, __ATOMIC_ACQUIRE) != 0) { rc = -1; break; }
        double left = deadline - now_s();
        if (left <= 0) { rc = 1; break; }
        if (futex_wait(done, value, slice < left ? slice : left) == 0)
            s->wakes += 1;
        slice = slice * 2 < 0.05 ? slice * 2 : 0.05;
    }
#undef DONE
    __atomic_store_n(mine, 0, __ATOMIC_SEQ_CST);
    if (rc)
        s->waiting = late;
    return rc;
}

static int wait_all(const struct plan *p, const int32_t *words, int32_t *done, uint32_t target,
                    double deadline, struct progress *s) {
    return wait_set(p, words, p->all, p->L, done, target, deadline, s);
}


#endif
