/* The shm backend's call hand-off in C (backend/calls.py): a call's header and, where the
 * call is small, all of its data in one hand-off.
 *
 * A ring of RING positions of L lines; a line is HEADER_BYTES of header (numel, dtype,
 * kind, root or count: compared; then a word of the rank's own, not compared) and a
 * payload area. For call number seq every local rank writes its line of position
 * seq % RING, posts seq, waits until every rank has posted it, and compares the headers.
 * Ring reuse needs no other wait (position seq % RING was last used by call seq - 2, which
 * every rank finished reading before it posted seq - 1, which this rank waited for).
 *
 * The plan and the waits are the pipeline's (pipeline_wait.h): `ring` is the call ring
 * (bytes, not floats) and `per` a line's bytes / 4; posted words, completion word,
 * announcements and the modes of waiting as there.
 */
#include "pipeline_wait.h"

#define HEADER_BYTES 64
#define COMPARED 4 /* header words every rank must pass alike */

/* out = ((row0 + row1) + row2) + ... in rank order, out == this rank's own row's values;
 * the order of the pipeline's all-read sum (pipeline_native.c), so a call takes the same
 * bits whichever way it goes. */
static void sum_payloads(float *out, const char *slot, int64_t line, int L, int me, int64_t n) {
#define ROW(r) ((const float *)(slot + (int64_t)(r) * line + HEADER_BYTES))
    if (L == 2) { /* own + peer: addition commutes, so both ranks get the same bits */
        const float *peer = ROW(1 - me);
        for (int64_t i = 0; i < n; i++)
            out[i] += peer[i];
        return;
    }
    const float *a = ROW(0), *b = ROW(1);
    for (int64_t i = 0; i < n; i++)
        out[i] = a[i] + b[i];
    for (int j = 2; j < L; j++) {
        const float *c = ROW(j);
        for (int64_t i = 0; i < n; i++)
            out[i] += c[i];
    }
#undef ROW
}

/* Call s->seq + 1 (or the one under way, s->phase 1): this rank's header and nbytes of
 * payload into its line, post, wait for every local rank, compare the headers; then, where
 * sum is not NULL, sum's n float32 <- the ranks' payloads summed in rank order (times 1/L
 * where mean). Returns 0 when done, 1 when the wait used up budget_s (call again: progress
 * says where), -1 on the control block's abort (even where every rank posted, if the abort
 * names this rank: a peer gave up on it), 2 when the headers differ (nothing summed). */
int shm_call(const struct plan *p, struct progress *s, const int64_t *header, const void *payload,
             int64_t nbytes, float *sum, int64_t n, int mean, double budget_s) {
    const int L = p->L, me = p->me;
    const int64_t line = p->per * 4;
    char *ring = (char *)p->ring;
    if (s->phase == 0) {
        s->seq += 1;
        char *mine = ring + ((s->seq % RING) * L + me) * line;
        memcpy(mine, header, HEADER_BYTES);
        if (nbytes > 0)
            memcpy(mine + HEADER_BYTES, payload, (size_t)nbytes);
        post(p, p->posted, p->done, (uint32_t)s->seq);
        s->phase = 1;
    }
    int rc = wait_all(p, p->posted, p->done, (uint32_t)s->seq, now_s() + budget_s, s);
    if (rc)
        return rc;
    if (__atomic_load_n(p->ctrl + ABORT_WORD, __ATOMIC_ACQUIRE) == me + 1)
        return -1; /* a peer gave up on this rank (it posted this call, then timed out on it) */
    s->phase = 0;
    const char *slot = ring + (s->seq % RING) * L * line;
    const int64_t *own = (const int64_t *)(slot + me * line);
    for (int r = 0; r < L; r++) {
        const int64_t *theirs = (const int64_t *)(slot + r * line);
        for (int w = 0; w < COMPARED; w++)
            if (theirs[w] != own[w])
                return 2;
    }
    if (sum != NULL && L > 1) {
        sum_payloads(sum, slot, line, L, me, n);
        if (mean) {
            const float factor = 1.0f / (float)L;
            for (int64_t i = 0; i < n; i++)
                sum[i] *= factor;
        }
    }
    return 0;
}
