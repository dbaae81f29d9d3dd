/* Products of int8 weight rows (one float32 scale per row) with rows of activations, for
 * fast_weights.Int8Linear: out[i][r] = scale[r] · Σ_k b(x[i][k]) · q[r][k], where b(x) is x
 * rounded to bfloat16.
 *
 * Every output is one chain of fused multiply-adds over k = 0, 1, ..., inputs - 1 in order,
 * starting from 0, then one multiply by its row's scale. Nothing else touches it: no lanes
 * summed at the end, no split of k, so an output depends on its activation row and weight
 * row alone, and its bits are the same however many rows a call has, whichever outputs are
 * computed beside it, on any thread, and in the vector code (AVX-512, AVX2) and the plain C alike
 * (fmaf rounds once whatever the compiler's contraction setting). That is what lets a
 * position's numbers be independent of the chunk or step it is computed in (fast_weights).
 *
 * The inputs are rounded to bfloat16 first, as PyTorch's int8 kernel (the worker's before
 * this one) needed them: where a model's other layers give a position other last bits in a
 * chunk than in a step (Qwen3.5's linear attention), the rounding absorbs nearly all of them.
 *
 * Layout (fast_weights.Int8Linear): the rows are padded with zero rows to a multiple of
 * ITEM · PANEL, and each panel of PANEL consecutive rows is stored input-major,
 * packed[p][k][j] = q[p · PANEL + j][k], so one 16-byte load holds input k of 16 rows: the
 * outer product of an activation with it feeds 16 chains at once.
 *
 * A work item is ITEM panels (64 rows). With AVX2 (16 registers of 8 floats), against one
 * activation row it takes the 4 panels together (8 independent chains of vectors, enough to
 * hide a multiply-add's latency); against two, pairs of panels; against 3 to 6 rows, a panel
 * at a time, so that a panel's weights are widened to floats once for up to 6 rows (prompts:
 * the products are then bound by the multiply-adds, not by reading and widening the weights).
 * With AVX-512 (32 registers of 16 floats) a panel is one vector, and the item's 4 panels are
 * taken against up to 6 rows at once (24 chains), each panel widened once for all of them:
 * 1.1-1.25 times as fast as the AVX2 code for 1 to 8 rows on an AMD EPYC with AVX-512, where
 * widening the weights, not the multiply-adds, had bound 4 rows. The same chains, the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 1
#endif
#if defined(__AVX512F__) && defined(VECTOR)
#define WIDE 1 /* a panel in one vector */
#endif

#define PANEL 16
#define ITEM 4      /* panels a work item takes */
#define MOST_ROWS 6 /* activation rows taken against a panel at once */
#define PART_ROWS 60 /* activation rows of a work unit (a multiple of MOST_ROWS) */

/* Stores the PANEL outputs of a panel for one activation row: scaled, and only the `columns`
 * (at most PANEL) that are real rows. */
static inline void store(const float *chains, const float *scale, float *out, int64_t columns) {
    if (columns <= 0) return; /* a panel of padding rows */
    float scaled[PANEL];
    for (int j = 0; j < PANEL; j++) scaled[j] = chains[j] * scale[j];
    memcpy(out, scaled, (size_t)(columns < PANEL ? columns : PANEL) * sizeof(float));
}

#if defined(WIDE)
/* The item's ITEM panels against R activation rows (R <= MOST_ROWS): ITEM · R chains of 16. */
static inline __attribute__((always_inline)) void wide_tile(const int8_t *w, int64_t inputs, const float *x,
                                                           int64_t x_stride, int R, const float *scale, float *out,
                                                           int64_t outputs, int64_t columns) {
    const int64_t panel_bytes = PANEL * inputs;
    __m512 acc[ITEM * MOST_ROWS]; /* panel p, row i: acc[p * R + i] */
#pragma GCC unroll 24
    for (int c = 0; c < ITEM * R; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < inputs; k++) {
#pragma GCC unroll 4
        for (int p = 0; p < ITEM; p++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(w + p * panel_bytes + PANEL * k));
            const __m512 weights = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
#pragma GCC unroll 6
            for (int i = 0; i < R; i++)
                acc[p * R + i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * x_stride + k]), weights, acc[p * R + i]);
        }
    }
    float chains[PANEL];
#pragma GCC unroll 4
    for (int p = 0; p < ITEM; p++)
#pragma GCC unroll 6
        for (int i = 0; i < R; i++) {
            _mm512_storeu_ps(chains, acc[p * R + i]);
            store(chains, scale + p * PANEL, out + i * outputs + p * PANEL, columns - p * PANEL);
        }
}

/* The item's ITEM panels against `rows` (1 to MOST_ROWS) activation rows. */
static void item_times(const int8_t *w, int64_t inputs, const float *x, int64_t x_stride, int rows,
                       const float *scale, float *out, int64_t outputs, int64_t columns) {
    /* a constant R for each, so that the chains stay in registers */
    switch (rows) {
    case 1: wide_tile(w, inputs, x, x_stride, 1, scale, out, outputs, columns); break;
    case 2: wide_tile(w, inputs, x, x_stride, 2, scale, out, outputs, columns); break;
    case 3: wide_tile(w, inputs, x, x_stride, 3, scale, out, outputs, columns); break;
    case 4: wide_tile(w, inputs, x, x_stride, 4, scale, out, outputs, columns); break;
    case 5: wide_tile(w, inputs, x, x_stride, 5, scale, out, outputs, columns); break;
    default: wide_tile(w, inputs, x, x_stride, 6, scale, out, outputs, columns);
    }
}
#elif defined(VECTOR)
/* P panels (from `w`) against R activation rows (from `x`), P · R ≤ 6: 2 · P · R chains of 8. */
static inline __attribute__((always_inline)) void tile(const int8_t *w, int64_t panel_bytes, int64_t inputs,
                                                      const float *x, int64_t x_stride, int P, int R,
                                                      const float *scale, float *out, int64_t outputs,
                                                      int64_t columns) {
    __m256 acc[2 * MOST_ROWS]; /* panel p, row i: acc[2 * (p * R + i)] and the one after (a flat array stays in registers) */
#pragma GCC unroll 12
    for (int c = 0; c < 2 * P * R; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < inputs; k++) {
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            const int8_t *q = w + p * panel_bytes + PANEL * k;
            const __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
            const __m256 high = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8))));
#pragma GCC unroll 6
            for (int i = 0; i < R; i++) {
                const __m256 a = _mm256_broadcast_ss(x + i * x_stride + k);
                __m256 *chain = &acc[2 * (p * R + i)];
                chain[0] = _mm256_fmadd_ps(a, low, chain[0]);
                chain[1] = _mm256_fmadd_ps(a, high, chain[1]);
            }
        }
    }
    float chains[PANEL];
#pragma GCC unroll 4
    for (int p = 0; p < P; p++)
#pragma GCC unroll 6
        for (int i = 0; i < R; i++) {
            _mm256_storeu_ps(chains, acc[2 * (p * R + i)]);
            _mm256_storeu_ps(chains + 8, acc[2 * (p * R + i) + 1]);
            store(chains, scale + p * PANEL, out + i * outputs + p * PANEL, columns - p * PANEL);
        }
}

/* The item's ITEM panels against `rows` (1 to MOST_ROWS) activation rows. */
static void item_times(const int8_t *w, int64_t inputs, const float *x, int64_t x_stride, int rows,
                       const float *scale, float *out, int64_t outputs, int64_t columns) {
    const int64_t panel_bytes = PANEL * inputs;
#define TILE(P, R, p) tile(w + (p) * panel_bytes, panel_bytes, inputs, x, x_stride, P, R, scale + (p) * PANEL, \
                           out + (p) * PANEL, outputs, columns - (p) * PANEL)
    switch (rows) {
    case 1: TILE(4, 1, 0); break;
    case 2: TILE(2, 2, 0); TILE(2, 2, 2); break;
    /* a constant R for each, so that the chains stay in registers */
    case 3: for (int p = 0; p < ITEM && p * PANEL < columns; p++) TILE(1, 3, p); break;
    case 4: for (int p = 0; p < ITEM && p * PANEL < columns; p++) TILE(1, 4, p); break;
    case 5: for (int p = 0; p < ITEM && p * PANEL < columns; p++) TILE(1, 5, p); break;
    default: for (int p = 0; p < ITEM && p * PANEL < columns; p++) TILE(1, 6, p);
    }
#undef TILE
}
#else
static void item_times(const int8_t *w, int64_t inputs, const float *x, int64_t x_stride, int rows,
                       const float *scale, float *out, int64_t outputs, int64_t columns) {
    for (int p = 0; p < ITEM && p * PANEL < columns; p++)
        for (int i = 0; i < rows; i++) {
            float chains[PANEL];
            const int8_t *panel = w + p * PANEL * inputs;
            for (int j = 0; j < PANEL; j++) {
                float acc = 0.0f;
                for (int64_t k = 0; k < inputs; k++) acc = fmaf(x[i * x_stride + k], (float)panel[PANEL * k + j], acc);
                chains[j] = acc;
            }
            store(chains, scale + p * PANEL, out + i * outputs + p * PANEL, columns - p * PANEL);
        }
}
#endif

/* x rounded to bfloat16 (to nearest, ties to even, as PyTorch converts), kept as float32. */
static inline float bfloat16_rounded(float v) {
    if (v != v) return v; /* NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* out (n rows of `outputs` floats) = the n activation rows (`inputs` floats each, row i at
 * x + i · x_stride), rounded to bfloat16, times the packed weights' rows, scaled (`scale`: a
 * float per padded row). Work items are shared among `threads` OpenMP threads. Returns 0, or
 * 1 when there is no memory for the rounded rows. */
int lmw_int8_matmul(const int8_t *packed, const float *scale, int64_t outputs, int64_t inputs, const float *x,
                    int64_t n, int64_t x_stride, float *out, int threads) {
    float *rounded = malloc((size_t)(n * inputs) * sizeof *rounded);
    if (rounded == NULL) return 1;
    const int64_t item_rows = ITEM * PANEL;
    /* A work unit: an item against up to PART_ROWS activation rows. A prompt's rows in parts
     * share 9 items (576 outputs) evenly between 2 threads, where whole items leave one idle
     * for a ninth of the time. */
    const int64_t items = (outputs + item_rows - 1) / item_rows, parts = (n + PART_ROWS - 1) / PART_ROWS;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++)
            for (int64_t k = 0; k < inputs; k++) rounded[i * inputs + k] = bfloat16_rounded(x[i * x_stride + k]);
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < items * parts; unit++) {
            const int64_t first = unit / parts * item_rows, end = (unit % parts + 1) * PART_ROWS;
            const int64_t columns = outputs - first < item_rows ? outputs - first : item_rows;
            for (int64_t i = unit % parts * PART_ROWS; i < n && i < end; i += MOST_ROWS)
                item_times(packed + first * inputs, inputs, rounded + i * inputs, inputs,
                           (int)((n < end ? n : end) - i < MOST_ROWS ? (n < end ? n : end) - i : MOST_ROWS),
                           scale + first, out + i * outputs + first, outputs, columns);
        }
    }
    free(rounded);
    return 0;
}
