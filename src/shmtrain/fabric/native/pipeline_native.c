/* The pipelined private-tensor allreduce of pipeline_allreduce.py, for float32, in C.
 *
 * Same ring, same channels, same sequence numbers as the Python path, sums in rank order
 * (the same bits as the Python path with 2 ranks; torch.sum may add in another order for
 * more). What C removes is the per-block cost of the Python path
 * (tensor operations, numpy word access, the wait loop: ~20-35 us per call), which made
 * small messages lose to MPICH's compiled path.
 *
 * Algorithms (allreduce_plan.py chooses): all-read (one hand-off per block: every rank
 * sums all L slots straight into its tensor); the split reduce-scatter + all-gather (two
 * hand-offs): rank r copies in every chunk but its own, sums chunk r of the L inputs in
 * rank order (its own row straight from its tensor) into the result ring and its tensor,
 * then copies the other chunks of the result out; two-level (three hand-offs, several
 * NUMA nodes). The "reduced" channel carries 2 * seq (2 * seq - 1: the two-level path's
 * partial sums), so its words grow with seq whatever algorithm each call took.
 * The plan, the progress record and the waits: pipeline_wait.h.
 */
#include "pipeline_wait.h"

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

/* This rank's chunk [lo, hi) of an m-element block split L ways, boundaries on 16
 * elements (allreduce_plan.split). */
static void chunk(int64_t m, int L, int me, int64_t *lo, int64_t *hi) {
    int64_t part = (m + L - 1) / L;
    part = (part + 15) / 16 * 16;
    *lo = me * part < m ? me * part : m;
    *hi = (me + 1) * part < m ? (me + 1) * part : m;
}

/* The split path's sum of chunk [lo, hi): rows in rank order, this rank's own row read
 * from its tensor (it never went through the ring), into the result ring and the tensor. */
static void sum_chunk(float *result, float *out, const float *slot, int64_t stride, int L, int me,
                      int64_t lo, int64_t hi, int mean, float factor) {
    const float *r0 = me == 0 ? out : slot, *r1 = me == 1 ? out : slot + stride;
    for (int64_t i = lo; i < hi; i++)
        result[i] = r0[i] + r1[i];
    for (int j = 2; j < L; j++) {
        const float *c = j == me ? out : slot + j * stride;
        for (int64_t i = lo; i < hi; i++)
            result[i] += c[i];
    }
    if (mean)
        scale(result, lo, hi, factor);
    memcpy(out + lo, result + lo, (size_t)(hi - lo) * sizeof(float));
}

/* The two-level path (several NUMA nodes): per block, the split reduction inside this
 * rank's group into the group's partial sum (the copy-in waits for the group only), then
 * piece `me` of the block summed over the S groups' partials into the result ring and the
 * tensor, then the all-gather. "reduced" carries 2 * seq - 1 for the partials. */
static int two_level(const struct plan *p, struct progress *s, float *data, int64_t n, int mean,
                     double deadline) {
    const int L = p->L, me = p->me;
    const int64_t per = p->per;
    const float factor = 1.0f / (float)L;
    int32_t *done_group = p->done + (2 + p->group) * LINE_I32, *done_reduced = p->done + LINE_I32;
    while (s->pos < n) {
        int64_t m = n - s->pos < per ? n - s->pos : per;
        float *out = data + s->pos;
        int64_t glo, ghi, lo, hi;
        chunk(m, p->G, p->gindex, &glo, &ghi);
        chunk(m, L, me, &lo, &hi);
        if (s->phase == 0) {
            s->seq += 1;
            float *row = p->ring + (s->seq % RING) * L * per + me * per;
            memcpy(row, out, (size_t)glo * sizeof(float));
            memcpy(row + ghi, out + ghi, (size_t)(m - ghi) * sizeof(float));
            post(p, p->posted, p->done, (uint32_t)s->seq);
            complete(p, p->posted, p->members, p->G, done_group, (uint32_t)s->seq);
            s->phase = 1;
        }
        const float *slot = p->ring + (s->seq % RING) * L * per;
        float *partials = p->partials + (s->seq % RING) * p->S * per;
        float *result = p->results + (s->seq % RING) * per;
        int rc;
        if (s->phase == 1) {
            rc = wait_set(p, p->posted, p->members, p->G, done_group, (uint32_t)s->seq, deadline, s);
            if (rc)
                return rc;
            float *partial = partials + p->group * per;
            for (int i = 0; i < p->G; i++) { /* the group's rows in order, own row from the tensor */
                int j = p->members[i];
                const float *row = j == me ? out : slot + j * per;
                for (int64_t x = glo; x < ghi; x++)
                    partial[x] = i ? partial[x] + row[x] : row[x];
            }
            post(p, p->reduced, done_reduced, (uint32_t)(2 * s->seq - 1));
            s->phase = 2;
        }
        if (s->phase == 2) {
            rc = wait_all(p, p->reduced, done_reduced, (uint32_t)(2 * s->seq - 1), deadline, s);
            if (rc)
                return rc;
            for (int g = 0; g < p->S; g++) {
                const float *partial = partials + g * per;
                for (int64_t x = lo; x < hi; x++)
                    result[x] = g ? result[x] + partial[x] : partial[x];
            }
            if (mean)
                scale(result, lo, hi, factor);
            memcpy(out + lo, result + lo, (size_t)(hi - lo) * sizeof(float));
            post(p, p->reduced, done_reduced, (uint32_t)(2 * s->seq));
            s->phase = 3;
        }
        rc = wait_all(p, p->reduced, done_reduced, (uint32_t)(2 * s->seq), deadline, s);
        if (rc)
            return rc;
        memcpy(out, result, (size_t)lo * sizeof(float));
        memcpy(out + hi, result + hi, (size_t)(m - hi) * sizeof(float));
        s->pos += m;
        s->phase = 0;
    }
    return 0;
}

/* Reduce data[0:n] in place with algorithm `algo` (0: all-read, 1: split, 2: two-level).
 * Returns 0 when done, 1 when a wait used up budget_s (progress says where to resume),
 * -1 on abort. */
int shm_pipeline_f32(const struct plan *p, struct progress *s, float *data, int64_t n,
                     int algo, int mean, double budget_s) {
    const int L = p->L, me = p->me;
    const int64_t per = p->per;
    const double deadline = now_s() + budget_s;
    const float factor = 1.0f / (float)L;
    const int split = algo == 1;
    int32_t *done_posted = p->done, *done_reduced = p->done + LINE_I32;
    if (algo == 2)
        return two_level(p, s, data, n, mean, deadline);
    while (s->pos < n) {
        int64_t m = n - s->pos < per ? n - s->pos : per;
        float *out = data + s->pos;
        int64_t lo = 0, hi = m;
        if (split)
            chunk(m, L, me, &lo, &hi);
        if (s->phase == 0) {
            s->seq += 1;
            float *row = p->ring + (s->seq % RING) * L * per + me * per;
            if (split) { /* every chunk but this rank's own: the peers sum those */
                memcpy(row, out, (size_t)lo * sizeof(float));
                memcpy(row + hi, out + hi, (size_t)(m - hi) * sizeof(float));
            } else {
                memcpy(row, out, (size_t)m * sizeof(float));
            }
            post(p, p->posted, done_posted, (uint32_t)s->seq);
            s->phase = 1;
        }
        float *slot = p->ring + (s->seq % RING) * L * per;
        float *result = p->results + (s->seq % RING) * per;
        if (s->phase == 1) {
            int rc = wait_all(p, p->posted, done_posted, (uint32_t)s->seq, deadline, s);
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
            if (hi > lo)
                sum_chunk(result, out, slot, per, L, me, lo, hi, mean, factor);
            post(p, p->reduced, done_reduced, (uint32_t)(2 * s->seq));
            s->phase = 2;
        }
        int rc = wait_all(p, p->reduced, done_reduced, (uint32_t)(2 * s->seq), deadline, s);
        if (rc)
            return rc;
        memcpy(out, result, (size_t)lo * sizeof(float));
        memcpy(out + hi, result + hi, (size_t)(m - hi) * sizeof(float));
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

/* The hand-off latency of the cost model (machine_model.py): a word passed back and
 * forth between this thread and a second one, each waiting as a rank of the pipeline
 * does (mode 0: spin, else sleep on the futex at once). Returns seconds per one-way
 * hand-off, or -1 when no thread could be started. */
struct pingpong { int32_t words[2]; int rounds; int spin; };

static void pp_wait(int32_t *word, int32_t target, int spin) {
    for (int i = 0;; i++) {
        int32_t v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (v >= target)
            return;
        if (!spin)
            futex_wait(word, v, 0.01);
        else if ((i & 4095) == 4095)
            sched_yield(); /* the peer thread lost its core: let it run */
        else
            cpu_relax();
    }
}

static void pp_post(int32_t *word, int32_t value, int spin) {
    __atomic_store_n(word, value, __ATOMIC_SEQ_CST);
    if (!spin)
        futex_wake(word);
}

static void *pp_echo(void *arg) {
    struct pingpong *pp = arg;
    for (int i = 1; i <= pp->rounds; i++) {
        pp_wait(&pp->words[0], i, pp->spin);
        pp_post(&pp->words[1], i, pp->spin);
    }
    return NULL;
}

double shm_handoff_s(int rounds, int spin) {
    struct pingpong pp = {{0, 0}, rounds, spin};
    pthread_t thread;
    if (pthread_create(&thread, NULL, pp_echo, &pp) != 0)
        return -1.0;
    double start = now_s();
    for (int i = 1; i <= rounds; i++) {
        pp_post(&pp.words[0], i, spin);
        pp_wait(&pp.words[1], i, spin);
    }
    double elapsed = now_s() - start;
    pthread_join(thread, NULL);
    return elapsed / rounds / 2;
}
