/* The shm backend's ring of the other collectives (backend/host_ops.py) in C: the blocks
 * of a call larger than the call ring's payload, each one hand-off, without Python per
 * block.
 *
 * The ring is host_ops.py's: RING positions of L slots of p->per * 4 bytes (plan.ring),
 * the "posted" channel's words (plan.posted), the completion word and announcements of
 * pipeline_wait.h. Block k: every rank writes what it sends into its slot of position
 * k % RING, posts k, waits until every rank posted k, reads what it receives from the
 * others' slots. Ring reuse needs no other wait (block k overwrites the slots of block
 * k - 2, which every rank finished reading before it posted k - 1, which this rank waited
 * for). These are the block-wise schedules of Thakur, Rabenseifner and Gropp,
 * "Optimization of Collective Communication Operations in MPICH" (2005), over shared
 * memory: every rank's data crosses memory once into the ring and once out of it.
 *
 * Like shm_pipeline_f32, each function waits at most budget_s, then returns 1 (the caller
 * checks aborts, peers and the timeout, and calls again: the progress record says where to
 * resume), -1 on the control block's abort, 0 when done.
 */
#include "pipeline_wait.h"

#define OP_SUM 0
#define OP_AVG 1
#define OP_MAX 2
#define OP_MIN 3
#define OP_PRODUCT 4
#define CHUNK 1024 /* floats combined at a time (4 KiB: the accumulator stays in L1) */

static inline char *slot_of(const struct plan *p, int64_t seq, int rank) {
    return (char *)p->ring + ((seq % RING) * p->L + rank) * p->per * 4;
}

/* Gather-like calls (all_gather, broadcast, gather): block after block of at most `block`
 * bytes of each rank's n bytes, this rank's `send` (NULL: it sends nothing) into its slot;
 * after the hand-off recv[r] <- rank r's block for every r != me whose recv[r] is not NULL,
 * and recv[me] <- send where both are given and differ (FSDP2's input is a view of its
 * output: then nothing is copied). */
int shm_ring_collect(const struct plan *p, struct progress *s, const char *send, char *const *recv,
                     int64_t n, int64_t block, double budget_s) {
    const int L = p->L, me = p->me;
    const double deadline = now_s() + budget_s;
    while (s->pos < n) {
        const int64_t m = n - s->pos < block ? n - s->pos : block;
        if (s->phase == 0) {
            s->seq += 1;
            if (send != NULL)
                memcpy(slot_of(p, s->seq, me), send + s->pos, (size_t)m);
            post(p, p->posted, p->done, (uint32_t)s->seq);
            /* this rank's own piece while the peers write theirs (memmove: a caller's output
             * may overlap its input other than exactly) */
            if (send != NULL && recv[me] != NULL && recv[me] != send)
                memmove(recv[me] + s->pos, send + s->pos, (size_t)m);
            s->phase = 1;
        }
        int rc = wait_all(p, p->posted, p->done, (uint32_t)s->seq, deadline, s);
        if (rc)
            return rc;
        for (int r = 0; r < L; r++)
            if (r != me && recv[r] != NULL)
                memcpy(recv[r] + s->pos, slot_of(p, s->seq, r), (size_t)m);
        s->pos += m;
        s->phase = 0;
    }
    return 0;
}

/* acc <- acc (op) row over m floats; returns nonzero where an element is one whose bits
 * torch's kernels may set otherwise than this loop (a NaN operand; for MAX and MIN two
 * zeros of opposite signs: torch's vectorized maximum returns its second operand there,
 * its scalar one its first): the caller then combines the block with torch. */
static int combine(float *restrict acc, const float *restrict row, int64_t m, int op) {
    int bad = 0;
    switch (op) {
    case OP_SUM:
    case OP_AVG:
        for (int64_t i = 0; i < m; i++) {
            float x = acc[i], y = row[i];
            bad |= (x != x) | (y != y);
            acc[i] = x + y;
        }
        break;
    case OP_PRODUCT:
        for (int64_t i = 0; i < m; i++) {
            float x = acc[i], y = row[i];
            bad |= (x != x) | (y != y);
            acc[i] = x * y;
        }
        break;
    case OP_MAX:
    case OP_MIN:
        for (int64_t i = 0; i < m; i++) {
            float x = acc[i], y = row[i];
            uint32_t bx, by;
            memcpy(&bx, &x, 4);
            memcpy(&by, &y, 4);
            bad |= (x != x) | (y != y) | ((x == y) & (bx != by));
            acc[i] = op == OP_MAX ? (x < y ? y : x) : (y < x ? y : x);
        }
        break;
    default:
        return 1;
    }
    return bad;
}

/* Reduce-like calls of float32 (reduce_scatter; all_reduce and reduce of MAX, MIN,
 * PRODUCT; SUM and AVG): block after block of q elements per destination (q = block / L,
 * or block where `same`: every destination gets the same piece, an all_reduce or a
 * reduce), this rank's piece for every destination j into its slot at j * q (`same`: one
 * piece; else not its own: it reads that from sends[me]); after the hand-off, where root
 * is -1 or this rank, out <- the L ranks' pieces for this rank combined in rank order
 * (((r0 op r1) op r2) ..., divided by L for AVG: the Python path's torch calls, bit for
 * bit). sends: L pointers (`same`: sends[0] only) of n elements each.
 * Returns 3 with s->phase 2 where a block holds an element torch may round otherwise
 * (combine()): the caller combines that block (s->pos, the next min(q, n - s->pos)
 * elements, in slot position s->seq % RING), then sets s->pos past it and s->phase 0,
 * and calls again. */
int shm_ring_reduce_f32(const struct plan *p, struct progress *s, const float *const *sends, float *out,
                        int64_t n, int same, int op, int root, int64_t block, double budget_s) {
    const int L = p->L, me = p->me;
    const int64_t q = same ? block : block / L;
    const double deadline = now_s() + budget_s;
    float acc[CHUNK];
    while (s->pos < n) {
        const int64_t m = n - s->pos < q ? n - s->pos : q;
        if (s->phase == 0) {
            s->seq += 1;
            float *row = (float *)slot_of(p, s->seq, me);
            if (same) {
                memcpy(row, sends[0] + s->pos, (size_t)m * 4);
            } else {
                for (int j = 0; j < L; j++)
                    if (j != me)
                        memcpy(row + j * q, sends[j] + s->pos, (size_t)m * 4);
            }
            post(p, p->posted, p->done, (uint32_t)s->seq);
            s->phase = 1;
        }
        if (s->phase == 1) {
            int rc = wait_all(p, p->posted, p->done, (uint32_t)s->seq, deadline, s);
            if (rc)
                return rc;
            if (root < 0 || root == me) {
                const float *rows[MAXL];
                for (int r = 0; r < L; r++) {
                    const float *slot = (const float *)slot_of(p, s->seq, r);
                    rows[r] = same ? slot : (r == me ? sends[me] + s->pos : slot + me * q);
                }
                /* one pass: a chunk's result goes out once it is fine (out overlaps no row but
                 * where it is the row itself, element for element: the caller checks) */
                for (int64_t c = 0; c < m; c += CHUNK) {
                    const int64_t k = m - c < CHUNK ? m - c : CHUNK;
                    int bad = 0;
                    memcpy(acc, rows[0] + c, (size_t)k * 4);
                    for (int r = 1; r < L; r++)
                        bad |= combine(acc, rows[r] + c, k, op);
                    if (bad) {
                        s->phase = 2;
                        return 3;
                    }
                    if (op == OP_AVG) {
                        const float ranks = (float)L;
                        for (int64_t i = 0; i < k; i++)
                            acc[i] = acc[i] / ranks;
                    }
                    memcpy(out + s->pos + c, acc, (size_t)k * 4);
                }
            }
            s->pos += m;
            s->phase = 0;
        }
        if (s->phase == 2)
            return 3; /* the caller has not combined the block yet */
    }
    return 0;
}

/* all_to_all: `blocks` blocks (every rank's largest count, exchanged in the call header);
 * in block b this rank writes bytes [b * per, b * per + per) of sends[j] (of send_n[j]
 * bytes: fewer, or none, where its data for j has ended) into its slot at j * per for
 * every j != me, and after the hand-off recvs[i] <- rank i's piece for it, from its slot
 * at me * per (recv_n[i] bytes in all); its own piece goes from sends[me] to recvs[me]
 * directly. Uneven splits included. */
int shm_ring_exchange(const struct plan *p, struct progress *s, const char *const *sends, const int64_t *send_n,
                      char *const *recvs, const int64_t *recv_n, int64_t blocks, int64_t per, double budget_s) {
    const int L = p->L, me = p->me;
    const double deadline = now_s() + budget_s;
    while (s->pos < blocks) {
        const int64_t start = s->pos * per;
        if (s->phase == 0) {
            s->seq += 1;
            char *row = slot_of(p, s->seq, me);
            for (int j = 0; j < L; j++) {
                const int64_t m = send_n[j] - start < per ? send_n[j] - start : per;
                if (j != me && m > 0)
                    memcpy(row + j * per, sends[j] + start, (size_t)m);
            }
            post(p, p->posted, p->done, (uint32_t)s->seq);
            const int64_t own = recv_n[me] - start < per ? recv_n[me] - start : per;
            if (own > 0 && recvs[me] + start != sends[me] + start)
                memmove(recvs[me] + start, sends[me] + start, (size_t)own);
            s->phase = 1;
        }
        int rc = wait_all(p, p->posted, p->done, (uint32_t)s->seq, deadline, s);
        if (rc)
            return rc;
        for (int i = 0; i < L; i++) {
            const int64_t m = recv_n[i] - start < per ? recv_n[i] - start : per;
            if (i != me && m > 0)
                memcpy(recvs[i] + start, slot_of(p, s->seq, i) + me * per, (size_t)m);
        }
        s->pos += 1;
        s->phase = 0;
    }
    return 0;
}
