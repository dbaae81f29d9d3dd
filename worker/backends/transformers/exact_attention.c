/* Float32 attention whose every number is computed in one fixed order, whatever the shape
 * of the call: a query position's output depends only on its query and the keys and values
 * it attends to, not on how many positions are computed beside it, how many keys the cache
 * holds past its own, or how the work is split between threads. A prompt fed in chunks of
 * any size, a decode step and a prompt fed whole give a position the same bits.
 * exact_attention.py explains why the worker needs that and how it builds this file.
 *
 * For one query row attending keys lo..hi-1 (n = hi - lo of them):
 *   score[t]  = sum over d of q[d] * k[lo+t][d], d from 0 up, one rounding per operation;
 *   x[t]      = score[t] * scale; m = the largest x (exact whatever the order);
 *   p[t]      = exp(x[t] - m), exp being vexp below (the same function for every lane);
 *   l         = sum of p: lane t % 16 adds its p in order of t, then the 16 lane sums
 *               are added in a fixed tree (lanes i and i + 8, then i and i + 4, ...),
 *               whatever the vectors' width;
 *   out[d]    = (sum over t of p[t] * v[lo+t][d], t from 0 up) / l.
 * Vectors run across keys (scores) or across dimensions (the weighted sum), never across
 * the terms of one sum, so how rows and keys are blocked changes nothing, nor does the
 * vectors' width W: 16 floats where the processor has AVX-512, else 8 (a vector of 16 on AVX2
 * is two registers, which GCC moves through memory: bench/README.md, "Figures behind
 * constants"). Built with
 * -ffp-contract=off: no multiply and add is fused into one rounding anywhere, so every
 * machine that rounds IEEE single precision gives the same bits.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef W /* lanes of a vector (a test builds both widths and compares their bits) */
#if defined(__AVX512F__)
#define W 16
#else
#define W 8
#endif
#endif
#define SUM_LANES 16   /* lanes of the sum l, whatever W */
#define POSITIONS 16   /* query positions in one work item, at most */
/* Query rows whose scores are computed together, and rows a weighted sum of DV vectors takes at
 * once: as many as the registers hold (32 of 16 floats with AVX-512, 16 of 8 with AVX2). A
 * weighted sum takes a row's vectors SLICE at a time (fewer where dim / W is not a multiple). */
#define SCORE_ROWS (W == 16 ? 8 : 4)
#define SUM_ROWS(DV) (W == 16 ? ((DV) <= 4 ? 4 : 2) : ((DV) <= 2 ? 4 : (DV) == 4 ? 2 : 1))
#define SLICE 8
#define MOST_SUM_ROWS 4
#define MOST_GROUPS 64 /* query heads per key/value head */
#define VALUE_BLOCK 64 /* values an item's rows sum together (16 KB of 64 floats each) */
#define SPLIT_FROM 64  /* keys a step's item needs before its parts are shared (attend_split) */

typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
/* x in every lane, written out: GCC makes the loop form five shuffles, not one broadcast. */
static inline vf vsplat(float x) {
#if W == 16
    return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
    return (vf){x, x, x, x, x, x, x, x};
#endif
}
static inline vf vselect(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }

/* The first `count` lanes from p, the others `fill`. */
static inline vf vload_part(const float *p, int64_t count, float fill) {
    float lanes[W];
    for (int i = 0; i < W; i++) lanes[i] = i < count ? p[i] : fill;
    return vload(lanes);
}

/* exp(x) for x <= 0 (Cephes' expf: 2^n times a polynomial of the rest); 0 below -87. */
static inline vf vexp(vf x) {
    const vf low = vsplat(-87.0f);
    vi under = x < low;
    x = vselect(under, low, x);
    const vf magic = vsplat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = (x * vsplat(1.44269504088896341f) + magic) - magic;
    vf r = x - n * vsplat(0.693359375f);
    r = r - n * vsplat(-2.12194440e-4f);
    vf y = vsplat(1.9875691500e-4f);
    y = y * r + vsplat(1.3981999507e-3f);
    y = y * r + vsplat(8.3334519073e-3f);
    y = y * r + vsplat(4.1665795894e-2f);
    y = y * r + vsplat(1.6666665459e-1f);
    y = y * r + vsplat(5.0000001201e-1f);
    y = y * (r * r) + r + vsplat(1.0f);
    vi exponent = (__builtin_convertvector(n, vi) + 127) << 23;
    return vselect(under, vsplat(0.0f), y * (vf)exponent);
}

/* The sum of SUM_LANES lane sums, held in SUM_LANES / W vectors, in the fixed tree. */
static inline float lanes_sum(const vf *sums) {
    float lanes[SUM_LANES];
    for (int c = 0; c < SUM_LANES / W; c++) vstore(lanes + c * W, sums[c]);
    for (int width = SUM_LANES / 2; width > 0; width /= 2)
        for (int i = 0; i < width; i++) lanes[i] = lanes[i] + lanes[i + width];
    return lanes[0];
}

static inline float hmax(vf v) {
    float lanes[W], best;
    vstore(lanes, v);
    best = lanes[0];
    for (int i = 1; i < W; i++) best = lanes[i] > best ? lanes[i] : best;
    return best;
}

/* Keeps v in a register: GCC otherwise reads a tile's keys (a weighted sum's values) from memory
 * again for each row, into every multiply, and the loads, not the multiplies, then bound the
 * scores (the sums: a prompt's took 8.5% of Qwen2.5-Coder-0.5B's prefill, then 4.8%). */
#if defined(__x86_64__) && ((W == 8 && defined(__AVX__)) || (W == 16 && defined(__AVX512F__)))
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) (void)0
#endif

/* Scores of R (at most SCORE_ROWS) rows against two tiles of W keys whose dimensions `kt` holds
 * transposed (kt[d * W + key], the second tile dim * W floats on). R is a constant at each call
 * (scores_of): a step's item has a position's heads of one key/value head, 3 rows for SmolLM2,
 * and rows of zeros beside them would more than double the work. The next pair's lines are
 * asked into L2 as these are read: a step streams its keys from memory, and the processor's
 * own prefetching leaves it waiting (bench/README.md, "Figures behind constants"). A prefetch
 * past the end of the keys is harmless: it never faults. */
static inline __attribute__((always_inline)) void scores_of_tiles(int64_t dim, const float *kt, const float *const *rows,
                                                                  float *const *into, int R) {
    vf first[SCORE_ROWS], second[SCORE_ROWS];
    for (int r = 0; r < R; r++) first[r] = second[r] = vsplat(0.0f);
    for (int64_t d = 0; d < dim; d++) {
        __builtin_prefetch(kt + (2 * dim + d) * W, 0, 2);
        __builtin_prefetch(kt + (3 * dim + d) * W, 0, 2);
        vf keys = vload(kt + d * W), more = vload(kt + (dim + d) * W);
        IN_REGISTER(keys);
        IN_REGISTER(more);
        for (int r = 0; r < R; r++) {
            vf query = vsplat(rows[r][d]);
            first[r] = first[r] + keys * query;
            second[r] = second[r] + more * query;
        }
    }
    for (int r = 0; r < R; r++) {
        vstore(into[r], first[r]);
        vstore(into[r] + W, second[r]);
    }
}

/* scores_of_tiles for `count` rows, 1 to SCORE_ROWS. */
static void scores_of(int64_t dim, const float *kt, const float *const *rows, float *const *into, int count) {
    switch (count) {
    case 1: scores_of_tiles(dim, kt, rows, into, 1); break;
    case 2: scores_of_tiles(dim, kt, rows, into, 2); break;
    case 3: scores_of_tiles(dim, kt, rows, into, 3); break;
    case 4: scores_of_tiles(dim, kt, rows, into, 4); break;
#if SCORE_ROWS == 8
    case 5: scores_of_tiles(dim, kt, rows, into, 5); break;
    case 6: scores_of_tiles(dim, kt, rows, into, 6); break;
    case 7: scores_of_tiles(dim, kt, rows, into, 7); break;
#endif
    default: scores_of_tiles(dim, kt, rows, into, SCORE_ROWS);
    }
}

/* Turn a row's n scores into p in place; returns l, their sum. A last block of fewer than W
 * scores gives its missing lanes nothing (+0) to add. */
static float softmax_in_place(float *s, int64_t n, float scale) {
    const int64_t whole = n / W * W;
    vf best = vsplat(-__builtin_inff());
    for (int64_t t = 0; t < whole; t += W) {
        vf x = vload(s + t) * vsplat(scale);
        best = vselect(x > best, x, best);
    }
    if (whole < n) {
        vf x = vload_part(s + whole, n - whole, -__builtin_inff()) * vsplat(scale);
        best = vselect(x > best, x, best);
    }
    vf m = vsplat(hmax(best)), total[SUM_LANES / W]; /* lanes t % SUM_LANES, W at a time */
    for (int c = 0; c < SUM_LANES / W; c++) total[c] = vsplat(0.0f);
    for (int64_t t = 0; t < whole; t += W) {
        vf p = vexp(vload(s + t) * vsplat(scale) - m);
        total[t / W % (SUM_LANES / W)] = total[t / W % (SUM_LANES / W)] + p;
        vstore(s + t, p);
    }
    if (whole < n) {
        float lanes[W];
        /* Missing lanes start at -inf, which vexp takes to 0, as the loop below sets them. */
        vstore(lanes, vexp(vload_part(s + whole, n - whole, -__builtin_inff()) * vsplat(scale) - m));
        for (int i = n - whole; i < W; i++) lanes[i] = 0.0f;
        total[whole / W % (SUM_LANES / W)] = total[whole / W % (SUM_LANES / W)] + vload(lanes);
        memcpy(s + whole, lanes, (n - whole) * sizeof(float));
    }
    return lanes_sum(total);
}

/* The part t0 <= t < t1 of out[r] = sum over t < n[r] of p[r][t] * v[lo + t], t in order, for
 * up to NR = SUM_ROWS(DV) rows sharing lo; DV vectors a row. The sum so far is in out[r] (from
 * 0 where t0 is 0). The rows' common part is summed together, each rest alone. Fewer rows
 * than NR take a function of their own (R rows, a constant, so that their chains stay in
 * registers: a step's 3 rows of SmolLM2 summed one at a time would wait on each chain's
 * additions, and written into the function for NR rows they slow a prompt's sums). */
#define SUM_ROWS_OF(NAME, DV, R, ATTRIBUTE)                                                                   \
    static ATTRIBUTE void NAME(const float *v, int64_t vsj, int rows, float *const *p, const int64_t *n,      \
                               float *const *out, int64_t t0, int64_t t1) {                                   \
        vf acc[(R)][DV];                                                                                      \
        for (int r = 0; r < rows; r++)                                                                        \
            for (int c = 0; c < DV; c++) acc[r][c] = t0 == 0 ? vsplat(0.0f) : vload(out[r] + c * W);          \
        int64_t common = n[0];                                                                                \
        for (int r = 1; r < rows; r++) common = n[r] < common ? n[r] : common;                                \
        if (rows == (R)) {                                                                                    \
            for (int64_t t = t0; t < common && t < t1; t++) {                                                 \
                const float *vt = v + t * vsj;                                                                \
                for (int c = 0; c < DV; c++) {                                                                \
                    vf values = vload(vt + c * W);                                                            \
                    IN_REGISTER(values);                                                                      \
                    for (int r = 0; r < (R); r++) acc[r][c] = acc[r][c] + vsplat(p[r][t]) * values;           \
                }                                                                                             \
            }                                                                                                 \
        } else {                                                                                              \
            common = 0;                                                                                       \
        }                                                                                                     \
        for (int r = 0; r < rows; r++) {                                                                      \
            for (int64_t t = common > t0 ? common : t0; t < n[r] && t < t1; t++) {                            \
                const float *vt = v + t * vsj;                                                                \
                for (int c = 0; c < DV; c++) acc[r][c] = acc[r][c] + vsplat(p[r][t]) * vload(vt + c * W);     \
            }                                                                                                 \
            for (int c = 0; c < DV; c++) vstore(out[r] + c * W, acc[r][c]);                                   \
        }                                                                                                     \
    }
#define DEFINE_WEIGHTED_SUM(DV)                                                                               \
    SUM_ROWS_OF(two_rows_sum_##DV, DV, 2, __attribute__((noinline)))                                          \
    SUM_ROWS_OF(three_rows_sum_##DV, DV, 3, __attribute__((noinline)))                                        \
    SUM_ROWS_OF(rows_sum_##DV, DV, SUM_ROWS(DV), inline)                                                      \
    static void weighted_sum_##DV(const float *v, int64_t vsj, int rows, float *const *p, const int64_t *n,   \
                                  float *const *out, int64_t t0, int64_t t1) {                                \
        if (rows == 2 && SUM_ROWS(DV) > 2)                                                                    \
            two_rows_sum_##DV(v, vsj, rows, p, n, out, t0, t1);                                               \
        else if (rows == 3 && SUM_ROWS(DV) > 3)                                                               \
            three_rows_sum_##DV(v, vsj, rows, p, n, out, t0, t1);                                             \
        else                                                                                                  \
            rows_sum_##DV(v, vsj, rows, p, n, out, t0, t1);                                                   \
    }

DEFINE_WEIGHTED_SUM(1)
DEFINE_WEIGHTED_SUM(2)
DEFINE_WEIGHTED_SUM(4)
DEFINE_WEIGHTED_SUM(8)

/* The vectors of a row a weighted sum takes at once: SLICE, or fewer where they divide dim / W. */
static int64_t sum_slice(int64_t dim) {
    int64_t slice = SLICE;
    while ((dim / W) % slice) slice /= 2;
    return slice;
}

/* weighted_sum_S for each slice (sum_slice(dim) vectors) of the rows' vectors (every number's
 * sum the same either way). */
static void weighted_sum(int64_t dim, int64_t slice, const float *v, int64_t vsj, int rows, float *const *p,
                         const int64_t *n, float *const *out, int64_t t0, int64_t t1) {
    for (int64_t c = 0; c < dim; c += slice * W) {
        float *part[MOST_SUM_ROWS];
        for (int r = 0; r < rows; r++) part[r] = out[r] + c;
        switch (slice) {
        case 1: weighted_sum_1(v + c, vsj, rows, p, n, part, t0, t1); break;
        case 2: weighted_sum_2(v + c, vsj, rows, p, n, part, t0, t1); break;
        case 4: weighted_sum_4(v + c, vsj, rows, p, n, part, t0, t1); break;
        default: weighted_sum_8(v + c, vsj, rows, p, n, part, t0, t1);
        }
    }
}

/* Memory kept by a thread from one call to the next, grown as calls need: a fresh
 * allocation of a few megabytes costs more in page faults than a decode step's attention. */
struct room {
    float *data;
    int64_t floats;
};
static __thread struct room caller_room, thread_room, split_room;

static float *room(struct room *r, int64_t floats) {
    if (r->floats < floats) {
        free(r->data);
        r->data = malloc(sizeof(float) * floats);
        r->floats = r->data ? floats : 0;
    }
    return r->data;
}

/* One call's shapes and tensors (strides in floats; the last dimension of q, k, v contiguous).
 * Each batch entry's keys and values start at kb[b] and vb[b], heads kh[b] and vh[b] apart:
 * the sequences of a decode step keep them in buffers of their own. */
struct call {
    const float *q;
    const float *const *kb, *const *vb;
    const int64_t *kh, *vh;
    int64_t qsb, qsh, qsi, ksj, vsj;
    const int64_t *lo, *hi;
    int64_t *limit; /* per batch entry: the end of the keys its rows attend (run sets it) */
    float *out;
    int64_t heads, kv_heads, positions, dim, groups;
    float scale;
    float *kt;     /* the keys transposed, W at a time: kt[((b * kv_heads + kvh) * tiles + tile) * dim * W + d * W + j % W] */
    int64_t tiles; /* tiles of W keys per (b, kv head): up to the last key any row attends */
    /* Per batch entry, or NULL: where its keys are kept transposed from one call to the next
     * (0: nowhere, they go to kt), in kt's layout for each head, heads th[b] floats apart, the
     * first tv[b] keys already there (lmw_step_attention says more). */
    const int64_t *tb, *th, *tv;
    int64_t block, blocks; /* positions of a work item (run sets them), and the items of a (b, kv head) */
};

/* A thread's scratch space: scores (then p) of an item's rows, the rows' weighted sums. */
struct scratch {
    float *scores, *sums;
    int64_t span;
};

/* Shuffles for a W x W transpose: each stage swaps the off-diagonal blocks of 2s x 2s
 * blocks. GCC before 12 spells a two-vector shuffle __builtin_shuffle. */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif
#if W == 16
#define LOW_8(a, b) SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
#define HIGH_8(a, b) SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31)
#define LOW_4(a, b) SHUFFLE(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
#define HIGH_4(a, b) SHUFFLE(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31)
#define LOW_2(a, b) SHUFFLE(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
#define HIGH_2(a, b) SHUFFLE(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31)
#define LOW_1(a, b) SHUFFLE(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
#define HIGH_1(a, b) SHUFFLE(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31)
#define TRANSPOSE STAGE(8) STAGE(4) STAGE(2) STAGE(1)
#else
#define LOW_4(a, b) SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11)
#define HIGH_4(a, b) SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15)
#define LOW_2(a, b) SHUFFLE(a, b, 0, 1, 8, 9, 4, 5, 12, 13)
#define HIGH_2(a, b) SHUFFLE(a, b, 2, 3, 10, 11, 6, 7, 14, 15)
#define LOW_1(a, b) SHUFFLE(a, b, 0, 8, 2, 10, 4, 12, 6, 14)
#define HIGH_1(a, b) SHUFFLE(a, b, 1, 9, 3, 11, 5, 13, 7, 15)
#define TRANSPOSE STAGE(4) STAGE(2) STAGE(1)
#endif
#define STAGE(S)                                                        \
    for (int i = 0; i < W; i++)                                         \
        if (!(i & S)) {                                                 \
            vf low = LOW_##S(rows[i], rows[i + S]);                     \
            rows[i + S] = HIGH_##S(rows[i], rows[i + S]);               \
            rows[i] = low;                                              \
        }

/* Whether batch entry b keeps its keys transposed from one call to the next. */
static inline int kept(const struct call *c, int64_t b) { return c->tb != NULL && c->tb[b] != 0; }

/* Where the transposed keys of (b, kv head) begin. */
static inline float *transposed(const struct call *c, int64_t b, int64_t kvh) {
    if (kept(c, b)) return (float *)(intptr_t)c->tb[b] + kvh * c->th[b];
    return c->kt + (b * c->kv_heads + kvh) * c->tiles * c->dim * W;
}

/* Tile `tile` of the keys of (b, kv head) `pair`, transposed (moves only: the numbers are the
 * keys' own); keys past the last that b attends are 0 (their scores go unused), and tiles past
 * the one after it are left alone: b's items read none of them, and its buffers may end there
 * (a decode step's sequences hold positions of their own). Where b keeps its keys transposed,
 * the tiles of its first tv[b] keys are there already; the one they end in is done again, and
 * none where they are all there (tv[b] = n: lmw_step_attention wrote the last). */
static void transpose_tile(const struct call *c, int64_t pair, int64_t tile) {
    const int64_t b = pair / c->kv_heads, n = c->limit[b];
    if (tile > (n + W - 1) / W || (kept(c, b) && (tile < c->tv[b] / W || c->tv[b] >= n))) return;
    const float *keys = c->kb[b] + pair % c->kv_heads * c->kh[b];
    float *into = transposed(c, b, pair % c->kv_heads) + tile * c->dim * W;
    for (int64_t d = 0; d < c->dim; d += W) {
        vf rows[W];
        for (int j = 0; j < W; j++)
            rows[j] = tile * W + j < n ? vload(keys + (tile * W + j) * c->ksj + d) : vsplat(0.0f);
        TRANSPOSE
        for (int i = 0; i < W; i++) vstore(into + (d + i) * W, rows[i]);
    }
}

/* The range of keys the rows of item's positions attend together: [*low, *high). */
static void keys_of_item(const struct call *c, int64_t item, int64_t *low, int64_t *high) {
    int64_t b = item / (c->kv_heads * c->blocks), i0 = (item % c->blocks) * c->block;
    int64_t i1 = i0 + c->block < c->positions ? i0 + c->block : c->positions;
    *low = INT64_MAX, *high = 0;
    for (int64_t i = i0; i < i1; i++) {
        int64_t at = b * c->positions + i;
        if (c->hi[at] > c->lo[at]) {
            *low = c->lo[at] < *low ? c->lo[at] : *low;
            *high = c->hi[at] > *high ? c->hi[at] : *high;
        }
    }
}

/* The work item (b, kv head, block of c->block positions): every query head of that key/value
 * head, at those positions. Rows are ordered by position, then head: the heads of one position
 * attend the same keys. */
struct item {
    int64_t b, kvh, i0, start, first_tile, last_tile;
    int rows;
    const float *q[POSITIONS * MOST_GROUPS];
    int64_t lo[POSITIONS * MOST_GROUPS], n[POSITIONS * MOST_GROUPS];
};

/* Item `index`: its rows' queries, first keys and counts, and the tiles they attend. The item's
 * parts below are inlined where they are called: a prompt's attention is slower through calls. */
static inline __attribute__((always_inline)) void item_of(const struct call *c, int64_t index, struct item *it) {
    const int64_t groups = c->groups;
    int64_t low, high;
    it->b = index / (c->kv_heads * c->blocks), it->kvh = index / c->blocks % c->kv_heads;
    it->i0 = (index % c->blocks) * c->block;
    const int64_t i1 = it->i0 + c->block < c->positions ? it->i0 + c->block : c->positions;
    it->rows = (int)((i1 - it->i0) * groups);
    keys_of_item(c, index, &low, &high);
    for (int r = 0; r < it->rows; r++) {
        int64_t i = it->i0 + r / groups, h = it->kvh * groups + r % groups, at = it->b * c->positions + i;
        it->q[r] = c->q + it->b * c->qsb + h * c->qsh + i * c->qsi;
        it->lo[r] = c->lo[at];
        it->n[r] = c->hi[at] > c->lo[at] ? c->hi[at] - c->lo[at] : 0;
    }
    /* Tiles in pairs: the pair past the last tile attended may read one tile more, which the
     * transposed keys hold (zeros past the keys), and its scores go unused. */
    it->first_tile = low / W, it->last_tile = (high + W - 1) / W, it->start = it->first_tile * W;
}

/* The item's scores against the pairs of tiles from `from` up to `to` (tiles from its first). */
static inline __attribute__((always_inline)) void item_scores(const struct call *c, const struct item *it,
                                                              float *scores, int64_t span, int64_t from, int64_t to) {
    const float *kt = transposed(c, it->b, it->kvh);
    for (int64_t tile = it->first_tile + from; tile < it->first_tile + to && tile < it->last_tile; tile += 2)
        for (int r0 = 0; r0 < it->rows; r0 += SCORE_ROWS) {
            const int count = it->rows - r0 < SCORE_ROWS ? it->rows - r0 : SCORE_ROWS;
            float *into[SCORE_ROWS];
            for (int r = 0; r < count; r++) into[r] = scores + (r0 + r) * span + (tile * W - it->start);
            scores_of(c->dim, kt + tile * c->dim * W, it->q + r0, into, count);
        }
}

/* Where row r's p are among the item's scores (a row with no keys reads none). */
static inline float *row_p_of(const struct item *it, float *scores, int64_t span, int r) {
    return scores + r * span + (it->n[r] ? it->lo[r] - it->start : 0);
}

/* Row r's scores turned into p; returns their sum (0 for a row with no keys). */
static inline __attribute__((always_inline)) float item_softmax(const struct call *c, const struct item *it,
                                                               float *scores, int64_t span, int r) {
    return it->n[r] ? softmax_in_place(row_p_of(it, scores, span, r), it->n[r], c->scale) : 0.0f;
}

/* The rows' weighted sums, VALUE_BLOCK values at a time: every row takes a block while the
 * processor's cache holds it (a row's sum still runs over its values in order), divided by the
 * rows' totals into the call's output. `sums` holds dim floats a row. */
static inline __attribute__((always_inline)) void item_sums(const struct call *c, const struct item *it,
                                                            float *scores, int64_t span, float *sums, const float *totals) {
    const int64_t dim = c->dim, slice = sum_slice(dim);
    const int together = SUM_ROWS(slice);
    const float *values = c->vb[it->b] + it->kvh * c->vh[it->b];
    float *row_p[POSITIONS * MOST_GROUPS], *row_out[POSITIONS * MOST_GROUPS];
    int64_t most = 0;
    for (int r = 0; r < it->rows; r++) {
        row_p[r] = row_p_of(it, scores, span, r);
        row_out[r] = sums + r * dim;
        most = it->n[r] > most ? it->n[r] : most;
    }
    for (int64_t t0 = 0; t0 < (most ? most : 1); t0 += VALUE_BLOCK)
        for (int r0 = 0; r0 < it->rows;) {
            int count = 1;
            while (count < together && r0 + count < it->rows && it->lo[r0 + count] == it->lo[r0]) count++;
            weighted_sum(dim, slice, values + it->lo[r0] * c->vsj, c->vsj, count, row_p + r0, it->n + r0, row_out + r0,
                         t0, t0 + VALUE_BLOCK);
            r0 += count;
        }
    for (int r = 0; r < it->rows; r++) {
        int64_t i = it->i0 + r / c->groups, h = it->kvh * c->groups + r % c->groups;
        float *target = c->out + ((it->b * c->positions + i) * c->heads + h) * dim;
        for (int64_t d = 0; d < dim; d += W)
            vstore(target + d, it->n[r] ? vload(row_out[r] + d) / vsplat(totals[r]) : vsplat(0.0f));
    }
}

static void attend_item(const struct call *c, const struct scratch *s, int64_t index) {
    struct item it;
    float totals[POSITIONS * MOST_GROUPS];
    item_of(c, index, &it);
    item_scores(c, &it, s->scores, s->span, 0, it.last_tile - it.first_tile);
    for (int r = 0; r < it.rows; r++) totals[r] = item_softmax(c, &it, s->scores, s->span, r);
    item_sums(c, &it, s->scores, s->span, s->sums, totals);
}

/* A decode step of fewer items than twice the threads (one sequence: as many as its key/value
 * heads) would leave a thread idle a third of its attention or more; its items' scores are
 * shared in parts instead: each item's tiles in `threads` runs, then its rows' softmax, then
 * its weighted sums item by item, a barrier between (the same numbers: a score and a row's p
 * are each computed as they are whole). The sums are not split by dimensions too: each
 * thread's half of every value row would stream the row whole, slower for a step at 2,000
 * keys. `shared` holds
 * each item's scores (rows * span), sums (rows * dim) and totals (rows). */
static void attend_split(const struct call *c, int64_t items, int64_t span, float *shared, int threads) {
    const int64_t rows = c->groups, dim = c->dim, each = rows * span + rows * dim + rows;
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < items * threads; unit++) {
        struct item it;
        item_of(c, unit / threads, &it);
        const int64_t pairs = (it.last_tile - it.first_tile + 1) / 2, part = unit % threads;
        item_scores(c, &it, shared + unit / threads * each, span, 2 * (pairs * part / threads),
                    2 * (pairs * (part + 1) / threads));
    }
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < items * rows; unit++) {
        struct item it;
        item_of(c, unit / rows, &it);
        float *scores = shared + unit / rows * each;
        scores[rows * span + rows * dim + unit % rows] = item_softmax(c, &it, scores, span, (int)(unit % rows));
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < items; index++) {
        struct item it;
        item_of(c, index, &it);
        float *scores = shared + index * each;
        item_sums(c, &it, scores, span, scores + rows * span, scores + rows * span + rows * dim);
    }
}

/* The call's work: its keys transposed, then its items, shared among `threads` OpenMP threads
 * (where built with OpenMP: the runtime torch loaded, so its threads, already awake, take
 * them). Returns 0, or -1 when memory ran out. */
static int run(struct call *c, int64_t batch, int threads) {
    /* Blocks of POSITIONS positions, halved while they would leave threads without work to
     * share (a short question after a long cache: 10 positions, 3 key/value heads). A row's
     * numbers do not depend on the rows beside it. */
    c->block = POSITIONS;
    while (threads > 1 && c->block > 1 && batch * c->kv_heads * ((c->positions + c->block - 1) / c->block) < 4 * threads)
        c->block /= 2;
    c->blocks = (c->positions + c->block - 1) / c->block;
    const int64_t items = batch * c->kv_heads * c->blocks, pairs = batch * c->kv_heads, dim = c->dim;
    int64_t widest = 0, n = 0;
    for (int64_t i = 0; i < batch; i++) c->limit[i] = 0;
    for (int64_t item = 0; item < items; item++) {
        int64_t low, high, *limit = &c->limit[item / (c->kv_heads * c->blocks)];
        keys_of_item(c, item, &low, &high);
        *limit = high > *limit ? high : *limit;
        widest = high - low > widest ? high - low : widest;
        n = high > n ? high : n;
    }
    c->tiles = (n + W - 1) / W + 1;
    c->kt = room(&caller_room, pairs * c->tiles * dim * W);
    const int64_t span = (widest + W - 1) / W * W + 3 * W, rows = c->groups * POSITIONS;
    const int split = threads > 1 && c->positions == 1 && items < 2 * threads && widest >= SPLIT_FROM;
    float *shared = split ? room(&split_room, items * c->groups * (span + dim + 1)) : NULL;
    int failed = c->kt == NULL || (split && shared == NULL);
#pragma omp parallel num_threads(threads) if (threads > 1 && (items > 1 || split))
    {
        float *space = room(&thread_room, rows * span + rows * dim);
        if (space == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            struct scratch s = {space, space + rows * span, span};
#pragma omp for schedule(static)
            for (int64_t at = 0; at < pairs * c->tiles; at++) transpose_tile(c, at / c->tiles, at % c->tiles);
            if (split) {
                attend_split(c, items, span, shared, threads);
            } else {
#pragma omp for schedule(dynamic, 1)
                for (int64_t item = 0; item < items; item++) attend_item(c, &s, item);
            }
        }
    }
    return failed ? -1 : 0;
}

/* Where a call's batch entries start (kb, vb, kh, vh), where their keys end (limit, which run
 * fills) and how many are kept transposed (tv), `batch` entries each, in one allocation. */
struct bases {
    const float **kb, **vb;
    int64_t *kh, *vh, *limit, *tv;
};

static int bases_of(int64_t batch, struct bases *b) {
    void *memory = malloc(batch * (2 * sizeof(float *) + 4 * sizeof(int64_t)));
    b->kb = memory;
    b->vb = b->kb + batch;
    b->kh = (int64_t *)(b->vb + batch);
    b->vh = b->kh + batch;
    b->limit = b->vh + batch;
    b->tv = b->limit + batch;
    return memory != NULL;
}

/* Attention of query rows q[b, h, i] (b < batch, h < heads, i < positions) over keys and
 * values k[b, h / (heads / kv_heads), j], v[...]: row (b, i) attends keys lo[b*positions + i]
 * up to hi[...] (exclusive). Writes out[b, i, h, :] (contiguous). dim is a multiple of 16,
 * heads / kv_heads at most MOST_GROUPS. Returns 0, or -1 when memory ran out. */
int lmw_attention(const float *q, int64_t qsb, int64_t qsh, int64_t qsi, const float *k, int64_t ksb, int64_t ksh,
                  int64_t ksj, const float *v, int64_t vsb, int64_t vsh, int64_t vsj, const int64_t *lo,
                  const int64_t *hi, float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t positions,
                  int64_t dim, float scale, int threads) {
    struct bases b;
    if (!bases_of(batch, &b)) return -1;
    for (int64_t i = 0; i < batch; i++) {
        b.kb[i] = k + i * ksb, b.vb[i] = v + i * vsb;
        b.kh[i] = ksh, b.vh[i] = vsh;
    }
    struct call c = {q, b.kb, b.vb, b.kh, b.vh, qsb, qsh, qsi, ksj, vsj, lo, hi, b.limit, out,
                     heads, kv_heads, positions, dim, heads / kv_heads, scale, NULL, 0, NULL, NULL, NULL, 0, 0};
    int status = run(&c, batch, threads);
    free(b.kb);
    return status;
}

/* A decode step's attention for `batch` sequences of one new position each, whose keys and
 * values live in buffers of their own (rows of dim floats; each head's rows kh[b] and vh[b]
 * floats apart, from the addresses kb[b] and vb[b]). First each sequence's new key and value
 * (nk + b * nksb + h * nksh, nv likewise) are written at its position hi[b] - 1; then its
 * query rows q[b, h] attend keys lo[b] up to hi[b], as lmw_attention computes them. Writes
 * out[b, h, :]. Returns 0, or -1 when memory ran out.
 *
 * A step attends every key its sequence holds, and transposing them all again at every step
 * would be a large part of its attention at long contexts (bench/README.md, "Figures behind
 * constants"). So a sequence may keep them
 * transposed (tb, th, tc: NULL, or per sequence): from tb[b] (0: it does not), each head's
 * tiles th[b] floats apart (room for hi[b] + 2 * 16 keys), as many keys there already as the
 * int64 at tc[b] says (fewer than hi[b]); the call transposes the rest, up to hi[b] - 1, and
 * sets that count to hi[b]. A new key that joins a tile begun before is written into its lane
 * alone (a whole tile transposed again at every step is a visible part of the attention): the
 * lanes past it hold zeros, or keys cut off where the count was lowered, and their scores go
 * unused. The numbers are the same. */
int lmw_step_attention(const float *q, int64_t qsb, int64_t qsh, const float *nk, int64_t nksb, int64_t nksh,
                       const float *nv, int64_t nvsb, int64_t nvsh, const int64_t *kb, const int64_t *vb,
                       const int64_t *kh, const int64_t *vh, const int64_t *tb, const int64_t *th, const int64_t *tc,
                       const int64_t *lo, const int64_t *hi, float *out, int64_t batch, int64_t heads,
                       int64_t kv_heads, int64_t dim, float scale, int threads) {
    struct bases b;
    if (!bases_of(batch, &b)) return -1;
    for (int64_t i = 0; i < batch; i++) {
        b.kb[i] = (const float *)(intptr_t)kb[i], b.vb[i] = (const float *)(intptr_t)vb[i];
        b.kh[i] = kh[i], b.vh[i] = vh[i];
        b.tv[i] = tb != NULL && tb[i] != 0 ? *(const int64_t *)(intptr_t)tc[i] : 0;
        const int64_t last = hi[i] - 1;
        /* the new key joins a tile its earlier keys began: its lane alone */
        const int one_lane = tb != NULL && tb[i] != 0 && b.tv[i] == last && last % W != 0;
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *key = nk + i * nksb + h * nksh;
            memcpy((float *)b.kb[i] + h * kh[i] + last * dim, key, dim * sizeof(float));
            memcpy((float *)b.vb[i] + h * vh[i] + last * dim, nv + i * nvsb + h * nvsh, dim * sizeof(float));
            if (one_lane) {
                float *tile = (float *)(intptr_t)tb[i] + h * th[i] + last / W * dim * W + last % W;
                for (int64_t d = 0; d < dim; d++) tile[d * W] = key[d];
            }
        }
        if (one_lane) b.tv[i] = hi[i];
    }
    struct call c = {q, b.kb, b.vb, b.kh, b.vh, qsb, qsh, 0, dim, dim, lo, hi, b.limit, out,
                     heads, kv_heads, 1, dim, heads / kv_heads, scale, NULL, 0, tb, th, b.tv, 0, 0};
    int status = run(&c, batch, threads);
    for (int64_t i = 0; i < batch && status == 0; i++)
        if (kept(&c, i)) *(int64_t *)(intptr_t)tc[i] = hi[i];
    free(b.kb);
    return status;
}
