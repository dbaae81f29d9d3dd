/* Products of a gguf file's own quantized weights (Q4_1, Q8_0 blocks, unchanged) with rows of
 * float32 activations, computed as llama.cpp's CPU backend computes them, so a model run
 * with them gives llama.cpp's numbers for its matrix products. gguf_weights.py explains why
 * the worker needs that and how it builds this file (as exact_attention.c).
 *
 * The blocks (ggml's layout, 32 weights each, fp16 numbers little-endian):
 *   Q4_1: d, m, then 16 bytes: byte j holds weight j (low nibble) and j + 16 (high); w = d·q + m.
 *   Q8_0: d, then 32 signed bytes; w = d·q.
 * An activation row is quantized first, per block of 32, as llama.cpp's quantize_row_q8_1
 * (for Q4_1 weights) and quantize_row_q8_0 (for Q8_0) do on x86: a = max |x|, d = a / 127,
 * q = x · (127 / a) rounded to nearest, ties to even; d is kept as fp16, and for Q8_1 also
 * s = fp16(d · sum of q).
 * One output number, a dot product of a weight row with a quantized activation row, in
 * ggml_vec_dot_q4_1_q8_1's (and ggml_vec_dot_q8_0_q8_0's) order: per block, the 32 integer
 * products are summed in 8 lanes of 4 consecutive weights (exact, integers); lane k adds
 * fma(d_w · d_x, lane sum, acc[k]); Q4_1 also sums m_w · s_x over the blocks in order; then
 * ((acc4 + acc0) + (acc6 + acc2)) + ((acc5 + acc1) + (acc7 + acc3)), plus that sum.
 * So an output row depends on its activation row alone, however many rows a call has.
 * The vector code below (AVX2, its byte products summed by AVX512-VNNI's one instruction where
 * the processor has it) and the plain C beside it give the same bits; fmaf rounds once
 * whatever the compiler's contraction setting.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define VECTOR 1
#endif

#define BLOCK 32
#define Q4_1_BYTES 20
#define Q8_0_BYTES 34
#define ROWS_TOGETHER 16 /* weight rows one work item takes, against every activation row */

enum { Q4_1 = 3, Q8_0 = 8 }; /* ggml's type numbers */

typedef struct {
    float d, s;     /* fp16 values, widened */
    int8_t q[BLOCK];
} xblock;

static inline float half_to_float(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

static inline float rounded_to_half(float x) { return (float)(_Float16)x; }

static void quantize_row(const float *x, int64_t blocks, xblock *out) {
    for (int64_t b = 0; b < blocks; b++, x += BLOCK) {
        float largest = 0.0f;
        for (int i = 0; i < BLOCK; i++) { const float a = fabsf(x[i]); largest = a > largest ? a : largest; }
        const float d = largest / 127.0f;
        const float inverse = largest != 0.0f ? 127.0f / largest : 0.0f;
        int sum = 0;
        for (int i = 0; i < BLOCK; i++) {
            const int q = (int)nearbyintf(x[i] * inverse);
            out[b].q[i] = (int8_t)q;
            sum += q;
        }
        out[b].d = rounded_to_half(d);
        out[b].s = rounded_to_half(d * (float)sum);
    }
}

static inline float lanes_sum(const float acc[8]) {
    return ((acc[4] + acc[0]) + (acc[6] + acc[2])) + ((acc[5] + acc[1]) + (acc[7] + acc[3]));
}

#ifdef VECTOR
static inline float vector_sum(__m256 acc) {
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    return lanes_sum(lanes);
}
#endif

#ifdef VECTOR
/* One weight row against X activation rows (at most 4), each output with its own accumulators
 * fed in the order above: the weight block is unpacked once for all of them, and their X
 * accumulations are independent chains the processor overlaps. More weight rows at once were
 * slower inside the worker (up to three times for the output head; bench/README). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* The sums of 4 consecutive products of unsigned by signed bytes, in 32-bit lanes: one
 * instruction where the processor has it, else two (through 16-bit pair sums, which these
 * never saturate: 2 · 15 · 127 for Q4_1, 2 · 128 · 127 for Q8_0); the same integers. */
#define LANE_SUMS(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
#else
#define LANE_SUMS(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones)
#endif

static inline __attribute__((always_inline)) void row_times(int type, const uint8_t *w, const xblock *x,
                                                           int64_t blocks, int X, float *out, int64_t out_stride) {
    __m256 acc[4];
    float sum_m[4];
    for (int i = 0; i < X; i++) { acc[i] = _mm256_setzero_ps(); sum_m[i] = 0.0f; }
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones __attribute__((unused)) = _mm256_set1_epi16(1);
    const int64_t step = type == Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
    for (int64_t b = 0; b < blocks; b++, w += step) {
        __m256i qx[4];
        for (int i = 0; i < X; i++) qx[i] = _mm256_loadu_si256((const __m256i *)x[i * blocks + b].q);
        const float wd = half_to_float(w);
        if (type == Q4_1) {
            const float wm = half_to_float(w + 2);
            const __m128i packed = _mm_loadu_si128((const __m128i *)(w + 4));
            const __m256i qw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
            for (int i = 0; i < X; i++) {
                const xblock *xb = &x[i * blocks + b];
                sum_m[i] += wm * xb->s;
                const __m256 lanes = _mm256_cvtepi32_ps(LANE_SUMS(qw, qx[i]));
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(wd * xb->d), lanes, acc[i]);
            }
        } else {
            const __m256i qw = _mm256_loadu_si256((const __m256i *)(w + 2));
            const __m256i magnitude = _mm256_sign_epi8(qw, qw);
            for (int i = 0; i < X; i++) {
                /* |w| times x with w's sign: unsigned by signed bytes, as ggml does */
                const __m256 lanes = _mm256_cvtepi32_ps(LANE_SUMS(magnitude, _mm256_sign_epi8(qx[i], qw)));
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(wd * x[i * blocks + b].d), lanes, acc[i]);
            }
        }
    }
    for (int i = 0; i < X; i++) out[i * out_stride] = vector_sum(acc[i]) + sum_m[i];
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define WIDE 1
#define GROUP_ROWS 8 /* activation rows taken together: a pair of weight rows is unpacked once for 8 */
/* Two weight rows, r and r + 1, against X activation rows (2 to 8), in 512-bit registers:
 * the low half of each holds row r's 8 lanes, the high half row r + 1's, and the activation
 * block sits in both halves. Each output's lanes, products and order are row_times's; only
 * the work around them is shared by two rows and X activation rows (a block's scales, the
 * weights' unpacking). `s` holds, per block, the X rows' sums (Q4_1's s, zeros past X), so
 * that both rows' terms m_w · s_x are one multiply and one add for every activation row. */
static inline __attribute__((always_inline)) void row_pair_times(int type, const uint8_t *w, int64_t row_bytes,
                                                                const xblock *x, const float *s, int64_t blocks,
                                                                int X, float *out, int64_t out_stride) {
    __m512 acc[GROUP_ROWS];
    for (int i = 0; i < X; i++) acc[i] = _mm512_setzero_ps();
    __m512 sum_m = _mm512_setzero_ps(); /* lane i: row r with activation row i; lane 8 + i: row r + 1 */
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i twice = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);   /* [a, a, c, c] from [a, c] */
    const __m512i nibbles = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0); /* then the high nibbles of each second copy */
    const int64_t step = type == Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
    const uint8_t *w1 = w + row_bytes;
    for (int64_t b = 0; b < blocks; b++, w += step, w1 += step) {
        const __m512 wd = _mm512_insertf32x8(_mm512_set1_ps(half_to_float(w)), _mm256_set1_ps(half_to_float(w1)), 1);
        __m512i qw;
        __mmask64 negative = 0;
        if (type == Q4_1) {
            const __m512 wm = _mm512_insertf32x8(_mm512_set1_ps(half_to_float(w + 2)), _mm256_set1_ps(half_to_float(w1 + 2)), 1);
            sum_m = _mm512_add_ps(sum_m, _mm512_mul_ps(wm, _mm512_broadcast_f32x8(_mm256_loadu_ps(s + GROUP_ROWS * b))));
            const __m256i packed = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(w1 + 4)),
                                                    _mm_loadu_si128((const __m128i *)(w + 4)));
            qw = _mm512_and_si512(_mm512_srlv_epi64(_mm512_permutexvar_epi64(twice, _mm512_castsi256_si512(packed)), nibbles), low);
        } else {
            const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + 2))),
                                                 _mm256_loadu_si256((const __m256i *)(w1 + 2)), 1);
            negative = _mm512_movepi8_mask(q);
            qw = _mm512_abs_epi8(q); /* |w| times x with w's sign, as row_times (x is never -128) */
        }
        for (int i = 0; i < X; i++) {
            const xblock *xb = &x[i * blocks + b];
            __m512i qx = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)xb->q));
            if (type != Q4_1) qx = _mm512_mask_sub_epi8(qx, negative, _mm512_setzero_si512(), qx);
            const __m512 lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qw, qx));
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(wd, _mm512_set1_ps(xb->d)), lanes, acc[i]);
        }
    }
    float m[16], lanes[16];
    _mm512_storeu_ps(m, sum_m);
    for (int i = 0; i < X; i++) {
        _mm512_storeu_ps(lanes, acc[i]);
        out[i * out_stride] = lanes_sum(lanes) + m[i];
        out[i * out_stride + 1] = lanes_sum(lanes + 8) + m[8 + i];
    }
}
/* The Q4_1 sums s of each group of GROUP_ROWS activation rows (from row g), per block, side by
 * side, zeros past the last row: sums[g * blocks + GROUP_ROWS * b + k] is row g + k's. Made once
 * a call, for every work item. */
static void group_sums(const xblock *x, int64_t n, int64_t blocks, float *sums) {
    for (int64_t g = 0; g < n; g += GROUP_ROWS)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t k = 0; k < GROUP_ROWS; k++)
                sums[g * blocks + GROUP_ROWS * b + k] = g + k < n ? x[(g + k) * blocks + b].s : 0.0f;
}
#else
#define GROUP_ROWS 4
#endif

/* Weight rows [first, last) against activation rows [0, n), GROUP_ROWS activation rows at a
 * time; `sums` holds each group's Q4_1 sums as row_pair_times takes them (group_sums). */
static void rows_times(int type, const uint8_t *w, int64_t row_bytes, const xblock *x, const float *sums,
                       int64_t blocks, int64_t first, int64_t last, int64_t n, float *out, int64_t outputs) {
    for (int64_t i = 0; i < n; i += GROUP_ROWS) {
        const int64_t left = n - i < GROUP_ROWS ? n - i : GROUP_ROWS;
        const xblock *xs = x + i * blocks;
        int64_t r = first;
#ifdef WIDE
        /* Pairs of weight rows where there are several activation rows to share them (for one,
         * a pair's extra setup costs more than it saves). */
        const float *s = sums + i * blocks;
        for (; left > 1 && r + 1 < last; r += 2) {
            const uint8_t *row = w + r * row_bytes;
            float *o = out + i * outputs + r;
            switch (left) { /* a constant X for each, so that the accumulators stay in registers */
            case 8: row_pair_times(type, row, row_bytes, xs, s, blocks, 8, o, outputs); break;
            case 7: row_pair_times(type, row, row_bytes, xs, s, blocks, 7, o, outputs); break;
            case 6: row_pair_times(type, row, row_bytes, xs, s, blocks, 6, o, outputs); break;
            case 5: row_pair_times(type, row, row_bytes, xs, s, blocks, 5, o, outputs); break;
            case 4: row_pair_times(type, row, row_bytes, xs, s, blocks, 4, o, outputs); break;
            case 3: row_pair_times(type, row, row_bytes, xs, s, blocks, 3, o, outputs); break;
            default: row_pair_times(type, row, row_bytes, xs, s, blocks, 2, o, outputs);
            }
        }
#endif
        for (; r < last; r++) {
            const uint8_t *row = w + r * row_bytes;
            for (int64_t j = 0; j < left; j += 4) {
                float *o = out + (i + j) * outputs + r;
                switch (left - j < 4 ? left - j : 4) {
                case 4: row_times(type, row, xs + j * blocks, blocks, 4, o, outputs); break;
                case 3: row_times(type, row, xs + j * blocks, blocks, 3, o, outputs); break;
                case 2: row_times(type, row, xs + j * blocks, blocks, 2, o, outputs); break;
                default: row_times(type, row, xs + j * blocks, blocks, 1, o, outputs);
                }
            }
        }
    }
}
#else
#define GROUP_ROWS 1 /* the plain code takes activation rows one at a time */

static float dot_q4_1(const uint8_t *w, const xblock *x, int64_t blocks) {
    float sum_m = 0.0f;
    float acc[8] = {0};
    for (int64_t b = 0; b < blocks; b++, w += Q4_1_BYTES) {
        sum_m += half_to_float(w + 2) * x[b].s;
        const float scale = half_to_float(w) * x[b].d;
        for (int k = 0; k < 8; k++) {
            int lane = 0;
            for (int j = 4 * k; j < 4 * k + 4; j++) {
                const int q = j < 16 ? (w[4 + j] & 0x0F) : (w[4 + j - 16] >> 4);
                lane += q * x[b].q[j];
            }
            acc[k] = fmaf(scale, (float)lane, acc[k]);
        }
    }
    return lanes_sum(acc) + sum_m;
}

static float dot_q8_0(const uint8_t *w, const xblock *x, int64_t blocks) {
    float acc[8] = {0};
    for (int64_t b = 0; b < blocks; b++, w += Q8_0_BYTES) {
        const float scale = half_to_float(w) * x[b].d;
        const int8_t *q = (const int8_t *)(w + 2);
        for (int k = 0; k < 8; k++) {
            int lane = 0;
            for (int j = 4 * k; j < 4 * k + 4; j++) lane += q[j] * x[b].q[j];
            acc[k] = fmaf(scale, (float)lane, acc[k]);
        }
    }
    return lanes_sum(acc);
}

static void rows_times(int type, const uint8_t *w, int64_t row_bytes, const xblock *x, const float *sums,
                       int64_t blocks, int64_t first, int64_t last, int64_t n, float *out, int64_t outputs) {
    (void)sums; /* row_pair_times's, which this plain code has no use for */
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = first; r < last; r++)
            out[i * outputs + r] = type == Q4_1 ? dot_q4_1(w + r * row_bytes, x + i * blocks, blocks)
                                                : dot_q8_0(w + r * row_bytes, x + i * blocks, blocks);
}
#endif

/* out[i][r] = weight row r · x row i, for `outputs` weight rows of type `type` (Q4_1 or Q8_0)
 * and `n` activation rows of `inputs` floats each (a multiple of 32; row i at x + i *
 * x_stride); out is n rows of `outputs` floats. Work is shared among `threads` OpenMP
 * threads. Returns 0, 1 when there is no memory for the quantized rows, 2 for an unknown type. */
int lmw_gguf_matmul(int type, const uint8_t *weights, int64_t outputs, int64_t inputs, const float *x,
                    int64_t n, int64_t x_stride, float *out, int threads) {
    if (type != Q4_1 && type != Q8_0) return 2;
    const int64_t blocks = inputs / BLOCK;
    const int64_t row_bytes = blocks * (type == Q4_1 ? Q4_1_BYTES : Q8_0_BYTES);
    const int64_t grouped = (n + GROUP_ROWS - 1) / GROUP_ROWS * GROUP_ROWS;
    xblock *quantized = malloc((size_t)(n * blocks) * sizeof *quantized);
    float *sums = malloc((size_t)(grouped * blocks) * sizeof *sums);
    if (quantized == NULL || sums == NULL) {
        free(quantized);
        free(sums);
        return 1;
    }
    const int64_t items = (outputs + ROWS_TOGETHER - 1) / ROWS_TOGETHER;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) quantize_row(x + i * x_stride, blocks, quantized + i * blocks);
#ifdef WIDE
#pragma omp single
        group_sums(quantized, n, blocks, sums);
#endif
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const int64_t first = item * ROWS_TOGETHER;
            const int64_t last = first + ROWS_TOGETHER < outputs ? first + ROWS_TOGETHER : outputs;
            rows_times(type, weights, row_bytes, quantized, sums, blocks, first, last, n, out, outputs);
        }
    }
    free(quantized);
    free(sums);
    return 0;
}
