/* The compressed exchange's encoder in C (fabric/compress/codec.py's Codec.encode with error
 * feedback, one pass per chunk while the chunk is in L1).
 *
 * SparseLoCo's compressor with error feedback (Karimireddy et al. 2019, Algorithm 2):
 *   a = acc + delta            (acc holds e, the part earlier exchanges left out)
 *   c = top-k of every chunk, values quantised to B bits with one scale per chunk
 *   acc <- a - D(c)            (when feedback is on)
 *
 * Selection is exact: the k largest magnitudes of the chunk, ties broken towards the
 * lower index. The magnitudes are compared as the bit patterns of |x| (monotonic for
 * non-negative floats). The chunk's elements fall into W = ceil(chunk / 8) strided groups
 * (group j: j, j + W, ...); with k <= W, the k-th largest group maximum t is a lower bound
 * of the k-th largest magnitude (k groups have a maximum >= t), so only elements >= t are
 * candidates: about k to 8k of the chunk instead of all of it. A histogram of the
 * candidates finds the bin the k-th falls in; a quickselect over that bin's (magnitude,
 * index) keys finds the k-th key; a last walk keeps the keys at or above it.
 *
 * Payload (as Codec lays it out): per chunk a float32 scale (its largest kept magnitude
 * over qmax), k int16 indices, k codes of B bits (q + qmax) packed from the low bits of
 * each byte up; for B = 32, k float32 values instead of the scale and the codes.
 * q = nearbyint(v / scale), round half to even as torch.round, clamped to [-qmax, qmax];
 * the value sent is q * scale in float32, the arithmetic of the torch path, so the bits
 * of e match it whenever the kept places do.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define GROUP 8
#define MAXCHUNK 4096
#define SHIFT 20  /* a histogram bin: the top 11 bits of |x| */
#define FINE (SHIFT - 8)  /* within one: the next 8 */

static inline uint32_t mag_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u & 0x7fffffffu;
}

/* the k-th largest (1-based) of keys[0..n) (moved about in place) */
static uint64_t kth_largest(uint64_t *keys, int n, int k) {
    int lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        uint64_t a = keys[lo], b = keys[(lo + hi) / 2], c = keys[hi], pivot;
        pivot = (a > b) ? ((b > c) ? b : (a > c ? c : a)) : ((a > c) ? a : (b > c ? c : b));
        int i = lo, j = hi;
        while (i <= j) {
            while (keys[i] > pivot) i++;
            while (keys[j] < pivot) j--;
            if (i <= j) {
                uint64_t t = keys[i];
                keys[i] = keys[j];
                keys[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return keys[want];
    }
    return keys[want];
}

/* A lower bound t of the k-th largest of values[0..n) with at least k values >= t: the
 * floor of the histogram bin (the top 11 bits of a non-negative float: exponent and 3
 * mantissa bits, 1/8 of an octave) the k-th largest falls in; top: the largest value. bins
 * is all zero on entry and on return. */
static uint32_t bin_floor(const uint32_t *values, int n, int k, uint32_t top, uint16_t *bins) {
    for (int j = 0; j < n; j++) bins[values[j] >> SHIFT]++;
    int b = (int)(top >> SHIFT), seen = 0;
    for (; b > 0; b--) {
        seen += bins[b];
        if (seen >= k) break;
    }
    for (int j = 0; j < n; j++) bins[values[j] >> SHIFT] = 0;
    return (uint32_t)b << SHIFT;
}

static int count_at_least(const uint32_t *mags, int chunk, uint32_t t) {
    int n = 0;
    for (int i = 0; i < chunk; i++) n += (int32_t)mags[i] >= (int32_t)t;  /* both < 2^31: a vector compare */
    return n;
}

static inline uint64_t key_of(uint32_t mag, int index) {
    return ((uint64_t)mag << 16) | (uint64_t)(0xffff - index);  /* lower index wins a tie */
}

struct scratch {
    uint32_t mags[MAXCHUNK];
    uint32_t gmax[MAXCHUNK / GROUP + 1];
    int16_t where[MAXCHUNK + 8];  /* + 8: left_pack writes whole blocks */
    int16_t groups[MAXCHUNK / GROUP + 8];
    int16_t inbin[MAXCHUNK];
    int16_t kept[MAXCHUNK];  /* the k places, then copied out (a branch-free append writes one past) */
    uint64_t keys[MAXCHUNK];
    uint16_t bins[1u << (31 - SHIFT)];  /* all zero between calls */
    uint16_t fine[256];  /* the next 8 bits' histogram, all zero between calls */
    uint8_t lut[256][8];  /* lut[m]: the set bits of m, lowest first */
    int ready;  /* lut filled */
};

/* The places i of values[0..n) with values[i] >= t, in order, into out (room for n + 8);
 * returns their count. Eight at a time: a vector compare makes a mask, lut[mask] its set
 * places, all eight stored and the count moved on by the mask's popcount (no branch). */
static int left_pack(const uint32_t *values, int n, uint32_t t, int16_t *out, struct scratch *s) {
    int c = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        unsigned m = 0;
        for (int j = 0; j < 8; j++) m |= (unsigned)((int32_t)values[i + j] >= (int32_t)t) << j;
        const uint8_t *p = s->lut[m];
        for (int j = 0; j < 8; j++) out[c + j] = (int16_t)(i + p[j]);
        c += __builtin_popcount(m);
    }
    for (; i < n; i++) {
        out[c] = (int16_t)i;
        c += values[i] >= t;
    }
    return c;
}

/* The places of the k largest of mags[0..chunk) (ties: the lower index) into out (in the
 * groups' order); returns the largest magnitude. Candidates are the elements at or above a
 * bound of the k-th: with few groups at or above bin_floor of the groups' maxima, their
 * members; otherwise the k-th's bin found by counting. A histogram of the candidates'
 * top 11 bits, then of the next 8 within the k-th's bin, leaves a handful of members for a
 * quickselect of (magnitude, index) keys. Appends are branch-free (written, then counted
 * when kept): the kept share is often far from 0 or 1. */
static uint32_t select_chunk(const uint32_t *mags, int chunk, int k, struct scratch *s, int16_t *out) {
    const int width = (chunk + GROUP - 1) / GROUP;
    uint32_t top = 0;
    if (k >= chunk) {  /* all of it */
        for (int i = 0; i < chunk; i++) {
            out[i] = (int16_t)i;
            top = mags[i] > top ? mags[i] : top;
        }
        return top;
    }
    memset(s->gmax, 0, sizeof(uint32_t) * width);
    for (int g = 0; g < GROUP; g++) {
        int start = g * width, stop = start + width < chunk ? start + width : chunk;
        uint32_t *gm = s->gmax - start;
        for (int i = start; i < stop; i++) gm[i] = mags[i] > gm[i] ? mags[i] : gm[i];
    }
    for (int j = 0; j < width; j++) top = s->gmax[j] > top ? s->gmax[j] : top;  /* the chunk's largest */
    uint32_t threshold = k <= width ? bin_floor(s->gmax, width, k, top, s->bins) : 0;
    int n = 0;
    if (4 * k <= width) {  /* few groups reach the bound: scan only theirs */
        int groups = left_pack(s->gmax, width, threshold, s->groups, s);
        for (int q = 0; q < groups; q++) {
            for (int i = s->groups[q]; i < chunk; i += width) {
                s->where[n] = (int16_t)i;
                n += mags[i] >= threshold;
            }
        }
    } else {  /* most do: find the k-th's bin by counting (a vector loop), then take the chunk's */
        int lo = (int)(threshold >> SHIFT), hi = (int)(top >> SHIFT) + 1;  /* count(lo) >= k > count(hi) */
        while (hi - lo > 1) {
            int mid = (lo + hi) / 2;
            if (count_at_least(mags, chunk, (uint32_t)mid << SHIFT) >= k) lo = mid;
            else hi = mid;
        }
        n = left_pack(mags, chunk, (uint32_t)lo << SHIFT, s->where, s);
    }
    for (int m = 0; m < n; m++) s->bins[mags[s->where[m]] >> SHIFT]++;
    int b = (int)(top >> SHIFT), above = 0;
    for (; b > 0 && above + s->bins[b] < k; b--) above += s->bins[b];
    int members = 0, finest = 0;
    for (int m = 0; m < n; m++) {
        int j = s->where[m];
        s->bins[mags[j] >> SHIFT] = 0;
        s->inbin[members] = (int16_t)j;
        members += (int)(mags[j] >> SHIFT) == b;
    }
    for (int q = 0; q < members; q++) {
        int f = (int)(mags[s->inbin[q]] >> FINE) & 255;
        s->fine[f]++;
        finest = f > finest ? f : finest;
    }
    int f = finest;
    for (; f > 0 && above + s->fine[f] < k; f--) above += s->fine[f];
    int last = 0;
    for (int q = 0; q < members; q++) {
        int j = s->inbin[q], fj = (int)(mags[j] >> FINE) & 255;
        s->fine[fj] = 0;
        s->keys[last] = key_of(mags[j], j);
        last += fj == f;
    }
    uint64_t kth = kth_largest(s->keys, last, k - above);
    const uint32_t coarse = ((uint32_t)b << 8) | (uint32_t)f;  /* the k-th's top 19 bits */
    int kept = 0;
    for (int m = 0; m < n; m++) {
        int j = s->where[m];
        uint32_t cj = mags[j] >> FINE;
        s->kept[kept] = (int16_t)j;
        kept += (cj > coarse) | ((cj == coarse) & (key_of(mags[j], j) >= kth));
    }
    memcpy(out, s->kept, sizeof(int16_t) * k);
    return top;
}

/* Bytes of the scratch space shm_topk_encode_f32 needs (zeroed once by its owner). */
int64_t shm_topk_scratch_bytes(void) { return (int64_t)sizeof(struct scratch); }

/* Encode `chunks` chunks of `chunk` floats of acc (after acc[0..numel) += delta when delta
 * is not NULL). scales: chunks floats (B < 32) or chunks*k values (B = 32); index:
 * chunks*k int16; packed: the codes' bytes (B < 32). With feedback, acc[kept] -= sent.
 * scratch: shm_topk_scratch_bytes() bytes, all zero the first time (its histogram is left
 * zero again), owned by the caller and used by one call at a time. */
void shm_topk_encode_f32(float *acc, const float *delta, int64_t numel, int chunk, int64_t chunks, int k,
                         int bits, float *scales, int16_t *index, uint8_t *packed, int feedback, void *scratch) {
    struct scratch *s = scratch;
    if (!s->ready) {
        for (int m = 0; m < 256; m++)
            for (int j = 0, c = 0; j < 8; j++)
                if (m >> j & 1) s->lut[m][c++] = (uint8_t)j;
        s->ready = 1;
    }
    uint32_t *mags = s->mags;
    const int qmax = bits < 32 ? (1 << (bits - 1)) - 1 : 0;
    const int per_byte = bits < 32 ? 8 / bits : 0;
    if (per_byte) memset(packed, 0, (size_t)((chunks * k + per_byte - 1) / per_byte));
    for (int64_t c = 0; c < chunks; c++) {
        float *a = acc + c * chunk;
        int64_t base = c * chunk;
        if (delta) {
            int64_t valid = numel - base < chunk ? numel - base : chunk;
            const float *d = delta + base;
            for (int i = 0; i < valid; i++) a[i] += d[i];
        }
        for (int i = 0; i < chunk; i++) mags[i] = mag_bits(a[i]);
        int16_t *idx = index + c * k;
        uint32_t top = select_chunk(mags, chunk, k, s, idx);
        float scale = 1.0f;
        if (qmax) {
            memcpy(&scale, &top, sizeof scale);
            scale = scale / (float)qmax;
            if (scale == 0.0f) scale = 1.0f;
            scales[c] = scale;
        }
        int64_t pos = c * (int64_t)k;
        for (int m = 0; m < k; m++) {
            int i = idx[m];
            float v = a[i], sent;
            if (qmax) {
                float q = nearbyintf(v / scale);
                q = q > (float)qmax ? (float)qmax : (q < (float)-qmax ? (float)-qmax : q);
                sent = q * scale;
                int64_t p = pos + m;
                packed[p / per_byte] |= (uint8_t)(((int)q + qmax) << ((p % per_byte) * bits));
            } else {
                sent = v;
                scales[pos + m] = v;
            }
            if (feedback) a[i] += -sent;
        }
    }
}
