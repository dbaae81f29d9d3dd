/* Products of a gguf file's own weights (its blocks, unchanged) with rows of float32
 * activations, computed as llama.cpp's CPU backend computes them, so a model run with them
 * gives llama.cpp's numbers for its matrix products. gguf_weights.py explains why the worker
 * needs that and how it builds this file (as exact_attention.c).
 *
 * The blocks (ggml's layouts and type numbers; fp16 numbers little-endian; q an integer):
 *   Q4_0 (2),  18 bytes per 32: d, 16 bytes: byte j holds q_j (low nibble), q_{j+16} (high); w = d·(q − 8).
 *   Q4_1 (3),  20 bytes per 32: d, m, 16 bytes as Q4_0; w = d·q + m.
 *   Q5_0 (6),  22 bytes per 32: d, 4 bytes qh (bit j: q_j's fifth bit), 16 bytes as Q4_0; w = d·(q − 16).
 *   Q5_1 (7),  24 bytes per 32: d, m, qh, 16 bytes; w = d·q + m.
 *   Q8_0 (8),  34 bytes per 32: d, 32 signed bytes; w = d·q.
 *   Q4_K (12), 144 bytes per 256: d, dmin, 12 bytes of 6-bit scales sc_s and mins m_s of the
 *     8 sub-blocks of 32 (ggml's get_scale_min_k4), 128 bytes: 32-byte chunk c holds sub-block
 *     2c in its low nibbles, 2c + 1 in its high ones; w = d·sc_s·q − dmin·m_s.
 *   Q5_K (13), 176 bytes per 256: d, dmin, the 12 bytes of scales and mins, 32 bytes qh (bit s of
 *     byte l: the fifth bit of weight l of sub-block s), 128 bytes as Q4_K; w as Q4_K.
 *   Q6_K (14), 210 bytes per 256: 128 bytes low nibbles, 64 bytes high bit pairs, 16 signed
 *     8-bit scales of the 16 sub-blocks of 16, d; w = d·sc_s·(q − 32) (ggml's dequantize_row_q6_K).
 *   F32 (0), F16 (1), BF16 (30): one number a weight, widened to float32 exactly.
 *
 * Activation rows are quantized first as llama.cpp does on x86: per block of 32, as
 * quantize_row_q8_0 (for Q4_0, Q5_0, Q8_0) and quantize_row_q8_1 (for Q4_1, Q5_1): a = max |x|,
 * d = a / 127, q = x · (127 / a) rounded to nearest, ties to even; d kept as fp16, and for Q8_1
 * also s = fp16(d · sum of q); per block of 256 for the K types, as quantize_row_q8_K_ref: M the
 * first x of the largest |x|, i = −127 / M, q = min(127, round(i · x)), d = 1 / i (float32), and
 * the sums S_s of each 32 q. The float types' activations are taken as they are.
 *
 * One output, weight row · activation row, in ggml_vec_dot's AVX2 order (fmaf rounds once):
 * - The 32-blocks (ggml_vec_dot_q4_0_q8_0 and its kin): per block the 32 integer products
 *   q_w · q_x (q_w with Q4_0's and Q5_0's offsets taken off) are summed in 8 lanes of 4
 *   consecutive weights (exact integers); lane k = fmaf(d_w · d_x, (float)lane sum, lane k).
 *   Q4_1 and Q5_1 also sum m = m + m_w · s_x (a rounded product, then the sum) over the blocks
 *   in order. The result: ((acc4 + acc0) + (acc6 + acc2)) + ((acc5 + acc1) + (acc7 + acc3)),
 *   plus m for Q4_1 and Q5_1.
 * - The K types (ggml_vec_dot_q4_K_q8_K and its kin): per superblock, 8 lanes: lane k the exact
 *   integer sum over the positions p with (p mod 32) div 4 = k of sc(p) · q_w(p) · q_x(p) (sc(p)
 *   the scale of p's sub-block; Q6_K's q_w − 32); lane k = fmaf(d_x · d_w, (float)lane, lane k).
 *   Q4_K: 4 mins lanes, t = fmaf(−d_x · dmin_w, (float)(m_2t · S_2t + m_2t+1 · S_2t+1), t);
 *   Q5_K: one sum, m = m + (−d_x · dmin_w) · (float)(sum of m_s · S_s). The result: the 8 lanes'
 *   sum tree above, plus ((t0 + t2) + (t1 + t3)) for Q4_K, plus m for Q5_K.
 * - The float types: 16 lanes, lane k = fmaf(w_j, x_j, lane k) for the inputs j with j mod 16 =
 *   k, in input order; then s_k = l_k + l_k+8, t_k = s_k + s_k+4, u_k = t_k + t_k+2, u_0 + u_1.
 *   (Not llama.cpp's: it rounds the activations to F16 or BF16 first.)
 * So an output row depends on its activation row alone, however many rows a call has. The
 * vector code below (AVX-512, AVX2, their byte products summed by AVX512-VNNI's instructions
 * where the processor has them) and the plain C beside it give the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define VECTOR 1
#endif

#define INLINE static inline __attribute__((always_inline)) /* specialized where called with constants */
#define BLOCK 32
#define SUPER 256
#define ROWS_TOGETHER 16 /* weight rows one work item takes, against every activation row */
#define TILE_ROWS 16 /* activation rows row_tile_times takes at once (a prompt's) */

enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };

/* Bytes per block of a type (and its weights per block), 0 for a type this kernel does not take. */
static int block_bytes(int type, int *weights) {
    *weights = type == F32 || type == F16 || type == BF16   ? 1
               : type == Q4_K || type == Q5_K || type == Q6_K ? SUPER
                                                              : BLOCK;
    switch (type) {
    case F32: return 4;
    case F16: case BF16: return 2;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

typedef struct { /* an activation block of 32 (Q8_0, Q8_1) */
    float d, s;       /* fp16 values, widened */
    int8_t q[BLOCK];
    int32_t base[8];  /* −(the weights' offset) · (the sum of q's 4 inputs of each lane): see quantize_row */
} xblock;

/* Two activation rows' blocks b side by side (row_xpair_times): each 512-bit load holds the first
 * row's in its low half and the second's in its high half. */
typedef struct __attribute__((aligned(64))) {
    int8_t q[2 * BLOCK];
    int32_t base[16];
    float d[16]; /* each row's d, 8 times */
} xpair;

/* Sixteen activation rows' blocks b (row_tile_times), their lanes across the rows: q[g] holds
 * each row's 4 inputs of lane g (row i at byte 4i), base[g] each row's base of lane g. */
typedef struct __attribute__((aligned(64))) {
    float d[TILE_ROWS], s[TILE_ROWS];
    int8_t q[8][4 * TILE_ROWS];
    int32_t base[8][TILE_ROWS];
} xtile;

typedef struct __attribute__((aligned(32))) { /* an activation block of 256 (Q8_K) */
    int8_t q[SUPER];
    int16_t sums[8]; /* of each 32 q */
    float d;
} kblock;

/* Sixteen activation rows' superblock b (k_row_tile_times): q[s][l] holds each row's 4 inputs
 * 32s + 4l to 32s + 4l + 3 (row i at byte 4i), sums[t] each row's S_2t and S_2t+1 as two
 * 16-bit numbers (row i in 32-bit lane i). */
typedef struct __attribute__((aligned(64))) {
    float d[TILE_ROWS];
    int32_t sums[4][TILE_ROWS];
    int8_t q[8][8][4 * TILE_ROWS];
} ktile;

/* F16C's conversions where the processor has them: a processor with AVX512-FP16 otherwise gets
 * vcvtsh2ss and vcvtss2sh, which keep the rest of their target register, so each block's scale
 * waited on the last block's arithmetic (a Q5_0 row at one third of its speed on such a Xeon). */
static inline float half_to_float(const uint8_t *p) {
#ifdef VECTOR
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
#else
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
#endif
}

static inline float rounded_to_half(float x) {
#ifdef VECTOR
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph(_mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT)));
#else
    return (float)(_Float16)x;
#endif
}

static inline int has_min(int type) { return type == Q4_1 || type == Q5_1; }
/* What Q4_0's and Q5_0's stored (unsigned) weights are above the signed ones. */
static inline int signed_offset(int type) { return type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0; }

/* `offset`: the weights' signed_offset. The vector code multiplies their stored unsigned
 * weights and starts each lane's integer sum from `base`, so that the lane ends at the sum of
 * the signed weights' products, the same integer (no sign taken over into x for each row).
 * The AVX-512 forms below compute the same numbers 16 at a time: a largest |x| is the same
 * whatever the order it is looked for in (a NaN is passed over by both), and each q is one
 * product rounded to the nearest integer, ties to even. */
#if defined(VECTOR) && defined(__AVX512F__)
static inline __m512 magnitude16(const float *x) { return _mm512_abs_ps(_mm512_loadu_ps(x)); }
/* round(x · inverse) as 32-bit integers (the processor's default rounding: to nearest, ties to even) */
static inline __m512i rounded16(const float *x, float inverse) {
    return _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(inverse)));
}
#endif

static void quantize_row(const float *x, int64_t blocks, xblock *out, int offset) {
    for (int64_t b = 0; b < blocks; b++, x += BLOCK) {
#if defined(VECTOR) && defined(__AVX512F__)
        /* max(a, b) is b where a is a NaN: as the loop below, which never takes one */
        const float largest = _mm512_reduce_max_ps(_mm512_max_ps(magnitude16(x + 16), _mm512_max_ps(magnitude16(x), _mm512_setzero_ps())));
#else
        float largest = 0.0f;
        for (int i = 0; i < BLOCK; i++) { const float a = fabsf(x[i]); largest = a > largest ? a : largest; }
#endif
        const float d = largest / 127.0f;
        const float inverse = largest != 0.0f ? 127.0f / largest : 0.0f;
#if defined(VECTOR) && defined(__AVX512F__)
        const __m512i low = rounded16(x, inverse), high = rounded16(x + 16, inverse);
        _mm_storeu_si128((__m128i *)out[b].q, _mm512_cvtepi32_epi8(low));
        _mm_storeu_si128((__m128i *)(out[b].q + 16), _mm512_cvtepi32_epi8(high));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(low, high));
        /* each lane's 4 q summed (pairs of bytes times 1, then pairs of those) */
        const __m256i q = _mm256_loadu_si256((const __m256i *)out[b].q);
        const __m256i fours = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
        _mm256_storeu_si256((__m256i *)out[b].base, _mm256_mullo_epi32(fours, _mm256_set1_epi32(-offset)));
#else
        int sum = 0;
        for (int i = 0; i < BLOCK; i++) {
            const int q = (int)nearbyintf(x[i] * inverse);
            out[b].q[i] = (int8_t)q;
            sum += q;
        }
        for (int k = 0; k < 8; k++)
            out[b].base[k] = -offset * (out[b].q[4 * k] + out[b].q[4 * k + 1] + out[b].q[4 * k + 2] + out[b].q[4 * k + 3]);
#endif
        out[b].d = rounded_to_half(d);
        out[b].s = rounded_to_half(d * (float)sum);
    }
}

static void quantize_row_k(const float *x, int64_t supers, kblock *out) {
    for (int64_t b = 0; b < supers; b++, x += SUPER) {
        float largest = 0.0f, extreme = 0.0f;
#if defined(VECTOR) && defined(__AVX512F__)
        __m512 most = _mm512_setzero_ps();
        for (int c = 0; c < SUPER / 16; c++) most = _mm512_max_ps(magnitude16(x + 16 * c), most);
        largest = _mm512_reduce_max_ps(most);
        /* the first x of that magnitude, as the loop below finds it */
        for (int c = 0; c < SUPER / 16 && largest != 0.0f; c++) {
            const __mmask16 at = _mm512_cmp_ps_mask(magnitude16(x + 16 * c), _mm512_set1_ps(largest), _CMP_EQ_OQ);
            if (at) { extreme = x[16 * c + __builtin_ctz(at)]; break; }
        }
#else
        for (int i = 0; i < SUPER; i++) {
            const float a = fabsf(x[i]);
            if (a > largest) { largest = a; extreme = x[i]; }
        }
#endif
        memset(&out[b], 0, sizeof out[b]);
        if (largest == 0.0f) continue;
        const float inverse = -127.0f / extreme;
#if defined(VECTOR) && defined(__AVX512F__)
        for (int c = 0; c < SUPER / 16; c++) {
            const __m512i q = _mm512_min_epi32(rounded16(x + 16 * c, inverse), _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(out[b].q + 16 * c), _mm512_cvtepi32_epi8(q));
            out[b].sums[c / 2] += (int16_t)_mm512_reduce_add_epi32(q);
        }
#else
        for (int i = 0; i < SUPER; i++) {
            const int q = (int)nearbyintf(inverse * x[i]);
            out[b].q[i] = (int8_t)(q < 127 ? q : 127);
            out[b].sums[i / BLOCK] += out[b].q[i];
        }
#endif
        out[b].d = 1.0f / inverse;
    }
}

/* Q4_K's and Q5_K's 12 bytes as 8 scales then 8 mins, a byte each (llama.cpp's unpacking). */
static inline void scales_and_mins(const uint8_t *packed, uint32_t u[4]) {
    const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
    memcpy(u, packed, 12);
    u[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
    const uint32_t mins = u[1] & six;
    u[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);
    u[2] = mins;
    u[0] &= six;
}

static inline float lanes_sum(const float acc[8]) {
    return ((acc[4] + acc[0]) + (acc[6] + acc[2])) + ((acc[5] + acc[1]) + (acc[7] + acc[3]));
}

static inline float mins_sum(const float m[4]) { return (m[0] + m[2]) + (m[1] + m[3]); }

static inline float float_lanes_sum(const float l[16]) {
    float s[8], t[4];
    for (int k = 0; k < 8; k++) s[k] = l[k] + l[k + 8];
    for (int k = 0; k < 4; k++) t[k] = s[k] + s[k + 4];
    return (t[0] + t[2]) + (t[1] + t[3]);
}

/* Weight j of a float type's row, widened. */
static inline float widened(int type, const uint8_t *w, int64_t j) {
    if (type == F16) return half_to_float(w + 2 * j);
    float f;
    if (type == F32) {
        memcpy(&f, w + 4 * j, sizeof f);
    } else {
        const uint32_t bits = (uint32_t)(w[2 * j] | w[2 * j + 1] << 8) << 16;
        memcpy(&f, &bits, sizeof f);
    }
    return f;
}

/* The fmaf chains of the inputs past the last whole 16 (lane j mod 16), then the lanes' sum tree. */
static inline float float_tail(int type, const uint8_t *w, const float *x, int64_t from, int64_t inputs,
                               float lanes[16]) {
    for (int64_t j = from; j < inputs; j++) lanes[j & 15] = fmaf(widened(type, w, j), x[j], lanes[j & 15]);
    return float_lanes_sum(lanes);
}

#ifdef VECTOR
static inline float vector_sum(__m256 acc) {
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    return lanes_sum(lanes);
}

static inline float vector_mins_sum(__m128 acc) {
    float m[4];
    _mm_storeu_ps(m, acc);
    return mins_sum(m);
}

/* scales_and_mins in a register: bytes 0-7 the scales, 8-15 the mins. Written into memory as
 * four words and read back as one vector, they waited for a failed store forwarding (Q4_K's
 * one-row products at half their speed on an Intel Xeon). */
static inline __m128i scales_and_mins_vector(const uint8_t *packed) {
    uint32_t p[3];
    memcpy(p, packed, 12);
    const __m128i words = _mm_set_epi32(0, (int)p[2], (int)p[1], (int)p[0]);
    /* u0 = p0 & six, u1 = (p2 & four) | ((p0 >> 6) & two) << 4, u2 = p1 & six,
     * u3 = ((p2 >> 4) & four) | ((p1 >> 6) & two) << 4 */
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(words, _MM_SHUFFLE(2, 1, 2, 0)), _mm_set_epi32(4, 0, 0, 0)),
                                      _mm_set_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f));
    const __m128i high = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(words, _MM_SHUFFLE(1, 1, 0, 0)), 2),
                                       _mm_set_epi32(0x30303030, 0, 0x30303030, 0));
    return _mm_or_si128(low, high);
}

#define AHEAD 2048 /* bytes of a weight row asked into L2 ahead of its products */
/* On the first pass over its weights (`ahead`), a product asks the lines AHEAD bytes on into L2
 * as it takes a block: the weights stream from memory once a call, and the processor's own
 * prefetching leaves the core waiting on them while it multiplies (as in int8_kernel.c; what it
 * saves here: bench/README.md, "Figures behind constants"). A prefetch never faults, past the
 * last row included. Inlined always: as a plain inline function GCC 12 judged it free of effects
 * and dropped every call (tests/test_kernel_instructions.py). */
INLINE void ask_ahead(int ahead, const uint8_t *p, int64_t bytes) {
    if (ahead)
        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)(p + AHEAD + o), _MM_HINT_T1);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* The sums of 4 consecutive products of unsigned by signed bytes, in 32-bit lanes: one
 * instruction where the processor has it, else two (through 16-bit pair sums, which these
 * never saturate: 2 · 31 · 127 at most); the same integers. And the same for 16-bit pairs
 * times scales, added to the lanes. */
#define LANE_SUMS_FROM(base, u, s) _mm256_dpbusd_epi32(base, u, s)
#define SCALED_SUMS(acc, scale, pairs) _mm256_dpwssd_epi32(acc, scale, pairs)
#else
#define LANE_SUMS_FROM(base, u, s) _mm256_add_epi32(base, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define SCALED_SUMS(acc, scale, pairs) _mm256_add_epi32(acc, _mm256_madd_epi16(scale, pairs))
#endif

/* 16 packed bytes as 32: the low nibbles, then the high ones. */
static inline __m256i nibbles(const uint8_t *p) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
}

static inline uint32_t bits32(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, sizeof bits);
    return bits;
}

/* Byte j is 0x10 where bit j of the 32 bits at p is set: Q5_0's and Q5_1's fifth bits. */
static inline __m256i fifth_bits(const uint8_t *p) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8(bits32(p), _mm256_set1_epi8(0x10));
#else
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits32(p)),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0));
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe); /* every bit but byte j's bit j mod 8 */
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
#endif
}

/* A 32-block's weights as bytes, in order, as stored: Q8_0's signed, the others' unsigned (Q4_0's
 * and Q5_0's offsets are taken off through the activation's base). */
static inline __m256i block_weights(int type, const uint8_t *w) {
    switch (type) {
    case Q8_0: return _mm256_loadu_si256((const __m256i *)(w + 2));
    case Q4_0: return nibbles(w + 2);
    case Q4_1: return nibbles(w + 4);
    case Q5_0: return _mm256_or_si256(nibbles(w + 6), fifth_bits(w + 2));
    default: return _mm256_or_si256(nibbles(w + 8), fifth_bits(w + 4)); /* Q5_1 */
    }
}

/* One weight row against X activation rows (at most 4), each output with its own accumulators
 * fed in the order above: the weight block is unpacked once for all of them, and their X
 * accumulations are independent chains the processor overlaps. Not more weight rows at once:
 * they are slower inside the worker, most for the output head (bench/README.md, "Figures
 * behind constants"). */
INLINE void row_times(int type, const uint8_t *w, int64_t bytes, const xblock *x, int64_t blocks, int X, float *out,
                      int64_t out_stride, int ahead) {
    __m256 acc[4];
    float sum_m[4];
    for (int i = 0; i < X; i++) { acc[i] = _mm256_setzero_ps(); sum_m[i] = 0.0f; }
    for (int64_t b = 0; b < blocks; b++, w += bytes) {
        ask_ahead(ahead, w, bytes);
        __m256i qx[4];
        for (int i = 0; i < X; i++) qx[i] = _mm256_loadu_si256((const __m256i *)x[i * blocks + b].q);
        const float wd = half_to_float(w);
        const __m256 wds = _mm256_set1_ps(wd); /* times each row's d, broadcast from memory: one rounding, as wd · d */
        const __m256i qw = block_weights(type, w);
        if (has_min(type)) {
            const float wm = half_to_float(w + 2);
            for (int i = 0; i < X; i++) {
                const xblock *xb = &x[i * blocks + b];
                sum_m[i] += wm * xb->s;
                const __m256 lanes = _mm256_cvtepi32_ps(LANE_SUMS_FROM(_mm256_setzero_si256(), qw, qx[i]));
                acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(wds, _mm256_broadcast_ss(&xb->d)), lanes, acc[i]);
            }
        } else if (signed_offset(type)) {
            for (int i = 0; i < X; i++) {
                const xblock *xb = &x[i * blocks + b];
                const __m256i base = _mm256_loadu_si256((const __m256i *)xb->base);
                const __m256 lanes = _mm256_cvtepi32_ps(LANE_SUMS_FROM(base, qw, qx[i]));
                acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(wds, _mm256_broadcast_ss(&xb->d)), lanes, acc[i]);
            }
        } else {
            const __m256i magnitude = _mm256_sign_epi8(qw, qw);
            for (int i = 0; i < X; i++) {
                /* |w| times x with w's sign: unsigned by signed bytes, as ggml does */
                const __m256 lanes =
                    _mm256_cvtepi32_ps(LANE_SUMS_FROM(_mm256_setzero_si256(), magnitude, _mm256_sign_epi8(qx[i], qw)));
                acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(wds, _mm256_broadcast_ss(&x[i * blocks + b].d)), lanes, acc[i]);
            }
        }
    }
    for (int i = 0; i < X; i++)
        out[i * out_stride] = has_min(type) ? vector_sum(acc[i]) + sum_m[i] : vector_sum(acc[i]);
}

/* The mins of a K superblock for each activation row (Q4_K: 4 lanes; Q5_K: one sum), in the
 * order above. */
INLINE void add_mins(int type, __m128i mins, float wdmin, const kblock *xb, __m128 *acc_m, float *sum_m) {
    const __m128i products = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)xb->sums));
    const float dmin = -xb->d * wdmin;
    if (type == Q4_K) {
        *acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(products), *acc_m);
    } else {
        const __m128i pairs = _mm_add_epi32(products, _mm_unpackhi_epi64(products, products));
        *sum_m += dmin * (float)_mm_cvtsi128_si32(_mm_add_epi32(pairs, _mm_shuffle_epi32(pairs, 1)));
    }
}

static inline float k_result(int type, __m256 acc, __m128 acc_m, float sum_m) {
    return type == Q4_K   ? vector_sum(acc) + vector_mins_sum(acc_m)
           : type == Q5_K ? vector_sum(acc) + sum_m
                          : vector_sum(acc);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define WIDE 1
#define GROUP_ROWS 8 /* activation rows taken together: a weight block is unpacked once for 8 */

/* The activation rows [g, g + left) as pairs of rows (the last row twice where `left` is odd),
 * for row_xpair_times: pairs[p * blocks + b]; and their Q4_1 and Q5_1 sums s per block, side by
 * side, zeros past the last row: sums[GROUP_ROWS * b + k] is row g + k's. */
static void xpairs_of(const xblock *x, int64_t g, int64_t left, int64_t blocks, xpair *pairs, float *sums) {
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t p = 0; 2 * p < left; p++)
            for (int h = 0; h < 2; h++) {
                const xblock *xb = &x[(g + (2 * p + h < left ? 2 * p + h : 2 * p)) * blocks + b];
                xpair *out = &pairs[p * blocks + b];
                memcpy(out->q + BLOCK * h, xb->q, BLOCK);
                memcpy(out->base + 8 * h, xb->base, sizeof xb->base);
                for (int k = 0; k < 8; k++) out->d[8 * h + k] = xb->d;
            }
        for (int64_t k = 0; k < GROUP_ROWS; k++) sums[GROUP_ROWS * b + k] = k < left ? x[(g + k) * blocks + b].s : 0.0f;
    }
}

/* One weight row against X activation rows (2 to 8) as pairs (xpairs_of), in 512-bit registers:
 * the weight block sits in both halves, each half of a pair's register holds one activation
 * row's 8 lanes. Each output's lanes, products and order are row_times's, from one stream of
 * weights, with half row_times's instructions for the products around the integer ones (two
 * weight rows a register, the activation block in both halves, is as fast on weights in cache
 * and far slower on weights from memory: bench/README.md, "Figures behind constants"). */
INLINE void row_xpair_times(int type, const uint8_t *w, int64_t bytes, const xpair *x, const float *s, int64_t blocks,
                            int X, float *out, int64_t out_stride, int ahead) {
    __m512 acc[GROUP_ROWS / 2];
    __m256 sum_m = _mm256_setzero_ps(); /* lane i: m_w · s_x of row i, summed over the blocks (row_times's sum_m) */
    const int P = (X + 1) / 2;
    for (int p = 0; p < P; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, w += bytes) {
        ask_ahead(ahead, w, bytes);
        const __m512 wd = _mm512_set1_ps(half_to_float(w));
        __m512i q = _mm512_broadcast_i64x4(block_weights(type, w));
        __mmask64 negative = 0;
        if (type == Q8_0) {
            negative = _mm512_movepi8_mask(q);
            q = _mm512_abs_epi8(q); /* |w| times x with w's sign, as row_times (x is never -128) */
        }
        if (has_min(type))
            sum_m = _mm256_add_ps(sum_m, _mm256_mul_ps(_mm256_set1_ps(half_to_float(w + 2)), _mm256_loadu_ps(s + GROUP_ROWS * b)));
        for (int p = 0; p < P; p++) {
            const xpair *xb = &x[p * blocks + b];
            __m512i qx = _mm512_load_si512(xb->q);
            if (type == Q8_0) qx = _mm512_mask_sub_epi8(qx, negative, _mm512_setzero_si512(), qx);
            const __m512i base = signed_offset(type) ? _mm512_load_si512(xb->base) : _mm512_setzero_si512();
            const __m512 lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(base, q, qx));
            acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(wd, _mm512_load_ps(xb->d)), lanes, acc[p]);
        }
    }
    float m[GROUP_ROWS];
    _mm256_storeu_ps(m, sum_m);
    for (int i = 0; i < X; i++) {
        const __m256 lanes = i % 2 ? _mm512_extractf32x8_ps(acc[i / 2], 1) : _mm512_castps512_ps256(acc[i / 2]);
        out[i * out_stride] = has_min(type) ? vector_sum(lanes) + m[i] : vector_sum(lanes);
    }
}

#define K_ROWS 4 /* activation rows a K weight row is unpacked for at once */
static const int16_t EIGHTHS[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                    2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
/* One K weight row against X activation rows (at most K_ROWS), 64 weights a 512-bit register:
 * its 16 lanes of 4 products are each output's 8 lanes for two sub-blocks of 32 (or four of 16),
 * added together at the end of the superblock (exact integers, so the same lanes). */
INLINE void k_row_times(int type, const uint8_t *w, int64_t bytes, const kblock *x, int64_t supers, int X, float *out,
                        int64_t out_stride, int ahead) {
    __m256 acc[K_ROWS];
    __m128 acc_m[K_ROWS];
    float sum_m[K_ROWS];
    for (int i = 0; i < X; i++) { acc[i] = _mm256_setzero_ps(); acc_m[i] = _mm_setzero_ps(); sum_m[i] = 0.0f; }
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i halves = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0); /* nibble shifts: low half 0, high half 4 */
    const __m512i eighths = _mm512_loadu_si512(EIGHTHS); /* 16-bit lane t: t / 8 */
    for (int64_t b = 0; b < supers; b++, w += bytes) {
        ask_ahead(ahead, w, bytes);
        __m512i sums[K_ROWS];
        for (int i = 0; i < X; i++) sums[i] = _mm512_setzero_si512();
        float wd, wdmin = 0.0f;
        __m128i mins = _mm_setzero_si128();
        if (type == Q6_K) {
            wd = half_to_float(w + 208);
            /* 16-bit lane t of register u (64 weights) takes sub-block 4u + t / 8's scale */
            const __m128i bytes16 = _mm_loadu_si128((const __m128i *)(w + 192));
            const __m512i scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(bytes16));
            const __m512i m32 = _mm512_set1_epi8(32);
            for (int h = 0; h < 2; h++) {
                const __m512i ql = _mm512_loadu_si512(w + 64 * h);
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h)));
                for (int v = 0; v < 2; v++) {
                    /* weights 64v + l (l < 32): bits 4v of byte l, 32 + l: bits 4v + 2 */
                    const __m512i nib = _mm512_and_si512(v ? _mm512_srli_epi16(ql, 4) : ql, low);
                    const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16(4 * v), _mm256_set1_epi16(4 * v + 2), 1);
                    const __m512i high = _mm512_and_si512(_mm512_srlv_epi16(qh, shift), _mm512_set1_epi8(3));
                    const __m512i q = _mm512_or_si512(nib, _mm512_slli_epi16(high, 4));
                    const __m512i which = _mm512_add_epi16(eighths, _mm512_set1_epi16(4 * (2 * h + v)));
                    const __m512i scale = _mm512_permutexvar_epi16(which, scales);
                    for (int i = 0; i < X; i++) {
                        const __m512i qx = _mm512_loadu_si512(x[i * supers + b].q + 128 * h + 64 * v);
                        const __m512i pairs =
                            _mm512_sub_epi16(_mm512_maddubs_epi16(q, qx), _mm512_maddubs_epi16(m32, qx));
                        sums[i] = _mm512_dpwssd_epi32(sums[i], scale, pairs);
                    }
                }
            }
        } else {
            wd = half_to_float(w);
            wdmin = half_to_float(w + 2);
            const __m128i both = scales_and_mins_vector(w + 4);
            mins = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(both, both));
            const __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(both));
            const uint8_t *qs = w + (type == Q4_K ? 16 : 48);
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 16)));
            for (int c = 0; c < 4; c++) { /* sub-blocks 2c (low nibbles) and 2c + 1 (high) */
                const __m512i packed = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
                __m512i q = _mm512_and_si512(_mm512_srlv_epi64(packed, halves), low);
                if (type == Q5_K) {
                    const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << 2 * c)),
                                                           _mm256_set1_epi8((char)(2 << 2 * c)), 1);
                    const __mmask64 set = _mm512_test_epi8_mask(qh, bit);
                    q = _mm512_or_si512(q, _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(0x10)));
                }
                const __m512i which = _mm512_add_epi16(_mm512_srli_epi16(eighths, 1), _mm512_set1_epi16(2 * c));
                const __m512i scale = _mm512_permutexvar_epi16(which, scales);
                for (int i = 0; i < X; i++) {
                    const __m512i qx = _mm512_loadu_si512(x[i * supers + b].q + 64 * c);
                    sums[i] = _mm512_dpwssd_epi32(sums[i], scale, _mm512_maddubs_epi16(q, qx));
                }
            }
        }
        for (int i = 0; i < X; i++) {
            const kblock *xb = &x[i * supers + b];
            const __m256i lanes =
                _mm256_add_epi32(_mm512_castsi512_si256(sums[i]), _mm512_extracti64x4_epi64(sums[i], 1));
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(xb->d * wd), _mm256_cvtepi32_ps(lanes), acc[i]);
            if (type != Q6_K) add_mins(type, mins, wdmin, xb, &acc_m[i], &sum_m[i]);
        }
    }
    for (int i = 0; i < X; i++) out[i * out_stride] = k_result(type, acc[i], acc_m[i], sum_m[i]);
}
#else
#define GROUP_ROWS 4
#define K_ROWS 4
/* One K weight row against X activation rows (at most K_ROWS), 32 weights a register (one
 * sub-block of 32 or two of 16): its 8 lanes of 4 products are each output's lanes. */
INLINE void k_row_times(int type, const uint8_t *w, int64_t bytes, const kblock *x, int64_t supers, int X, float *out,
                        int64_t out_stride, int ahead) {
    __m256 acc[K_ROWS];
    __m128 acc_m[K_ROWS];
    float sum_m[K_ROWS];
    for (int i = 0; i < X; i++) { acc[i] = _mm256_setzero_ps(); acc_m[i] = _mm_setzero_ps(); sum_m[i] = 0.0f; }
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < supers; b++, w += bytes) {
        ask_ahead(ahead, w, bytes);
        __m256i sums[K_ROWS];
        for (int i = 0; i < X; i++) sums[i] = _mm256_setzero_si256();
        float wd, wdmin = 0.0f;
        __m128i mins = _mm_setzero_si128();
        if (type == Q6_K) {
            wd = half_to_float(w + 208);
            const int8_t *sc = (const int8_t *)(w + 192);
            const __m256i m32 = _mm256_set1_epi8(32);
            for (int h = 0; h < 2; h++) {
                const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
                const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
                /* weights 32v + l: nibble v / 2 of ql[l + 32 (v mod 2)], bits 2v of qh[l] */
                for (int v = 0; v < 4; v++) {
                    const __m256i bits = v & 1 ? ql1 : ql0;
                    const __m256i nib = _mm256_and_si256(v & 2 ? _mm256_srli_epi16(bits, 4) : bits, low);
                    const __m256i shifted = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * v));
                    const __m256i high = _mm256_and_si256(shifted, _mm256_set1_epi8(3));
                    const __m256i q = _mm256_or_si256(nib, _mm256_slli_epi16(high, 4));
                    const int s = 8 * h + 2 * v;
                    const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[s + 1]), _mm_set1_epi16(sc[s]));
                    for (int i = 0; i < X; i++) {
                        const int8_t *xq = x[i * supers + b].q + 128 * h + 32 * v;
                        const __m256i qx = _mm256_loadu_si256((const __m256i *)xq);
                        const __m256i pairs =
                            _mm256_sub_epi16(_mm256_maddubs_epi16(q, qx), _mm256_maddubs_epi16(m32, qx));
                        sums[i] = SCALED_SUMS(sums[i], scale, pairs);
                    }
                }
            }
        } else {
            wd = half_to_float(w);
            wdmin = half_to_float(w + 2);
            const __m128i both = scales_and_mins_vector(w + 4);
            uint8_t sc[16];
            _mm_storeu_si128((__m128i *)sc, both);
            mins = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(both, both));
            const uint8_t *qs = w + (type == Q4_K ? 16 : 48);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 16));
            for (int c = 0; c < 4; c++) { /* sub-blocks 2c (low nibbles) and 2c + 1 (high) */
                const __m256i bits = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                __m256i q[2] = {_mm256_and_si256(bits, low), _mm256_and_si256(_mm256_srli_epi16(bits, 4), low)};
                for (int half = 0; half < 2 && type == Q5_K; half++) {
                    const __m256i shifted = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c + half));
                    const __m256i fifth = _mm256_and_si256(shifted, _mm256_set1_epi8(1));
                    q[half] = _mm256_or_si256(q[half], _mm256_slli_epi16(fifth, 4));
                }
                for (int half = 0; half < 2; half++) {
                    const __m256i scale = _mm256_set1_epi16(sc[2 * c + half]);
                    for (int i = 0; i < X; i++) {
                        const int8_t *xq = x[i * supers + b].q + 64 * c + 32 * half;
                        const __m256i qx = _mm256_loadu_si256((const __m256i *)xq);
                        sums[i] = SCALED_SUMS(sums[i], scale, _mm256_maddubs_epi16(q[half], qx));
                    }
                }
            }
        }
        for (int i = 0; i < X; i++) {
            const kblock *xb = &x[i * supers + b];
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(xb->d * wd), _mm256_cvtepi32_ps(sums[i]), acc[i]);
            if (type != Q6_K) add_mins(type, mins, wdmin, xb, &acc_m[i], &sum_m[i]);
        }
    }
    for (int i = 0; i < X; i++) out[i * out_stride] = k_result(type, acc[i], acc_m[i], sum_m[i]);
}
#endif

#ifdef WIDE
/* A tile's row i: its `lanes` groups of 4 bytes from `q`, group l to lanes[l] + 4i. */
INLINE void spread_lanes(int8_t (*lanes)[4 * TILE_ROWS], const int8_t *q, int count, int i) {
    for (int l = 0; l < count; l++) memcpy(lanes[l] + 4 * i, q + 4 * l, 4);
}

/* Activation rows [g, g + TILE_ROWS) as row_tile_times takes them: tiles[b] for block b. */
static void tiles_of(const xblock *x, int64_t g, int64_t blocks, xtile *tiles) {
    for (int64_t b = 0; b < blocks; b++)
        for (int i = 0; i < TILE_ROWS; i++) {
            const xblock *xb = &x[(g + i) * blocks + b];
            xtile *t = &tiles[b];
            t->d[i] = xb->d, t->s[i] = xb->s;
            spread_lanes(t->q, xb->q, 8, i);
            for (int l = 0; l < 8; l++) t->base[l][i] = xb->base[l];
        }
}

/* Two weight rows (row_bytes apart) against TILE_ROWS activation rows (tiles_of), the registers
 * turned: a register's 16 floats are one lane l of one weight row's 16 outputs, so one product
 * d_w · d_x serves all 8 lanes of an output block, a lane's 4 weights are one broadcast number,
 * and an output's tree of lanes is additions of whole registers. Every output's integers,
 * lanes, products and order are row_times's. out[i · out_stride + k]: activation row i, weight
 * row k. */
INLINE void row_tile_times(int type, const uint8_t *w, int64_t row_bytes, int64_t bytes, const xtile *x,
                           int64_t blocks, float *out, int64_t out_stride, int ahead) {
    __m512 acc[2][8]; /* [weight row k][lane l]: float i is activation row i's */
    __m512 sum_m[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int k = 0; k < 2; k++)
        for (int l = 0; l < 8; l++) acc[k][l] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, w += bytes) {
        const xtile *xb = &x[b];
        int32_t lanes_of[2][8]; /* each weight row's 4 weights of each lane, as one number */
        __m512 d[2];
        for (int k = 0; k < 2; k++) {
            const uint8_t *wk = w + k * row_bytes;
            ask_ahead(ahead, wk, bytes);
            _mm256_storeu_si256((__m256i *)lanes_of[k], block_weights(type, wk));
            d[k] = _mm512_mul_ps(_mm512_set1_ps(half_to_float(wk)), _mm512_load_ps(xb->d));
            if (has_min(type))
                sum_m[k] = _mm512_add_ps(sum_m[k], _mm512_mul_ps(_mm512_set1_ps(half_to_float(wk + 2)), _mm512_load_ps(xb->s)));
        }
        for (int l = 0; l < 8; l++) {
            const __m512i qx = _mm512_load_si512(xb->q[l]);
            const __m512i base = signed_offset(type) ? _mm512_load_si512(xb->base[l]) : _mm512_setzero_si512();
            for (int k = 0; k < 2; k++) {
                __m512i q = _mm512_set1_epi32(lanes_of[k][l]), qxk = qx;
                if (type == Q8_0) { /* |w| times x with w's sign, as row_times (x is never -128) */
                    qxk = _mm512_mask_sub_epi8(qx, _mm512_movepi8_mask(q), _mm512_setzero_si512(), qx);
                    q = _mm512_abs_epi8(q);
                }
                const __m512 sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(base, q, qxk));
                acc[k][l] = _mm512_fmadd_ps(d[k], sums, acc[k][l]);
            }
        }
    }
    for (int k = 0; k < 2; k++) {
        const __m512 *a = acc[k]; /* lanes_sum's tree, 16 outputs at once */
        __m512 t = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[4], a[0]), _mm512_add_ps(a[6], a[2])),
                                 _mm512_add_ps(_mm512_add_ps(a[5], a[1]), _mm512_add_ps(a[7], a[3])));
        if (has_min(type)) t = _mm512_add_ps(t, sum_m[k]);
        float o[TILE_ROWS];
        _mm512_storeu_ps(o, t);
        for (int i = 0; i < TILE_ROWS; i++) out[i * out_stride + k] = o[i];
    }
}
#endif

/* Weight rows [first, last) against activation rows [0, n): a prompt's TILE_ROWS at a time as
 * `tiles` holds them (tiles_of; row_tile_times is 15% faster than pairs on Qwen2.5-Coder-0.5B's
 * Q5_0 linears), then GROUP_ROWS at a time; `pairs` and `sums` hold those as row_xpair_times
 * takes them (xpairs_of: group g's from pair (g − t) / 2, its sums from (g − t) · blocks, t the
 * rows the tiles took). */
INLINE void rows_times(int type, const uint8_t *w, int64_t row_bytes, int64_t bytes, const xblock *x,
                       const xpair *pairs, const float *sums, const xtile *tiles, int64_t blocks, int64_t first,
                       int64_t last, int64_t n, float *out, int64_t outputs) {
    int64_t i = 0;
#ifdef WIDE
    /* two weight rows at a time; an odd last weight row against the tile's rows 4 at a time */
    for (; tiles != NULL && i + TILE_ROWS <= n; i += TILE_ROWS) {
        int64_t r = first;
        for (; r + 1 < last; r += 2)
            row_tile_times(type, w + r * row_bytes, row_bytes, bytes, tiles + i / TILE_ROWS * blocks, blocks,
                           out + i * outputs + r, outputs, i == 0);
        for (int64_t j = i; r < last && j < i + TILE_ROWS; j += 4)
            row_times(type, w + r * row_bytes, bytes, x + j * blocks, blocks, 4, out + j * outputs + r, outputs, i == 0);
    }
    const int64_t tiled = i; /* pairs and sums start at the first row past the tiles */
#else
    (void)tiles;
#endif
    for (; i < n; i += GROUP_ROWS) {
        const int64_t left = n - i < GROUP_ROWS ? n - i : GROUP_ROWS;
        const xblock *xs = x + i * blocks;
        int64_t r = first;
#ifdef WIDE
        for (; left > 1 && r < last; r++) { /* the group's rows as pairs (xpairs_of) */
            const uint8_t *row = w + r * row_bytes;
            const xpair *ps = pairs + (i - tiled) / 2 * blocks;
            const float *s = sums + (i - tiled) * blocks;
            float *o = out + i * outputs + r;
            switch (left) { /* a constant X for each, so that the accumulators stay in registers */
            case 8: row_xpair_times(type, row, bytes, ps, s, blocks, 8, o, outputs, i == 0); break;
            case 7: row_xpair_times(type, row, bytes, ps, s, blocks, 7, o, outputs, i == 0); break;
            case 6: row_xpair_times(type, row, bytes, ps, s, blocks, 6, o, outputs, i == 0); break;
            case 5: row_xpair_times(type, row, bytes, ps, s, blocks, 5, o, outputs, i == 0); break;
            case 4: row_xpair_times(type, row, bytes, ps, s, blocks, 4, o, outputs, i == 0); break;
            case 3: row_xpair_times(type, row, bytes, ps, s, blocks, 3, o, outputs, i == 0); break;
            default: row_xpair_times(type, row, bytes, ps, s, blocks, 2, o, outputs, i == 0);
            }
        }
#else
        (void)pairs, (void)sums; /* row_xpair_times's */
#endif
        for (; r < last; r++) {
            const uint8_t *row = w + r * row_bytes;
            for (int64_t j = 0; j < left; j += 4) {
                float *o = out + (i + j) * outputs + r;
                switch (left - j < 4 ? left - j : 4) {
                case 4: row_times(type, row, bytes, xs + j * blocks, blocks, 4, o, outputs, i + j == 0); break;
                case 3: row_times(type, row, bytes, xs + j * blocks, blocks, 3, o, outputs, i + j == 0); break;
                case 2: row_times(type, row, bytes, xs + j * blocks, blocks, 2, o, outputs, i + j == 0); break;
                default: row_times(type, row, bytes, xs + j * blocks, blocks, 1, o, outputs, i + j == 0);
                }
            }
        }
    }
}

#ifdef WIDE
/* Activation rows [g, g + TILE_ROWS) as k_row_tile_times takes them: tiles[b] for superblock b. */
static void ktiles_of(const kblock *x, int64_t g, int64_t supers, ktile *tiles) {
    for (int64_t b = 0; b < supers; b++)
        for (int i = 0; i < TILE_ROWS; i++) {
            const kblock *xb = &x[(g + i) * supers + b];
            ktile *t = &tiles[b];
            t->d[i] = xb->d;
            for (int k = 0; k < 4; k++)
                t->sums[k][i] = (int32_t)(uint16_t)xb->sums[2 * k] | (int32_t)((uint32_t)(uint16_t)xb->sums[2 * k + 1] << 16);
            spread_lanes(t->q[0], xb->q, SUPER / 4, i); /* q[s][l] is group 8s + l */
        }
}

/* A K superblock's weights as unsigned bytes in order (Q6_K's without its offset 32), and its
 * scales: Q4_K's and Q5_K's one per 32 weights (sc[s]), Q6_K's one per 16 (sc[2s], sc[2s + 1]). */
static inline void k_weights(int type, const uint8_t *w, uint8_t q[SUPER], int16_t sc[16], uint8_t mins[8]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    if (type == Q6_K) {
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            for (int v = 0; v < 4; v++) { /* weights 128h + 32v + l: nibble v / 2 of ql[l + 32 (v mod 2)], bits 2v of qh[l] */
                const __m256i bits = v & 1 ? ql1 : ql0;
                const __m256i nib = _mm256_and_si256(v & 2 ? _mm256_srli_epi16(bits, 4) : bits, low);
                const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * v)), _mm256_set1_epi8(3));
                _mm256_storeu_si256((__m256i *)(q + 128 * h + 32 * v), _mm256_or_si256(nib, _mm256_slli_epi16(high, 4)));
            }
        }
        for (int s = 0; s < 16; s++) sc[s] = ((const int8_t *)(w + 192))[s];
        return;
    }
    uint32_t u[4];
    scales_and_mins(w + 4, u);
    for (int s = 0; s < 8; s++) sc[s] = ((const uint8_t *)u)[s], mins[s] = ((const uint8_t *)u)[8 + s];
    const uint8_t *qs = w + (type == Q4_K ? 16 : 48);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 16));
    for (int c = 0; c < 4; c++) { /* sub-blocks 2c (low nibbles) and 2c + 1 (high) */
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        for (int half = 0; half < 2; half++) {
            __m256i v = _mm256_and_si256(half ? _mm256_srli_epi16(bits, 4) : bits, low);
            if (type == Q5_K) {
                const __m256i fifth = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c + half)), _mm256_set1_epi8(1));
                v = _mm256_or_si256(v, _mm256_slli_epi16(fifth, 4));
            }
            _mm256_storeu_si256((__m256i *)(q + 64 * c + 32 * half), v);
        }
    }
}

/* One K weight row against TILE_ROWS activation rows (ktiles_of), the registers turned as in
 * row_tile_times: a register's 16 numbers are one lane l of the row's 16 outputs. A lane's 4
 * weights of a sub-block are one broadcast number, their byte products summed in pairs and the
 * pairs times the sub-block's scale into the lane's integer (Q6_K's offset 32 taken off through
 * the same pairs of 32 times x); the same integers, products and order as k_row_times. */
INLINE void k_row_tile_times(int type, const uint8_t *w, int64_t bytes, const ktile *x, int64_t supers, float *out,
                             int64_t out_stride, int ahead) {
    __m512 acc[8], acc_m[4], sum_m = _mm512_setzero_ps();
    for (int l = 0; l < 8; l++) acc[l] = _mm512_setzero_ps();
    for (int t = 0; t < 4; t++) acc_m[t] = _mm512_setzero_ps();
    const __m512i m32 = _mm512_set1_epi8(32);
    for (int64_t b = 0; b < supers; b++, w += bytes) {
        ask_ahead(ahead, w, bytes);
        const ktile *xb = &x[b];
        uint8_t q[SUPER] __attribute__((aligned(64)));
        int16_t sc[16];
        uint8_t mins[8];
        k_weights(type, w, q, sc, mins);
        const float wd = half_to_float(type == Q6_K ? w + 208 : w);
        __m512i lanes[8];
        for (int l = 0; l < 8; l++) lanes[l] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            for (int l = 0; l < 8; l++) {
                uint32_t four;
                memcpy(&four, q + 32 * s + 4 * l, 4);
                const __m512i qx = _mm512_load_si512(xb->q[s][l]);
                __m512i pairs = _mm512_maddubs_epi16(_mm512_set1_epi32((int)four), qx);
                if (type == Q6_K) pairs = _mm512_sub_epi16(pairs, _mm512_maddubs_epi16(m32, qx));
                const int16_t scale = type == Q6_K ? sc[2 * s + l / 4] : sc[s];
                lanes[l] = _mm512_dpwssd_epi32(lanes[l], _mm512_set1_epi16(scale), pairs);
            }
        }
        const __m512 xd = _mm512_load_ps(xb->d), d = _mm512_mul_ps(xd, _mm512_set1_ps(wd));
        for (int l = 0; l < 8; l++) acc[l] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lanes[l]), acc[l]);
        if (type != Q6_K) { /* add_mins, 16 rows at once */
            const __m512 negated = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(xd), _mm512_set1_epi32(INT32_MIN)));
            const __m512 dmin = _mm512_mul_ps(negated, _mm512_set1_ps(half_to_float(w + 2))); /* −d_x · dmin_w */
            __m512i total = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++) {
                const __m512i m = _mm512_set1_epi32((int)((uint32_t)mins[2 * t] | (uint32_t)mins[2 * t + 1] << 16));
                const __m512i products = _mm512_madd_epi16(m, _mm512_load_si512(xb->sums[t]));
                if (type == Q4_K) acc_m[t] = _mm512_fmadd_ps(dmin, _mm512_cvtepi32_ps(products), acc_m[t]);
                else total = _mm512_add_epi32(total, products);
            }
            if (type == Q5_K) sum_m = _mm512_add_ps(sum_m, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(total)));
        }
    }
    const __m512 *a = acc; /* lanes_sum's tree, then mins_sum's, 16 outputs at once */
    __m512 t = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[4], a[0]), _mm512_add_ps(a[6], a[2])),
                             _mm512_add_ps(_mm512_add_ps(a[5], a[1]), _mm512_add_ps(a[7], a[3])));
    if (type == Q4_K)
        t = _mm512_add_ps(t, _mm512_add_ps(_mm512_add_ps(acc_m[0], acc_m[2]), _mm512_add_ps(acc_m[1], acc_m[3])));
    else if (type == Q5_K)
        t = _mm512_add_ps(t, sum_m);
    float o[TILE_ROWS];
    _mm512_storeu_ps(o, t);
    for (int i = 0; i < TILE_ROWS; i++) out[i * out_stride] = o[i];
}
#endif

INLINE void k_rows_times(int type, const uint8_t *w, int64_t row_bytes, int64_t bytes, const kblock *x,
                         const ktile *tiles, int64_t supers, int64_t first, int64_t last, int64_t n, float *out,
                         int64_t outputs) {
    int64_t i = 0;
#ifdef WIDE
    for (; tiles != NULL && i + TILE_ROWS <= n; i += TILE_ROWS) /* a prompt's rows TILE_ROWS at a time */
        for (int64_t r = first; r < last; r++)
            k_row_tile_times(type, w + r * row_bytes, bytes, tiles + i / TILE_ROWS * supers, supers, out + i * outputs + r,
                             outputs, i == 0);
#else
    (void)tiles;
#endif
    for (; i < n; i += K_ROWS) {
        const int64_t left = n - i < K_ROWS ? n - i : K_ROWS;
        for (int64_t r = first; r < last; r++) {
            const uint8_t *row = w + r * row_bytes;
            float *o = out + i * outputs + r;
            const kblock *xs = x + i * supers;
            switch (left) { /* a constant X for each, so that the accumulators stay in registers */
            case 4: k_row_times(type, row, bytes, xs, supers, 4, o, outputs, i == 0); break;
            case 3: k_row_times(type, row, bytes, xs, supers, 3, o, outputs, i == 0); break;
            case 2: k_row_times(type, row, bytes, xs, supers, 2, o, outputs, i == 0); break;
            default: k_row_times(type, row, bytes, xs, supers, 1, o, outputs, i == 0);
            }
        }
    }
}

#ifdef WIDE
#define FLOAT_ROWS 4 /* weight rows and activation rows a float product takes at once */
#define FLOAT_X 4
/* 16 weights of a float type from weight j, widened, in one register (lanes 0 to 15). */
static inline __m512 widened16(int type, const uint8_t *w, int64_t j) {
    switch (type) {
    case F32: return _mm512_loadu_ps(w + 4 * j);
    case F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 2 * j)));
    default: { /* BF16: the top half of a float32 */
        const __m256i halves = _mm256_loadu_si256((const __m256i *)(w + 2 * j));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
    }
    }
}

/* R weight rows (`apart` rows from each other) against X activation rows: R · X independent
 * chains of 16 lanes. */
INLINE void float_times(int type, const uint8_t *w, int64_t row_bytes, int64_t apart, const float *x,
                        int64_t x_stride, int64_t inputs, int R, int X, float *out, int64_t outputs, int ahead) {
    row_bytes *= apart;
    __m512 acc[FLOAT_ROWS][FLOAT_X];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < X; i++) acc[r][i] = _mm512_setzero_ps();
    const int64_t whole = inputs & ~(int64_t)15;
    for (int64_t j = 0; j < whole; j += 16) {
        __m512 xs[FLOAT_X];
        for (int i = 0; i < X; i++) xs[i] = _mm512_loadu_ps(x + i * x_stride + j);
        for (int r = 0; r < R; r++) {
            ask_ahead(ahead, w + r * row_bytes + j * (type == F32 ? 4 : 2), type == F32 ? 64 : 32);
            const __m512 ws = widened16(type, w + r * row_bytes, j);
            for (int i = 0; i < X; i++) acc[r][i] = _mm512_fmadd_ps(ws, xs[i], acc[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < X; i++) {
            float lanes[16];
            _mm512_storeu_ps(lanes, acc[r][i]);
            out[i * outputs + r * apart] = float_tail(type, w + r * row_bytes, x + i * x_stride, whole, inputs, lanes);
        }
}
#else
#define FLOAT_ROWS 2
#define FLOAT_X 2
/* 8 weights of a float type from weight j, widened. */
static inline __m256 widened8(int type, const uint8_t *w, int64_t j) {
    switch (type) {
    case F32: return _mm256_loadu_ps((const float *)(w + 4 * j));
    case F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * j)));
    default: { /* BF16: the top half of a float32 */
        const __m128i halves = _mm_loadu_si128((const __m128i *)(w + 2 * j));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
    }
    }
}

/* R weight rows (`apart` rows from each other) against X activation rows: R · X independent
 * chains of 16 lanes, in two registers of 8 (lanes 0 to 7, 8 to 15). */
INLINE void float_times(int type, const uint8_t *w, int64_t row_bytes, int64_t apart, const float *x,
                        int64_t x_stride, int64_t inputs, int R, int X, float *out, int64_t outputs, int ahead) {
    row_bytes *= apart;
    __m256 acc[FLOAT_ROWS][FLOAT_X][2];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < X; i++) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_ps();
    const int64_t whole = inputs & ~(int64_t)15;
    for (int64_t j = 0; j < whole; j += 16) {
        __m256 xs[FLOAT_X][2];
        for (int i = 0; i < X; i++) {
            xs[i][0] = _mm256_loadu_ps(x + i * x_stride + j);
            xs[i][1] = _mm256_loadu_ps(x + i * x_stride + j + 8);
        }
        for (int r = 0; r < R; r++) {
            ask_ahead(ahead, w + r * row_bytes + j * (type == F32 ? 4 : 2), type == F32 ? 64 : 32);
            const __m256 w0 = widened8(type, w + r * row_bytes, j), w1 = widened8(type, w + r * row_bytes, j + 8);
            for (int i = 0; i < X; i++) {
                acc[r][i][0] = _mm256_fmadd_ps(w0, xs[i][0], acc[r][i][0]);
                acc[r][i][1] = _mm256_fmadd_ps(w1, xs[i][1], acc[r][i][1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < X; i++) {
            float lanes[16];
            _mm256_storeu_ps(lanes, acc[r][i][0]);
            _mm256_storeu_ps(lanes + 8, acc[r][i][1]);
            out[i * outputs + r * apart] = float_tail(type, w + r * row_bytes, x + i * x_stride, whole, inputs, lanes);
        }
}
#endif

#define FLOAT_CASE(R, X) float_times(type, row, row_bytes, part, xs, x_stride, inputs, R, X, o, outputs, i == 0)
/* Weight rows [first, last) against activation rows [0, n): FLOAT_ROWS rows at a time, each from
 * its own part of the item, so that each part is read as one stream from memory (as the pairs
 * of rows_times), then the rows past the parts one at a time. */
INLINE void float_rows_times(int type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t x_stride,
                             int64_t inputs, int64_t first, int64_t last, int64_t n, float *out, int64_t outputs) {
    const int64_t part = (last - first) / FLOAT_ROWS;
    for (int64_t i = 0; i < n; i += FLOAT_X) {
        const int64_t left = n - i < FLOAT_X ? n - i : FLOAT_X;
        const float *xs = x + i * x_stride;
        for (int64_t r = first; r < last;) {
            const uint8_t *row = w + r * row_bytes;
            float *o = out + i * outputs + r;
            const int R = r < first + part ? FLOAT_ROWS : 1;
            switch (left * 8 + R) { /* constant counts for each, so that the accumulators stay in registers */
#if FLOAT_X == 4
            case 4 * 8 + FLOAT_ROWS: FLOAT_CASE(FLOAT_ROWS, 4); break;
            case 4 * 8 + 1: FLOAT_CASE(1, 4); break;
            case 3 * 8 + FLOAT_ROWS: FLOAT_CASE(FLOAT_ROWS, 3); break;
            case 3 * 8 + 1: FLOAT_CASE(1, 3); break;
#endif
            case 2 * 8 + FLOAT_ROWS: FLOAT_CASE(FLOAT_ROWS, 2); break;
            case 2 * 8 + 1: FLOAT_CASE(1, 2); break;
            case 1 * 8 + FLOAT_ROWS: FLOAT_CASE(FLOAT_ROWS, 1); break;
            default: FLOAT_CASE(1, 1);
            }
            r = r + 1 == first + part ? first + FLOAT_ROWS * part : r + 1;
        }
    }
}
#else
#define GROUP_ROWS 1 /* the plain code takes activation rows one at a time */

/* A 32-block's weights as integers (Q4_0's and Q5_0's offsets taken off). */
static void block_integers(int type, const uint8_t *w, int q[BLOCK]) {
    if (type == Q8_0) {
        for (int j = 0; j < BLOCK; j++) q[j] = (int8_t)w[2 + j];
        return;
    }
    const int five = type == Q5_0 || type == Q5_1;
    const uint32_t high = five ? (uint32_t)w[2 * has_min(type) + 2] | (uint32_t)w[2 * has_min(type) + 3] << 8 |
                                     (uint32_t)w[2 * has_min(type) + 4] << 16 | (uint32_t)w[2 * has_min(type) + 5] << 24
                               : 0;
    const uint8_t *qs = w + 2 + 2 * has_min(type) + 4 * five;
    for (int j = 0; j < BLOCK / 2; j++) {
        q[j] = ((qs[j] & 0x0F) | ((high >> j) & 1) << 4) - signed_offset(type);
        q[j + 16] = ((qs[j] >> 4) | ((high >> (j + 16)) & 1) << 4) - signed_offset(type);
    }
}

static float block_dot(int type, const uint8_t *w, int64_t bytes, const xblock *x, int64_t blocks) {
    float sum_m = 0.0f;
    float acc[8] = {0};
    for (int64_t b = 0; b < blocks; b++, w += bytes) {
        if (has_min(type)) sum_m += half_to_float(w + 2) * x[b].s;
        const float scale = half_to_float(w) * x[b].d;
        int q[BLOCK];
        block_integers(type, w, q);
        for (int k = 0; k < 8; k++) {
            int lane = 0;
            for (int j = 4 * k; j < 4 * k + 4; j++) lane += q[j] * x[b].q[j];
            acc[k] = fmaf(scale, (float)lane, acc[k]);
        }
    }
    return has_min(type) ? lanes_sum(acc) + sum_m : lanes_sum(acc);
}

/* A K superblock's weights as integers (Q6_K's offset taken off) and each one's scale. */
static void super_integers(int type, const uint8_t *w, int q[SUPER], int scale[SUPER]) {
    if (type == Q6_K) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            for (int l = 0; l < 32; l++)
                for (int v = 0; v < 4; v++) {
                    const int p = 128 * h + 32 * v + l;
                    const int nibble = (v & 2) ? ql[l + 32 * (v & 1)] >> 4 : ql[l + 32 * (v & 1)] & 0x0F;
                    q[p] = (nibble | ((qh[l] >> 2 * v) & 3) << 4) - 32;
                    scale[p] = ((const int8_t *)(w + 192))[p / 16];
                }
        }
        return;
    }
    uint32_t u[4];
    scales_and_mins(w + 4, u);
    const uint8_t *sc = (const uint8_t *)u, *qs = w + (type == Q4_K ? 16 : 48), *qh = w + 16;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++)
            for (int half = 0; half < 2; half++) {
                const int s = 2 * c + half, p = 32 * s + l;
                const int fifth = type == Q5_K ? (qh[l] >> s) & 1 : 0;
                q[p] = (half ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 0x0F) | fifth << 4;
                scale[p] = sc[s];
            }
}

static float super_dot(int type, const uint8_t *w, int64_t bytes, const kblock *x, int64_t supers) {
    float acc[8] = {0}, acc_m[4] = {0}, sum_m = 0.0f;
    for (int64_t b = 0; b < supers; b++, w += bytes) {
        int q[SUPER], scale[SUPER], lanes[8] = {0};
        super_integers(type, w, q, scale);
        for (int p = 0; p < SUPER; p++) lanes[(p % BLOCK) / 4] += scale[p] * q[p] * x[b].q[p];
        const float d = x[b].d * half_to_float(type == Q6_K ? w + 208 : w);
        for (int k = 0; k < 8; k++) acc[k] = fmaf(d, (float)lanes[k], acc[k]);
        if (type == Q6_K) continue;
        uint32_t u[4];
        scales_and_mins(w + 4, u);
        const uint8_t *mins = (const uint8_t *)(u + 2);
        const float dmin = -x[b].d * half_to_float(w + 2);
        if (type == Q4_K) {
            for (int t = 0; t < 4; t++)
                acc_m[t] = fmaf(dmin, (float)(mins[2 * t] * x[b].sums[2 * t] + mins[2 * t + 1] * x[b].sums[2 * t + 1]),
                                acc_m[t]);
        } else {
            int total = 0;
            for (int s = 0; s < 8; s++) total += mins[s] * x[b].sums[s];
            sum_m += dmin * (float)total;
        }
    }
    return type == Q4_K ? lanes_sum(acc) + mins_sum(acc_m) : type == Q5_K ? lanes_sum(acc) + sum_m : lanes_sum(acc);
}

static float float_dot(int type, const uint8_t *w, const float *x, int64_t inputs) {
    float lanes[16] = {0};
    return float_tail(type, w, x, 0, inputs, lanes);
}

INLINE void rows_times(int type, const uint8_t *w, int64_t row_bytes, int64_t bytes, const xblock *x,
                       const xpair *pairs, const float *sums, const xtile *tiles, int64_t blocks, int64_t first,
                       int64_t last, int64_t n, float *out, int64_t outputs) {
    (void)pairs, (void)sums, (void)tiles; /* the AVX-512 code's, which this plain code has no use for */
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = first; r < last; r++)
            out[i * outputs + r] = block_dot(type, w + r * row_bytes, bytes, x + i * blocks, blocks);
}

INLINE void k_rows_times(int type, const uint8_t *w, int64_t row_bytes, int64_t bytes, const kblock *x,
                         const ktile *tiles, int64_t supers, int64_t first, int64_t last, int64_t n, float *out,
                         int64_t outputs) {
    (void)tiles; /* the AVX-512 code's */
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = first; r < last; r++)
            out[i * outputs + r] = super_dot(type, w + r * row_bytes, bytes, x + i * supers, supers);
}

INLINE void float_rows_times(int type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t x_stride,
                             int64_t inputs, int64_t first, int64_t last, int64_t n, float *out, int64_t outputs) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = first; r < last; r++)
            out[i * outputs + r] = float_dot(type, w + r * row_bytes, x + i * x_stride, inputs);
}
#endif

/* Weight rows [first, last) against activation rows [0, n), the type a constant in each case
 * so that the loops are compiled for each type alone (a type tested inside them costs time:
 * bench/README.md, "Figures behind constants"). */
static void item_times(int type, const uint8_t *w, int64_t row_bytes, int64_t bytes, const xblock *xs,
                       const xpair *pairs, const float *sums, const xtile *tiles, const kblock *ks, const ktile *ktiles, const float *x, int64_t x_stride, int64_t blocks,
                       int64_t inputs, int64_t first, int64_t last, int64_t n, float *out, int64_t outputs) {
#define SMALL_TYPE(T) \
    case T: rows_times(T, w, row_bytes, bytes, xs, pairs, sums, tiles, blocks, first, last, n, out, outputs); break
#define K_TYPE(T) case T: k_rows_times(T, w, row_bytes, bytes, ks, ktiles, blocks, first, last, n, out, outputs); break
#define FLOAT_TYPE(T) \
    case T: float_rows_times(T, w, row_bytes, x, x_stride, inputs, first, last, n, out, outputs); break
    switch (type) {
    SMALL_TYPE(Q4_0); SMALL_TYPE(Q4_1); SMALL_TYPE(Q5_0); SMALL_TYPE(Q5_1); SMALL_TYPE(Q8_0);
    K_TYPE(Q4_K); K_TYPE(Q5_K); K_TYPE(Q6_K);
    FLOAT_TYPE(F32); FLOAT_TYPE(F16); FLOAT_TYPE(BF16);
    }
}

/* out[i][r] = weight row r · x row i, for `outputs` weight rows of ggml type `type` and `n`
 * activation rows of `inputs` floats each (row i at x + i * x_stride); out is n rows of
 * `outputs` floats. Work is shared among `threads` OpenMP threads. Returns 0; 1 when there is
 * no memory for the quantized rows; 2 for a type this kernel does not take; 3 for a shape it
 * cannot take (inputs not a positive multiple of the type's block of 32 or 256, negative
 * counts, rows that overlap). */
int lmw_gguf_matmul(int type, const uint8_t *weights, int64_t outputs, int64_t inputs, const float *x,
                    int64_t n, int64_t x_stride, float *out, int threads) {
    int per_block;
    const int bytes = block_bytes(type, &per_block);
    if (bytes == 0) return 2;
    if (inputs <= 0 || inputs % per_block != 0 || outputs < 0 || n < 0 || (n > 1 && x_stride < inputs)) return 3;
    const int64_t blocks = inputs / per_block, row_bytes = blocks * bytes;
    const int64_t items = (outputs + ROWS_TOGETHER - 1) / ROWS_TOGETHER;
#ifdef WIDE
    /* a prompt's rows of the block types taken as tiles; the 32-blocks' rows past them as pairs
     * (row_xpair_times) */
    const int64_t tiled = per_block == BLOCK || per_block == SUPER ? n / TILE_ROWS * TILE_ROWS : 0;
    const int64_t paired = per_block == BLOCK && n - tiled > 1 ? n - tiled : 0;
#else
    const int64_t tiled = 0, paired = 0;
#endif
    xblock *quantized = NULL;
    kblock *k_quantized = NULL;
    ktile *ktiles = NULL;
    xpair *pairs = NULL;
    float *sums = NULL;
    xtile *tiles = NULL;
    int status = 0;
    if (per_block == BLOCK) {
        quantized = malloc((size_t)(n * blocks) * sizeof *quantized + 1);
        if (paired) {
            pairs = aligned_alloc(64, (size_t)((paired + 1) / 2 * blocks) * sizeof *pairs);
            sums = malloc((size_t)((paired + GROUP_ROWS - 1) / GROUP_ROWS * GROUP_ROWS * blocks) * sizeof *sums);
        }
        if (tiled) tiles = aligned_alloc(64, (size_t)(tiled / TILE_ROWS * blocks) * sizeof *tiles);
    } else if (per_block == SUPER) {
        k_quantized = aligned_alloc(32, (size_t)(n * blocks + 1) * sizeof *k_quantized);
        if (tiled) ktiles = aligned_alloc(64, (size_t)(tiled / TILE_ROWS * blocks) * sizeof *ktiles);
    }
    if ((per_block == BLOCK && quantized == NULL) || (per_block == SUPER && k_quantized == NULL) ||
        (paired && (pairs == NULL || sums == NULL)) || (tiled && tiles == NULL && per_block == BLOCK) ||
        (tiled && ktiles == NULL && per_block == SUPER)) {
        status = 1;
        goto done;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (per_block == BLOCK) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n; i++) quantize_row(x + i * x_stride, blocks, quantized + i * blocks, signed_offset(type));
#ifdef WIDE
#pragma omp for schedule(static)
            for (int64_t g = tiled; g < n; g += GROUP_ROWS)
                if (paired) /* the rows past the tiles */
                    xpairs_of(quantized, g, n - g < GROUP_ROWS ? n - g : GROUP_ROWS, blocks,
                              pairs + (g - tiled) / 2 * blocks, sums + (g - tiled) * blocks);
#pragma omp for schedule(static)
            for (int64_t g = 0; g < tiled / TILE_ROWS; g++) tiles_of(quantized, g * TILE_ROWS, blocks, tiles + g * blocks);
#endif
        } else if (per_block == SUPER) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n; i++) quantize_row_k(x + i * x_stride, blocks, k_quantized + i * blocks);
#ifdef WIDE
#pragma omp for schedule(static)
            for (int64_t g = 0; g < tiled / TILE_ROWS; g++) ktiles_of(k_quantized, g * TILE_ROWS, blocks, ktiles + g * blocks);
#endif
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const int64_t first = item * ROWS_TOGETHER;
            const int64_t last = first + ROWS_TOGETHER < outputs ? first + ROWS_TOGETHER : outputs;
            item_times(type, weights, row_bytes, bytes, quantized, pairs, sums, tiles, k_quantized, ktiles, x, x_stride, blocks,
                       inputs, first, last, n, out, outputs);
        }
    }
done:
    free(quantized);
    free(pairs);
    free(sums);
    free(tiles);
    free(k_quantized);
    free(ktiles);
    return status;
}
