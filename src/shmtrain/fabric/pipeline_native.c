/* The pipelined private-tensor allreduce of pipeline_allreduce.py, for float32, in C.
 *
 * Same ring, same channels, same sequence numbers as the Python path, sums in rank order
 * (the same bits as the Python path with 2 ranks; torch.sum may add in another order for
 * more) (issue 16, item 2): each block is copied into this rank's ring slot,
 * posted, and once every rank has posted it summed in rank order straight into the
 * caller's tensor (all-read path), or summed split L ways into the result ring and
 * copied out after a second hand-off (split path). What C removes is the per-block
 * cost of the Python path (tensor operations, numpy word access, the wait loop:
 * ~20-35 us per call), which made small messages lose to MPICH's compiled path.
 *
 * Waiting: spin (mode 0) or yield the core (mode 1) briefly, then sleep on the futex.
 * A sleeper announces the word it sleeps on in its own line of the pipeline segment
 * (seq_cst store, then re-read the word); a poster stores the word (seq_cst) and then
 * reads every announcement: one of the two always sees the other, so no wake-up is
 * lost. Posters also honour the control block's own sleeper lines (Python waiters).
 *
 * The C side never decides about failures: when a wait has used its time budget it
 * returns 1 (the Python caller checks aborts, peer liveness and the timeout, then
 * calls again: the progress record says where to resume); it returns -1 at once when
 * the control block's abort word is set.
 */
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sched.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>

#define RING 2
#define MAXL 64
#define ANY (-1)
#define LINE_I32 16 /* one 64-byte line per rank for announcements */
#define ABORT_WORD 2 /* control block header: abort rank + 1 */

struct plan {
    float *ring;         /* RING x L x per floats */
    float *results;      /* RING x per floats (split path) */
    int32_t *ctrl;       /* the host's control block, as int32 words */
    int32_t *announce;   /* L lines of LINE_I32 words: the word index + 1 a rank sleeps on */
    int64_t per;         /* elements per block */
    int32_t posted[MAXL];    /* index in ctrl of each rank's word of the "posted" channel */
    int32_t reduced[MAXL];   /* ... of the "reduced" channel (split path) */
    int32_t sleepers[MAXL];  /* index in ctrl of each rank's Python sleeper line */
    int32_t L;
    int32_t me;
    int32_t mode;        /* 0: spin first, 1: yield first, 2: sleep at once */
    int32_t spin_ns;     /* how long mode 0 spins */
    int32_t yields;      /* how often mode 1 yields */
};

struct progress {
    int64_t pos;         /* element offset of the current block */
    int64_t seq;         /* sequence number of the last block begun (mod 2**32 on the wire) */
    int32_t phase;       /* 0: not posted, 1: posted (waiting for inputs), 2: reduced posted */
    int32_t waiting;     /* local rank waited for, when returning 1 */
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

static void futex_wait(int32_t *word, int32_t expected, double seconds) {
    struct timespec ts;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

static void futex_wake(int32_t *word) {
    syscall(SYS_futex, word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

static void post(const struct plan *p, int32_t idx, uint32_t value) {
    __atomic_store_n(p->ctrl + idx, (int32_t)value, __ATOMIC_SEQ_CST);
    for (int r = 0; r < p->L; r++) {
        int32_t a = __atomic_load_n(p->announce + r * LINE_I32, __ATOMIC_SEQ_CST);
        int32_t s = __atomic_load_n(p->ctrl + p->sleepers[r], __ATOMIC_SEQ_CST);
        if (a == idx + 1 || s == idx + 1 || s == ANY) {
            futex_wake(p->ctrl + idx);
            return;
        }
    }
}

/* 0: reached; 1: budget used up (the caller checks and calls again); -1: aborted. */
static int wait_word(const struct plan *p, int32_t idx, uint32_t target, double deadline) {
    int32_t *word = p->ctrl + idx;
    if (reached(__atomic_load_n(word, __ATOMIC_ACQUIRE), target))
        return 0;
    if (p->mode == 0) {
        double stop = now_s() + p->spin_ns * 1e-9;
        for (int i = 0;; i++) {
            if (reached(__atomic_load_n(word, __ATOMIC_ACQUIRE), target))
                return 0;
            if ((i & 63) == 63 && now_s() > stop)
                break;
            cpu_relax();
        }
    } else if (p->mode == 1) {
        for (int i = 0; i < p->yields; i++) {
            sched_yield(); /* a runnable peer on this core posts first */
            if (reached(__atomic_load_n(word, __ATOMIC_ACQUIRE), target))
                return 0;
        }
    }
    int32_t *mine = p->announce + p->me * LINE_I32;
    double slice = 0.001;
    int rc;
    __atomic_store_n(mine, idx + 1, __ATOMIC_SEQ_CST);
    for (;;) {
        int32_t value = __atomic_load_n(word, __ATOMIC_SEQ_CST);
        if (reached(value, target)) { rc = 0; break; }
        if (__atomic_load_n(p->ctrl + ABORT_WORD, __ATOMIC_ACQUIRE) != 0) { rc = -1; break; }
        double left = deadline - now_s();
        if (left <= 0) { rc = 1; break; }
        futex_wait(word, value, slice < left ? slice : left);
        slice = slice * 2 < 0.05 ? slice * 2 : 0.05;
    }
    __atomic_store_n(mine, 0, __ATOMIC_SEQ_CST);
    return rc;
}

static int wait_all(const struct plan *p, const int32_t *words, uint32_t target, double deadline,
                    struct progress *s) {
    for (int r = 0; r < p->L; r++) {
        if (r == p->me)
            continue;
        int rc = wait_word(p, words[r], target, deadline);
        if (rc) {
            s->waiting = r;
            return rc;
        }
    }
    return 0;
}

/* ((s0 + s1) + s2) + ... in rank order: every rank computes the same bits. */
static void sum_rows(float *out, const float *slot, int64_t stride, int L, int64_t lo,
                     int64_t hi, const float *own, int me) {
    if (L == 2) { /* own + peer: addition commutes, so both ranks get the same bits */
        const float *peer = slot + (1 - me) * stride;
        if (out == own) {
            for (int64_t i = lo; i < hi; i++)
                out[i] += peer[i];
        } else {
            for (int64_t i = lo; i < hi; i++)
                out[i] = own[i] + peer[i];
        }
        return;
    }
    const float *a = slot, *b = slot + stride;
    for (int64_t i = lo; i < hi; i++)
        out[i] = a[i] + b[i];
    for (int j = 2; j < L; j++) {
        const float *c = slot + j * stride;
        for (int64_t i = lo; i < hi; i++)
            out[i] += c[i];
    }
}

static void scale(float *restrict out, int64_t lo, int64_t hi, float factor) {
    for (int64_t i = lo; i < hi; i++)
        out[i] *= factor;
}

/* Reduce data[0:n] in place. Returns 0 when done, 1 when a wait used up budget_s
 * (progress says where to resume), -1 on abort. */
int shm_pipeline_f32(const struct plan *p, struct progress *s, float *data, int64_t n,
                     int split, int mean, double budget_s) {
    const int L = p->L, me = p->me;
    const int64_t per = p->per;
    const double deadline = now_s() + budget_s;
    const float factor = 1.0f / (float)L;
    while (s->pos < n) {
        int64_t m = n - s->pos < per ? n - s->pos : per;
        float *out = data + s->pos;
        if (s->phase == 0) {
            s->seq += 1;
            float *slot = p->ring + (s->seq % RING) * L * per;
            memcpy(slot + me * per, out, (size_t)m * sizeof(float));
            post(p, p->posted[me], (uint32_t)s->seq);
            s->phase = 1;
        }
        float *slot = p->ring + (s->seq % RING) * L * per;
        float *result = p->results + (s->seq % RING) * per;
        if (s->phase == 1) {
            int rc = wait_all(p, p->posted, (uint32_t)s->seq, deadline, s);
            if (rc)
                return rc;
            if (!split) {
                sum_rows(out, slot, per, L, 0, m, out, me);
                if (mean)
                    scale(out, 0, m, factor);
                s->pos += m;
                s->phase = 0;
                continue;
            }
            /* split: this rank's 1/L of the block, boundaries on 16 elements */
            int64_t part = (m + L - 1) / L;
            part = (part + 15) / 16 * 16;
            int64_t lo = me * part < m ? me * part : m;
            int64_t hi = (me + 1) * part < m ? (me + 1) * part : m;
            if (hi > lo) {
                sum_rows(result, slot, per, L, lo, hi, slot + me * per, me);
                if (mean)
                    scale(result, lo, hi, factor);
            }
            post(p, p->reduced[me], (uint32_t)s->seq);
            s->phase = 2;
        }
        int rc = wait_all(p, p->reduced, (uint32_t)s->seq, deadline, s);
        if (rc)
            return rc;
        memcpy(out, result, (size_t)m * sizeof(float));
        s->pos += m;
        s->phase = 0;
    }
    return 0;
}

/* The zero-copy split reduction's kernel (shm_allreduce.py): own[i] += peers[0][i] + ...
 * in blocks small enough that `own`'s block stays in the L1 cache across the peers, so
 * each byte crosses memory once (torch's add_ per peer passes over the chunk once per
 * peer); then `own *= factor` unless factor is 1. Same order of additions on any rank. */
void shm_sum_into_f32(float *own, const float *const *peers, int npeers, int64_t n, float factor) {
    const int64_t block = 4096; /* 16 KiB of own */
    for (int64_t lo = 0; lo < n; lo += block) {
        int64_t hi = lo + block < n ? lo + block : n;
        for (int j = 0; j < npeers; j++) {
            const float *p = peers[j];
            for (int64_t i = lo; i < hi; i++)
                own[i] += p[i];
        }
        if (factor != 1.0f)
            for (int64_t i = lo; i < hi; i++)
                own[i] *= factor;
    }
}
