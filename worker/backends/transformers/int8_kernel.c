/* Products of int8 weights (a float16 scale per 32 inputs of a row) with rows of activations,
 * for fast_weights.Int8Linear, in integer arithmetic: each activation row is rounded to
 * bfloat16 and quantized to 8 bits in blocks of 32 inputs first, and a block's 32 products are
 * summed as integers.
 *
 * An activation row, block b (inputs 32b to 32b + 31; the last block padded with zeros), of
 * x rounded to bfloat16 (to nearest, ties to even, as PyTorch converts):
 *   a = max |x|, d_b = a / 127, q = x · (127 / a) rounded to nearest (ties to even), kept
 *   within ±127 (a block of zeros gives zeros; a NaN in a block makes d_b NaN, an infinity
 *   makes it infinite: the outputs are not numbers then, as a float product's would not be).
 * A weight row r, block b: w ≈ s[r][b] · q (|q| ≤ 127, s a float16: fast_weights).
 * An output: out[i][r] = f, one chain of fused multiply-adds over the blocks in order,
 * starting from 0: f = fma(s[r][b] · d_b, S_b, f), the product rounded to float first, with
 * S_b = Σ_k q[r][k] · q_x[k] over the block, an exact integer (|S_b| ≤ 32 · 127 · 127, so its
 * float is exact too). Nothing else touches it, so an output depends on its activation row and
 * weight row alone, and its bits are the same however many rows a call has, whichever outputs
 * are computed beside it, on any thread, and in the vector code (AVX-512 VNNI, AVX2) and the
 * plain C alike (integer sums do not depend on their order; fmaf rounds once whatever the
 * compiler's contraction setting). That is what lets a position's numbers be independent of
 * the chunk or step it is computed in (fast_weights).
 *
 * The bfloat16 rounding first: where a model's other layers give a position other last bits in
 * a chunk than in a step (Qwen3.5's linear attention; PyTorch's operations against the native
 * pass), the rounding absorbs nearly all of them (a block's largest |x| would otherwise carry
 * them into d_b, and so into every output).
 *
 * Why integers: AVX-512 VNNI's vpdpbusd takes 64 byte products an instruction, where a float
 * kernel takes 16 multiply-adds an instruction plus the widening of every weight (what that
 * gives: bench/README.md, "Figures behind constants"). llama.cpp
 * multiplies its 8-bit weights (Q8_0: a scale per 32) with activations quantized the same way.
 *
 * Layout (fast_weights.Int8Linear): the rows are padded with zero rows to a multiple of
 * ITEM · PANEL and the inputs with zeros to a multiple of BLOCK; each panel of PANEL
 * consecutive rows stores, for each group of 4 inputs, the 4 weights of its 16 rows one row
 * after another, offset by 128 to unsigned bytes: packed[p][k / 4][j][k % 4] = q[p·PANEL + j][k]
 * + 128. One 64-byte load holds a group's weights for 16 rows, as vpdpbusd reads them
 * (unsigned weights times signed activations; the block's Σ 128 · q_x is taken off after). The
 * scales: scales[p][b][j] = s[p·PANEL + j][b].
 *
 * A work item is ITEM panels (64 rows), taken against up to MOST_ROWS activation rows at a
 * time, in tiles of P panels and R rows whose integer chains fit the registers (and their float
 * chains, up to 12). A step's few rows are shared among the threads in runs of half items (whole
 * items where a run holds them).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define WIDE 1 /* a panel's group of 4 inputs in one vector, summed by vpdpbusd */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define VECTOR 1
#endif

#define PANEL 16
#define ITEM 4       /* panels a work item takes */
#define BLOCK 32     /* inputs of an activation block (one scale) */
#define GROUPS 8     /* groups of 4 inputs in a block */
#define MOST_ROWS 8  /* activation rows taken against an item at once */
#define PART_ROWS 60 /* activation rows of a work unit */
#define OFFSET 128   /* added to the stored weights */
#define AHEAD 2048   /* bytes of a panel brought to L2 ahead of its products (WIDE) */

#ifdef _OPENMP
#include <omp.h>
static inline int64_t omp_threads(void) { return omp_get_num_threads(); }
static inline int64_t omp_thread(void) { return omp_get_thread_num(); }
#else
static inline int64_t omp_threads(void) { return 1; }
static inline int64_t omp_thread(void) { return 0; }
#endif

/* The quantized activation rows of a call: row i's bytes at q + i · padded, its blocks'
 * scales at d + i · blocks and their Σ 128 · q at offsets + i · blocks. */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *offsets;
    int64_t padded, blocks;
} activations;

/* Written so that GCC vectorizes it (fmaxf/fminf are library calls at -fno-fast-math): the
 * largest |x| as the largest of their bits (for numbers without a sign, the bits order as the
 * numbers do, and a NaN's are above infinity's, so a NaN in a block makes its scale NaN, and so
 * every output it feeds). */
static void quantize_row(const float *x, int64_t inputs, int64_t blocks, int8_t *q, float *d, int32_t *offsets) {
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b * BLOCK, count = inputs - first < BLOCK ? inputs - first : BLOCK;
        float block[BLOCK] = {0};
        memcpy(block, x + first, (size_t)count * sizeof(float));
        uint32_t bits[BLOCK], most = 0;
        memcpy(bits, block, sizeof bits);
        for (int k = 0; k < BLOCK; k++) {
            /* to bfloat16, to nearest, ties to even; a NaN stays a NaN (its quiet bit set) */
            const uint32_t nan = (bits[k] & 0x7FFFFFFFu) > 0x7F800000u;
            bits[k] = nan ? bits[k] | 0x00400000u : (bits[k] + 0x7FFFu + ((bits[k] >> 16) & 1u)) & 0xFFFF0000u;
            const uint32_t size = bits[k] & 0x7FFFFFFFu;
            most = size > most ? size : most;
        }
        memcpy(block, bits, sizeof block);
        float largest;
        memcpy(&largest, &most, sizeof largest);
        const float inverse = largest != 0.0f ? 127.0f / largest : 0.0f;
        int32_t whole[BLOCK], sum = 0;
        for (int k = 0; k < BLOCK; k++) {
            /* bounded, and a NaN taken to 0, so that the conversion is always defined; the
             * narrowing and the sum in a loop of their own, so that both loops vectorize */
            float v = nearbyintf(block[k] * inverse);
            v = v > 127.0f ? 127.0f : v;
            v = v < -127.0f ? -127.0f : v;
            whole[k] = (int32_t)(v == v ? v : 0.0f);
        }
        for (int k = 0; k < BLOCK; k++) {
            q[first + k] = (int8_t)whole[k];
            sum += whole[k];
        }
        d[b] = largest / 127.0f;
        offsets[b] = OFFSET * sum;
    }
}

#if !defined(WIDE)
/* Stores the PANEL outputs of a panel for one activation row: only the `columns` (at most
 * PANEL) that are real rows (the AVX-512 tile stores from its registers under a mask). */
static inline void store(const float *chains, float *out, int64_t columns) {
    if (columns > 0) memcpy(out, chains, (size_t)(columns < PANEL ? columns : PANEL) * sizeof(float));
}
#endif

#if defined(WIDE)
/* P panels (from `w`, their scales from `sw`) against R activation rows (row i from `first` + i):
 * P · R integer chains for a block, folded into P · R float chains, of 16 rows each (at 4 · 4,
 * the float chains wait in L1 between blocks: the integer ones take the registers).
 *
 * Where the tile is the first over its panels (`ahead`), each panel's lines AHEAD bytes on are
 * asked into L2 as the block is taken: the weights stream from memory once a step, and the
 * processor's own prefetching leaves the core waiting on them while it multiplies
 * (bench/README.md, "Figures behind constants"); one past the last panel never faults. */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, const _Float16 *sw, int64_t panel_bytes,
                                                      const activations *a, int64_t first, int P, int R, float *out,
                                                      int64_t outputs, int64_t columns, int ahead) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int c = 0; c < P * R; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->blocks; b++) {
        __m512i sums[16];
#pragma GCC unroll 16
        for (int c = 0; c < P * R; c++) sums[c] = _mm512_setzero_si512();
        const int8_t *x = a->q + first * a->padded + b * BLOCK;
        if (ahead)
#pragma GCC unroll 4
            for (int p = 0; p < P; p++)
#pragma GCC unroll 8
                for (int g = 0; g < GROUPS; g++)
                    _mm_prefetch((const char *)(w + p * panel_bytes + (b * GROUPS + g) * 64 + AHEAD), _MM_HINT_T1);
#pragma GCC unroll 8
        for (int g = 0; g < GROUPS; g++) {
            __m512i inputs[MOST_ROWS];
#pragma GCC unroll 8
            for (int i = 0; i < R; i++) {
                int32_t four;
                memcpy(&four, x + i * a->padded + 4 * g, sizeof four);
                inputs[i] = _mm512_set1_epi32(four);
            }
#pragma GCC unroll 4
            for (int p = 0; p < P; p++) {
                const __m512i weights = _mm512_loadu_si512((const void *)(w + p * panel_bytes + (b * GROUPS + g) * 64));
#pragma GCC unroll 6
                for (int i = 0; i < R; i++) sums[p * R + i] = _mm512_dpbusd_epi32(sums[p * R + i], weights, inputs[i]);
            }
        }
        __m512 scales[4];
#pragma GCC unroll 4
        for (int p = 0; p < P; p++)
            scales[p] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sw + (p * a->blocks + b) * PANEL)));
#pragma GCC unroll 6
        for (int i = 0; i < R; i++) {
            const int64_t at = (first + i) * a->blocks + b;
            const __m512i offset = _mm512_set1_epi32(a->offsets[at]);
            const __m512 d = _mm512_set1_ps(a->d[at]);
#pragma GCC unroll 4
            for (int p = 0; p < P; p++)
                acc[p * R + i] = _mm512_fmadd_ps(_mm512_mul_ps(scales[p], d),
                                                 _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[p * R + i], offset)),
                                                 acc[p * R + i]);
        }
    }
    /* stored straight from the registers, masked to the real rows (a copy between is slower) */
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        const int64_t real = columns - p * PANEL;
        const __mmask16 mask = real >= PANEL ? (__mmask16)0xFFFF : real > 0 ? (__mmask16)((1u << real) - 1) : 0;
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) _mm512_mask_storeu_ps(out + i * outputs + p * PANEL, mask, acc[p * R + i]);
    }
}
#elif defined(VECTOR)
/* P panels against R activation rows, P · R ≤ 3: each panel's 16 rows in two vectors of 8;
 * a weight byte takes its activation's sign so that vpmaddubsw multiplies |q_x| (unsigned)
 * by ±q (signed) without saturating (2 · 127 · 127 < 32768). */
static inline __attribute__((always_inline)) void tile(const uint8_t *w, const _Float16 *sw, int64_t panel_bytes,
                                                      const activations *a, int64_t first, int P, int R, float *out,
                                                      int64_t outputs, int64_t columns, int ahead) {
    (void)ahead;
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)OFFSET);
    __m256 acc[6];
#pragma GCC unroll 6
    for (int c = 0; c < 2 * P * R; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->blocks; b++) {
        __m256i sums[6];
#pragma GCC unroll 6
        for (int c = 0; c < 2 * P * R; c++) sums[c] = _mm256_setzero_si256();
        const int8_t *x = a->q + first * a->padded + b * BLOCK;
#pragma GCC unroll 8
        for (int g = 0; g < GROUPS; g++) {
            __m256i inputs[3], sizes[3];
#pragma GCC unroll 3
            for (int i = 0; i < R; i++) {
                int32_t four;
                memcpy(&four, x + i * a->padded + 4 * g, sizeof four);
                inputs[i] = _mm256_set1_epi32(four);
                sizes[i] = _mm256_sign_epi8(inputs[i], inputs[i]);
            }
#pragma GCC unroll 3
            for (int p = 0; p < P; p++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m256i weights = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(w + p * panel_bytes + (b * GROUPS + g) * 64 + 32 * h)), flip);
#pragma GCC unroll 3
                    for (int i = 0; i < R; i++) {
                        const __m256i pairs = _mm256_maddubs_epi16(sizes[i], _mm256_sign_epi8(weights, inputs[i]));
                        __m256i *chain = &sums[2 * (p * R + i) + h];
                        *chain = _mm256_add_epi32(*chain, _mm256_madd_epi16(pairs, ones));
                    }
                }
        }
#pragma GCC unroll 3
        for (int i = 0; i < R; i++) {
            const __m256 d = _mm256_set1_ps(a->d[(first + i) * a->blocks + b]);
#pragma GCC unroll 3
            for (int p = 0; p < P; p++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const int c = 2 * (p * R + i) + h;
                    const __m256 scales =
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sw + (p * a->blocks + b) * PANEL + 8 * h)));
                    acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(scales, d), _mm256_cvtepi32_ps(sums[c]), acc[c]);
                }
        }
    }
    float chains[PANEL];
#pragma GCC unroll 3
    for (int p = 0; p < P; p++)
#pragma GCC unroll 3
        for (int i = 0; i < R; i++) {
            _mm256_storeu_ps(chains, acc[2 * (p * R + i)]);
            _mm256_storeu_ps(chains + 8, acc[2 * (p * R + i) + 1]);
            store(chains, out + i * outputs + p * PANEL, columns - p * PANEL);
        }
}
#else
static void tile(const uint8_t *w, const _Float16 *sw, int64_t panel_bytes, const activations *a, int64_t first,
                 int P, int R, float *out, int64_t outputs, int64_t columns, int ahead) {
    (void)ahead;
    for (int p = 0; p < P; p++)
        for (int i = 0; i < R; i++) {
            float chains[PANEL];
            for (int j = 0; j < PANEL; j++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < a->blocks; b++) {
                    int32_t sum = 0;
                    for (int k = 0; k < BLOCK; k++)
                        sum += ((int32_t)w[p * panel_bytes + (b * GROUPS + k / 4) * 64 + 4 * j + k % 4] - OFFSET) *
                               a->q[(first + i) * a->padded + b * BLOCK + k];
                    const float scale = (float)sw[(p * a->blocks + b) * PANEL + j] * a->d[(first + i) * a->blocks + b];
                    acc = fmaf(scale, (float)sum, acc);
                }
                chains[j] = acc;
            }
            store(chains, out + i * outputs + p * PANEL, columns - p * PANEL);
        }
}
#endif

/* `panels` panels (an item's ITEM, or half as many) against `rows` (1 to MOST_ROWS) activation
 * rows from `first`; `stream` where the panels come from memory (the first rows taken against
 * them), not from the core's cache. */
static void item_times(const uint8_t *w, const _Float16 *sw, const activations *a, int64_t first, int panels, int rows,
                       float *out, int64_t outputs, int64_t columns, int stream) {
    const int64_t panel_bytes = PANEL * a->padded, panel_scales = PANEL * a->blocks;
#define TILE(P, R, p, i)                                                                                         \
    tile(w + (p) * panel_bytes, sw + (p) * panel_scales, panel_bytes, a, first + (i), P, R,                      \
         out + (i) * outputs + (p) * PANEL, outputs, columns - (p) * PANEL, stream && (i) == 0)
    /* a constant P and R for each, so that the chains stay in registers */
#if defined(WIDE)
#define TILES(P)                                                                                                 \
    switch (rows) {                                                                                              \
    case 1: TILE(P, 1, 0, 0); break;                                                                             \
    case 2: TILE(P, 2, 0, 0); break;                                                                             \
    case 3: TILE(P, 3, 0, 0); break;                                                                             \
    case 4: TILE(P, 4, 0, 0); break;                                                                             \
    case 5: TILE(P, 3, 0, 0); TILE(P, 2, 0, 3); break;                                                           \
    case 6: TILE(P, 3, 0, 0); TILE(P, 3, 0, 3); break;                                                           \
    case 7: TILE(P, 4, 0, 0); TILE(P, 3, 0, 4); break;                                                           \
    default: TILE(P, 4, 0, 0); TILE(P, 4, 0, 4);                                                                \
    }
    /* Past 4 rows, two tiles of all the panels (the item's weights read again from the core's
     * cache) rather than half the panels against all of them; 4 rows in one tile rather than two
     * of 2. Both the faster for steps (bench/README.md, "Figures behind constants"). */
    if (panels == ITEM) {
        TILES(ITEM)
    } else {
        TILES(ITEM / 2)
    }
#undef TILES
#elif defined(VECTOR)
    for (int p = 0; p < panels && p * PANEL < columns; p++) switch (rows) {
        case 1: TILE(1, 1, p, 0); break;
        case 2: TILE(1, 2, p, 0); break;
        case 3: TILE(1, 3, p, 0); break;
        case 4: TILE(1, 2, p, 0); TILE(1, 2, p, 2); break;
        case 5: TILE(1, 3, p, 0); TILE(1, 2, p, 3); break;
        case 6: TILE(1, 3, p, 0); TILE(1, 3, p, 3); break;
        case 7: TILE(1, 3, p, 0); TILE(1, 2, p, 3); TILE(1, 2, p, 5); break;
        default: TILE(1, 3, p, 0); TILE(1, 3, p, 3); TILE(1, 2, p, 6);
        }
#else
    TILE(panels, rows, 0, 0);
#endif
#undef TILE
}

/* Half items [lo, hi) against `n` activation rows: whole items where a pair of halves makes one. */
static void halves_times(const uint8_t *packed, const _Float16 *scales, const activations *a, int64_t lo, int64_t hi,
                         int64_t n, float *out, int64_t outputs) {
    const int64_t half_rows = ITEM / 2 * PANEL;
    while (lo < hi) {
        const int panels = lo % 2 == 0 && lo + 2 <= hi ? ITEM : ITEM / 2;
        const int64_t first = lo * half_rows;
        for (int64_t i = 0; i < n; i += MOST_ROWS)
            item_times(packed + first * a->padded, scales + first * a->blocks, a, i, panels,
                       (int)(n - i < MOST_ROWS ? n - i : MOST_ROWS), out + i * outputs + first, outputs, outputs - first,
                       i == 0);
        lo += panels / (ITEM / 2);
    }
}

/* out (n rows of `outputs` floats) = the n activation rows (`inputs` floats each, row i at
 * x + i · x_stride), quantized, times the packed weights' rows (`scales`: their blocks'
 * scales, as the layout above says). Work items are shared among `threads` OpenMP threads.
 * Returns 0, or 1 when there is no memory for the quantized rows. */
int lmw_int8_matmul(const uint8_t *packed, const _Float16 *scales, int64_t outputs, int64_t inputs, const float *x,
                    int64_t n, int64_t x_stride, float *out, int threads) {
    activations a;
    a.blocks = (inputs + BLOCK - 1) / BLOCK;
    a.padded = a.blocks * BLOCK;
    void *memory = malloc((size_t)(n * a.padded) + (size_t)(n * a.blocks) * (sizeof(float) + sizeof(int32_t)));
    if (memory == NULL) return 1;
    a.d = memory;
    a.offsets = (int32_t *)(a.d + n * a.blocks);
    a.q = (int8_t *)(a.offsets + n * a.blocks);
    const int64_t item_rows = ITEM * PANEL;
    /* A work unit: an item against up to PART_ROWS activation rows. A prompt's rows in parts
     * share 9 items (576 outputs) evenly between 2 threads, where whole items leave one idle
     * for a ninth of the time. */
    const int64_t items = (outputs + item_rows - 1) / item_rows, parts = (n + PART_ROWS - 1) / PART_ROWS;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++)
            quantize_row(x + i * x_stride, inputs, a.blocks, a.q + i * a.padded, a.d + i * a.blocks,
                         a.offsets + i * a.blocks);
        if (parts == 1) {
            /* A step's few rows: each thread a run of half items of its own. In whole items, SmolLM2's
             * products of 576 outputs (9 items) would leave one of 2 threads idle a fifth of the time. */
            const int64_t halves = 2 * items, share = omp_threads(), at = omp_thread();
            halves_times(packed, scales, &a, halves * at / share, halves * (at + 1) / share, n, out, outputs);
        } else {
#pragma omp for schedule(static)
            for (int64_t unit = 0; unit < items * parts; unit++) {
                const int64_t first = unit / parts * item_rows, end = (unit % parts + 1) * PART_ROWS;
                const int64_t columns = outputs - first < item_rows ? outputs - first : item_rows;
                const int64_t last = n < end ? n : end;
                for (int64_t i = unit % parts * PART_ROWS; i < last; i += MOST_ROWS)
                    item_times(packed + first * a.padded, scales + first * a.blocks, &a, i, ITEM,
                               (int)(last - i < MOST_ROWS ? last - i : MOST_ROWS), out + i * outputs + first, outputs,
                               columns, i == unit % parts * PART_ROWS);
            }
        }
    }
    free(memory);
    return 0;
}
