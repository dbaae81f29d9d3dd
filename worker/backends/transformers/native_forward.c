/* A whole forward pass of a Llama or Gemma 3 model with quantized weights, in one call, for
 * native_forward.py: the new positions of several sequences (a decode step's one each, a
 * prompt chunk's many, a draft's few), through every layer, to the logits of the rows asked
 * for. It does what decode_step.py does with PyTorch's operations, without an operation's
 * dispatch, a tensor's allocation or a line of Python per layer: a step of a small model on
 * a CPU spends more time in those than in its arithmetic (bench/README.md has the profile).
 *
 * The products and the attention are the worker's own kernels (int8_kernel.c or
 * gguf_kernel.c, exact_attention.c), called through the addresses Python hands over: the
 * same functions, the same numbers as in decode_step.py. What this file computes itself
 * has an order of its own, fixed whatever rows a call holds, so that a position's numbers
 * depend on its tokens alone, never on the chunk or step it is computed in:
 *   RMSNorm:  s = sum of x[i]^2 in double, i from 0 up; r = 1 / sqrt((float)(s / n) + eps);
 *             y[i] = w[i] * (x[i] * r), each product rounded to float (w: Llama's weight,
 *             Gemma's 1 + weight, made in float32 once);
 *   RoPE:     y[d] = x[d] * cos[d] + x[(d + dim/2) % dim] * sin'[d] (sin' with its first
 *             half negated), as decode_step's _rotate;
 *   SiLU:     silu(g) = g / (1 + e) for g >= 0 and g * e / (1 + e) below, e = exp(-|g|);
 *   GELU (tanh form, Gemma): 0.5 * g * (1 + tanh(0.7978845608 * (g + 0.044715 * g^3))),
 *             tanh(y) = sign(y) * (1 - e) / (1 + e), e = exp(-2|y|);
 *             exp being expf_nonpositive below (a polynomial: the same bits on every machine).
 * Built with -ffp-contract=off, like the kernels it calls: no multiply and add fused.
 *
 * With arithmetic LLAMA_CPP (a Llama model on a gguf file's blocks) the pass computes what
 * llama.cpp's CPU backend computes instead (its release build on an AVX-512 processor, read from
 * its tensors layer by layer: bench/README.md): RMSNorm with each square rounded to float, RoPE
 * as rotate_ggml with lmw_llama_cpp_rope's tables, the query, keys and values rounded to float16,
 * attention as attend_ggml (every row, steps too), SwiGLU as g / (1 + ggml_expf(-g)) · up.
 */
#define _GNU_SOURCE /* sincosf */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#endif

typedef int (*int8_function)(const void *packed, const float *scale, int64_t outputs, int64_t inputs,
                             const float *x, int64_t n, int64_t x_stride, float *out, int threads);
typedef int (*gguf_function)(int type, const void *blocks, int64_t outputs, int64_t inputs, const float *x,
                             int64_t n, int64_t x_stride, float *out, int threads);
typedef int (*attention_function)(const float *q, int64_t qsb, int64_t qsh, int64_t qsi, const float *k,
                                  int64_t ksb, int64_t ksh, int64_t ksj, const float *v, int64_t vsb, int64_t vsh,
                                  int64_t vsj, const int64_t *lo, const int64_t *hi, float *out, int64_t batch,
                                  int64_t heads, int64_t kv_heads, int64_t positions, int64_t dim, float scale,
                                  int threads);
typedef int (*step_function)(const float *q, int64_t qsb, int64_t qsh, const float *nk, int64_t nksb, int64_t nksh,
                             const float *nv, int64_t nvsb, int64_t nvsh, const int64_t *kb, const int64_t *vb,
                             const int64_t *kh, const int64_t *vh, const int64_t *tb, const int64_t *th,
                             const int64_t *tc, const int64_t *lo, const int64_t *hi, float *out, int64_t batch,
                             int64_t heads, int64_t kv_heads, int64_t dim, float scale, int threads);

/* One linear's weights and the kernel that multiplies them (outputs 0: none). */
struct product {
    void *function; /* lmw_int8_matmul (type < 0) or lmw_gguf_matmul */
    int64_t type;   /* the gguf block type; -1 for int8 rows */
    const void *weights;
    const float *scale; /* int8 rows' scales */
    int64_t outputs, inputs;
};

/* q, k and v (or all three in qkv[0], the others without outputs); gate and up likewise.
 * Gemma 3 (and Qwen3) also normalize each query and key head, Gemma 3 each sublayer's output
 * before it joins the residual stream; Qwen2 adds a bias to q, k and v (qkv_bias: their
 * outputs' width). NULL where a model does not. */
struct layer {
    const float *norm_in, *norm_mid, *norm_q, *norm_k, *norm_attended, *norm_out, *qkv_bias;
    int64_t window; /* a sliding-window layer attends this many positions up to its own; 0: all */
    int64_t rope;   /* which of the pass's (cos, sin) tables it rotates with */
    struct product qkv[3], out, gate_up[2], down;
};

enum activation { SILU, GELU_TANH };

struct model {
    int64_t layers, hidden, heads, kv_heads, dim, intermediate, vocab, activation;
    float epsilon, scaling;
    int64_t share_from; /* work of at least this much (multiply-adds, numbers) takes every thread */
    const float *norm;
    struct product head;
    const struct layer *layer;
    void *attention, *step; /* exact_attention.c's lmw_attention and lmw_step_attention */
    int64_t arithmetic;     /* OWN, or LLAMA_CPP: llama.cpp's CPU arithmetic (a Llama model on gguf blocks) */
};

enum arithmetic { OWN, LLAMA_CPP };

/* One pass: `sequences` sequences, each bringing rows[b] new positions after the lengths[b] it
 * holds; their rows one after another in `hidden` (the embeddings, overwritten). */
struct pass {
    int64_t sequences;
    const int64_t *rows, *lengths;
    const int64_t *kb, *vb, *kh, *vh; /* [b * layers + layer]: buffers' addresses (room for the new
                                         positions made), floats between their heads */
    const int64_t *tb, *th, *tc;      /* [b * layers + layer]: where a step keeps the keys transposed
                                         (lmw_step_attention's tb, th, tc) */
    float *hidden;
    const float *cos, *sin; /* (ropes, total, dim) each, sin signed */
    const int64_t *wanted;  /* rows whose logits are asked for, in order */
    int64_t wanted_count;
    float *logits; /* (wanted_count, vocab) */
    int64_t *best; /* wanted_count: the index of each row's highest logit (lmw_highest); NULL: not asked */
    int threads;
};

/* The threads for work of `work` multiply-adds (or numbers): one below the model's share_from. */
static inline int threads_for(const struct model *m, const struct pass *p, int64_t work) {
    return work >= m->share_from ? p->threads : 1;
}

/* Attention's multiply-adds over `pairs` query-key pairs: a score and a weighted sum each, as
 * torch_threads.attention_work counts them. */
static inline int64_t attention_work(int64_t pairs, int64_t dim) { return pairs * 2 * dim; }

/* exp(x) for x <= 0: 2^n times a polynomial of the rest (Cephes' expf); 0 below -87, NaN for NaN.
 * Without a branch (the part below -87 computes exp(-87) and drops it), so that loops of it
 * are vectorized: the lanes do the same operations as this code does for one number. */
static inline float expf_nonpositive(float x) {
    const float c = x >= -87.0f ? x : -87.0f;
    const float n = floorf(c * 1.44269504088896341f + 0.5f);
    float r = c - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    const float r2 = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r2 + r;
    p = p + 1.0f;
    float scale;
    const int32_t bits = ((int32_t)n + 127) << 23;
    memcpy(&scale, &bits, sizeof scale);
    const float e = p * scale;
    return x >= -87.0f ? e : x != x ? x : 0.0f;
}

static inline float silu(float g) {
    const float e = expf_nonpositive(-fabsf(g));
    const float positive = g / (1.0f + e), negative = (g * e) / (1.0f + e);
    return g >= 0.0f ? positive : negative;
}

static inline float gelu_tanh(float g) {
    const float y = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
    const float e = expf_nonpositive(-2.0f * fabsf(y));
    const float t = (1.0f - e) / (1.0f + e);
    return 0.5f * g * (1.0f + (y >= 0.0f ? t : -t));
}

static void rms_norm(const float *x, const float *weight, int64_t n, float epsilon, float *y) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double)x[i] * (double)x[i];
    const float r = 1.0f / sqrtf((float)(sum / (double)n) + epsilon);
    for (int64_t i = 0; i < n; i++) y[i] = weight[i] * (x[i] * r);
}

/* ggml's: each square rounded to float before the sum in double. */
static void rms_norm_ggml(const float *x, const float *weight, int64_t n, float epsilon, float *y) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    const float r = 1.0f / sqrtf((float)(sum / (double)n) + epsilon);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * r) * weight[i];
}

static void norm(const struct model *m, const float *x, const float *weight, int64_t n, float *y) {
    if (m->arithmetic == LLAMA_CPP)
        rms_norm_ggml(x, weight, n, m->epsilon, y);
    else
        rms_norm(x, weight, n, m->epsilon, y);
}

/* ggml_v_expf (AVX-512) written out number by number: exp(x) as llama.cpp's SwiGLU computes it. */
static inline float ggml_expf(float x) {
    const float z = fmaf(x, 0x1.715476p+0f, 0x1.8p23f);
    const float n = z - 0x1.8p23f;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)), u,
                         fmaf(0x1.ffffecp-1f, b, 1.0f));
    if (fabsf(n) > 192.0f) return n <= 0.0f ? 0.0f : INFINITY;
    return ldexpf(j, (int)n);
}

/* ggml's rotation of a pair (x0, x1) = (x[d], x[d + half]): fma(x0, c, -(x1 s)), fma(x0, s, x1 c)
 * (sin's first half holds -s). */
static void rotate_ggml(float *row, int64_t heads, int64_t dim, const float *cos, const float *sin) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *head = row + h * dim;
        for (int64_t d = 0; d < half; d++) {
            const float x0 = head[d], x1 = head[d + half];
            head[d] = fmaf(x0, cos[d], x1 * sin[d]);
            head[d + half] = fmaf(x0, sin[d + half], x1 * cos[d + half]);
        }
    }
}

/* llama.cpp's (cos, signed sin) rows for positions first, first + 1, ...: theta = p, multiplied
 * by base^(-2/dim) from pair to pair, glibc's sincosf. */
int lmw_llama_cpp_rope(int64_t first, int64_t count, int64_t dim, float base, float *cos, float *sin) {
    const int64_t half = dim / 2;
    const float theta_scale = powf(base, -2.0f / (float)dim);
    for (int64_t r = 0; r < count; r++) {
        float theta = (float)(first + r);
        for (int64_t i = 0; i < half; i++) {
            float s, c;
            sincosf(theta, &s, &c);
            cos[r * dim + i] = cos[r * dim + i + half] = c;
            sin[r * dim + i] = -s;
            sin[r * dim + i + half] = s;
            theta *= theta_scale;
        }
    }
    return 0;
}

/* ggml_vec_dot_f16 on AVX-512 for a head of float16 numbers (kept as floats), taken in the gguf's
 * order (rotary pairs adjacent: element e is the worker's e / 2, or e / 2 + dim / 2 for odd e):
 * 4 accumulators of 16 lanes over each 64 numbers, x0 + x2, x1 + x3, x0 + x1, then
 * _mm512_reduce_add_ps's tree, through double; numbers past a multiple of 64 added in double. */
static float dot_ggml(const float *k, const float *q, int64_t dim) {
    const int64_t half = dim / 2, whole = dim / 64 * 64;
    float acc[4][16] = {{0}};
    for (int64_t e = 0; e < whole; e++) {
        const int64_t at = e % 2 ? e / 2 + half : e / 2;
        acc[(e / 16) % 4][e % 16] = fmaf(k[at], q[at], acc[(e / 16) % 4][e % 16]);
    }
    for (int l = 0; l < 16; l++) acc[0][l] = acc[0][l] + acc[2][l], acc[1][l] = acc[1][l] + acc[3][l];
    for (int l = 0; l < 16; l++) acc[0][l] = acc[0][l] + acc[1][l];
    float a[8], b[4];
    for (int i = 0; i < 8; i++) a[i] = acc[0][i + 8] + acc[0][i];
    for (int i = 0; i < 4; i++) b[i] = a[i + 4] + a[i];
    double sum = (double)((b[0] + b[2]) + (b[1] + b[3]));
    for (int64_t e = whole; e < dim; e++) {
        const int64_t at = e % 2 ? e / 2 + half : e / 2;
        sum += (double)(k[at] * q[at]);
    }
    return (float)sum;
}

static inline float half_rounded(float x) { return (float)(_Float16)x; }

/* llama.cpp's online softmax taking a key's score s: the running sum's factor `shrink` (1 unless s
 * is the largest yet) and the key's `weight`, the largest score and the sum of weights kept. */
static inline void online_step(float s, float *top, float *total, float *shrink, float *weight) {
    *shrink = 1.0f, *weight = 1.0f;
    if (s > *top) {
        *shrink = expf(*top - s);
        *top = s;
    } else {
        *weight = expf(s - *top);
    }
    *total = *total * *shrink;
    *total = *total + *weight;
}

/* One query row (float16 numbers) attending keys lo..hi-1 as llama.cpp's CPU flash attention
 * does for batches under 64 rows and up to 512 positions: an online softmax with glibc's expf,
 * the weighted sum of values a float16 vector, the sum of weights in two roundings. */
static void attend_ggml_plain(const float *q, const float *keys, int64_t kj, const float *values, int64_t vj, int64_t lo,
                        int64_t hi, int64_t dim, float scale, float *out) {
    float acc[dim];
    for (int64_t d = 0; d < dim; d++) acc[d] = 0.0f;
    float top = -INFINITY, total = 0.0f;
    for (int64_t t = lo; t < hi; t++) {
        float shrink, weight;
        online_step(dot_ggml(keys + t * kj, q, dim) * scale, &top, &total, &shrink, &weight);
        if (shrink != 1.0f)
            for (int64_t d = 0; d < dim; d++) acc[d] = half_rounded(acc[d] * shrink);
        const float *v = values + t * vj;
        for (int64_t d = 0; d < dim; d++) acc[d] = half_rounded(fmaf(v[d], weight, acc[d]));
    }
    const float inverse = 1.0f / total;
    for (int64_t d = 0; d < dim; d++) out[d] = acc[d] * inverse;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* dot_ggml and attend_ggml_plain, 16 numbers to an instruction, the same operations in the same
 * order: a gguf-order chunk of 16 is 8 numbers of the first half interleaved with 8 of the
 * second; each product is fmaf(k, q, lane) as there; the lanes' tree is theirs; the weighted
 * sum is a fused multiply-add rounded to float16 per number, as there. */
static const int32_t INTERLEAVED[2][16] = {{0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23},
                                           {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31}};

/* gguf-order chunks c and c + 1 of a head (c even): from numbers 8c on of each half. */
static inline void ggml_chunks(const float *x, int64_t half, int64_t c, __m512 *even, __m512 *odd) {
    const __m512 a = _mm512_loadu_ps(x + 8 * c), b = _mm512_loadu_ps(x + half + 8 * c);
    *even = _mm512_permutex2var_ps(a, _mm512_loadu_si512(INTERLEAVED[0]), b);
    *odd = _mm512_permutex2var_ps(a, _mm512_loadu_si512(INTERLEAVED[1]), b);
}

/* A head of D · 16 numbers (D 4 or 8: 64 or 128, which dot_ggml takes whole, nothing past a
 * multiple of 64) in gguf order, chunks of 16. */
static inline void ggml_order(const float *x, int D, __m512 *out) {
    for (int c = 0; c < D; c += 2) ggml_chunks(x, 8 * D, c, &out[c], &out[c + 1]);
}

/* dot_ggml of a key with a query, both in gguf order (ggml_order), D · 16 numbers. */
static inline float dot_ggml_wide(const __m512 *kg, const __m512 *qg, int D) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int c = 0; c < D; c++) acc[c % 4] = _mm512_fmadd_ps(kg[c], qg[c], acc[c % 4]);
    const __m512 x = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
    const __m256 a = _mm256_add_ps(_mm512_extractf32x8_ps(x, 1), _mm512_castps512_ps256(x));
    const __m128 b = _mm_add_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
    float lanes[4];
    _mm_storeu_ps(lanes, b);
    return (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]); /* through double and back: the same float */
}

static inline __m512 half_rounded16(__m512 x) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* attend_ggml_plain for G rows (1 to MOST_TOGETHER; query heads of one key/value head, so the
 * same keys and values) of D · 16 numbers (D 4 or 8), their sums held in registers. Each row's
 * operations and order are its own alone; the rows go side by side because a row's chain of
 * float16 roundings waits on itself (on an Intel Xeon a conversion takes 7 cycles), and a key
 * is put in gguf order once for them all. A row's keys go KEYS_TOGETHER at a time, each phase
 * (scores, the online softmax's steps, the sums) in key order, so every number is computed as
 * one key at a time computes it. */
#define MOST_TOGETHER 4
#define KEYS_TOGETHER 16 /* keys whose scores, then softmax steps, then sums go together: glibc's expf,
                            a call, would otherwise have the sums' registers saved and restored at every key */
static inline __attribute__((always_inline)) void attend_ggml_wide(const float *q, int64_t qh, const float *keys,
                                                                    int64_t kj, const float *values, int64_t vj,
                                                                    int64_t lo, int64_t hi, float scale, float *out,
                                                                    int64_t oh, int D, int G) {
    __m512 acc[MOST_TOGETHER][8], qg[MOST_TOGETHER][8];
    float top[MOST_TOGETHER], total[MOST_TOGETHER];
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < D; c++) acc[g][c] = _mm512_setzero_ps();
        ggml_order(q + g * qh, D, qg[g]);
        top[g] = -INFINITY, total[g] = 0.0f;
    }
    for (int64_t t0 = lo; t0 < hi; t0 += KEYS_TOGETHER) {
        const int n = hi - t0 < KEYS_TOGETHER ? (int)(hi - t0) : KEYS_TOGETHER;
        float scores[MOST_TOGETHER][KEYS_TOGETHER], shrink[MOST_TOGETHER][KEYS_TOGETHER], weight[MOST_TOGETHER][KEYS_TOGETHER];
        for (int j = 0; j < n; j++) {
            __m512 kg[8];
            ggml_order(keys + (t0 + j) * kj, D, kg);
            for (int g = 0; g < G; g++) scores[g][j] = dot_ggml_wide(kg, qg[g], D) * scale;
        }
        for (int g = 0; g < G; g++)
            for (int j = 0; j < n; j++) online_step(scores[g][j], &top[g], &total[g], &shrink[g][j], &weight[g][j]);
        for (int j = 0; j < n; j++) {
            const float *v = values + (t0 + j) * vj;
            for (int g = 0; g < G; g++) {
                if (shrink[g][j] != 1.0f)
                    for (int c = 0; c < D; c++)
                        acc[g][c] = half_rounded16(_mm512_mul_ps(acc[g][c], _mm512_set1_ps(shrink[g][j])));
                for (int c = 0; c < D; c++)
                    acc[g][c] = half_rounded16(
                        _mm512_fmadd_ps(_mm512_loadu_ps(v + 16 * c), _mm512_set1_ps(weight[g][j]), acc[g][c]));
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const float inverse = 1.0f / total[g];
        for (int c = 0; c < D; c++)
            _mm512_storeu_ps(out + g * oh + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inverse)));
    }
}
#endif

/* `count` query rows (float16 numbers; heads of one key/value head, `qh` floats apart, their
 * outputs `oh` apart) attending keys lo..hi-1 as llama.cpp's CPU flash attention does
 * (attend_ggml_plain): where the processor has AVX-512 and the heads are of 64 or 128, 16
 * numbers at a time and up to MOST_TOGETHER rows side by side, each row's numbers as alone. */
static void attend_ggml(const float *q, int64_t qh, int64_t count, const float *keys, int64_t kj, const float *values,
                        int64_t vj, int64_t lo, int64_t hi, int64_t dim, float scale, float *out, int64_t oh) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    if (dim == 64 || dim == 128) {
        for (int64_t r = 0; r < count; r += MOST_TOGETHER) {
            const float *rq = q + r * qh;
            float *ro = out + r * oh;
            /* D and G constants at each call, so that the sums stay in registers */
#define WIDE(G) dim == 64 ? attend_ggml_wide(rq, qh, keys, kj, values, vj, lo, hi, scale, ro, oh, 4, G) \
                          : attend_ggml_wide(rq, qh, keys, kj, values, vj, lo, hi, scale, ro, oh, 8, G)
            switch (count - r < MOST_TOGETHER ? count - r : MOST_TOGETHER) {
            case 1: WIDE(1); break;
            case 2: WIDE(2); break;
            case 3: WIDE(3); break;
            default: WIDE(4);
            }
#undef WIDE
        }
        return;
    }
#endif
    for (int64_t r = 0; r < count; r++) attend_ggml_plain(q + r * qh, keys, kj, values, vj, lo, hi, dim, scale, out + r * oh);
}

/* Each head of a row rotated in place (decode_step's _rotate). */
static void rotate(float *row, int64_t heads, int64_t dim, const float *cos, const float *sin) {
    const int64_t half = dim / 2;
    float x[dim];
    for (int64_t h = 0; h < heads; h++) {
        float *head = row + h * dim;
        memcpy(x, head, (size_t)dim * sizeof(float));
        /* x[(d + half) % dim], in two halves (a division per number would cost more than the rest) */
        for (int64_t d = 0; d < half; d++) head[d] = x[d] * cos[d] + x[d + half] * sin[d];
        for (int64_t d = half; d < dim; d++) head[d] = x[d] * cos[d] + x[d - half] * sin[d];
    }
}

/* out (n rows, p->outputs apart) = x's rows times the weights. */
static int multiply(const struct model *m, const struct pass *pass, const struct product *p, const float *x, int64_t n,
                    int64_t x_stride, float *out) {
    const int threads = threads_for(m, pass, n * p->outputs * p->inputs);
    if (p->type < 0)
        return ((int8_function)p->function)(p->weights, p->scale, p->outputs, p->inputs, x, n, x_stride, out, threads);
    return ((gguf_function)p->function)((int)p->type, p->weights, p->outputs, p->inputs, x, n, x_stride, out, threads);
}

/* Products of linears that read the same input, side by side in `out` (n rows, `width` apart);
 * `spare` has room for n rows of the widest. */
static int multiply_side_by_side(const struct model *m, const struct pass *pass, const struct product *products,
                                 int count, const float *x, int64_t n, int64_t x_stride, float *out, int64_t width,
                                 float *spare) {
    if (products[0].outputs == width) return multiply(m, pass, products, x, n, x_stride, out);
    int64_t column = 0;
    for (int i = 0; i < count; i++) {
        const struct product *p = products + i;
        if (multiply(m, pass, p, x, n, x_stride, spare)) return 1;
        for (int64_t r = 0; r < n; r++)
            memcpy(out + r * width + column, spare + r * p->outputs, (size_t)p->outputs * sizeof(float));
        column += p->outputs;
    }
    return 0;
}

/* Scratch space of a pass (floats). */
struct scratch {
    float *normed, *qkv, *attended, *added, *gate_up, *act, *spare, *step_rows, *step_out;
    int64_t *lo, *hi;  /* sequences + total each: the step call's rows first, then another call's */
    int64_t *kb, *vb, *kh, *vh, *tb, *th, *tc; /* sequences each: the step call's buffers */
};

/* Attention of layer l: each sequence's new keys and values written into its buffers, then
 * its rows attend: sequences of one new row together in one step call, the others each in
 * a call of their own (the kernel gives a row the same numbers either way). */
/* The first key a row attending keys up to hi (exclusive) sees. */
static inline int64_t visible(int64_t window, int64_t hi) { return window > 0 && hi > window ? hi - window : 0; }

static int attend(const struct model *m, const struct pass *p, int64_t l, const struct scratch *s, int64_t qkv_width) {
    const int64_t heads = m->heads, kv_heads = m->kv_heads, dim = m->dim, width = heads * dim;
    const int64_t window = m->layer[l].window;
    const float *q = s->qkv, *k = s->qkv + width, *v = s->qkv + width + kv_heads * dim;
    int64_t first = 0, singles = 0, step_keys = 0;
    for (int64_t b = 0; b < p->sequences; b++) {
        const int64_t at = b * m->layers + l, rows = p->rows[b], length = p->lengths[b];
        float *keys = (float *)(intptr_t)p->kb[at], *values = (float *)(intptr_t)p->vb[at];
        if (m->arithmetic == LLAMA_CPP) {
            for (int64_t i = 0; i < rows; i++)
                for (int64_t h = 0; h < kv_heads; h++) {
                    const int64_t from = (first + i) * qkv_width + h * dim, to = (length + i) * dim;
                    memcpy(keys + h * p->kh[at] + to, k + from, (size_t)dim * sizeof(float));
                    memcpy(values + h * p->vh[at] + to, v + from, (size_t)dim * sizeof(float));
                }
            const int threads = threads_for(m, p, attention_work(heads * rows * (length + rows), dim));
            /* a prompt's rows a key/value head's query heads together; a step's a head apiece, so
             * that its few items still share out between the threads */
            const int64_t group = heads / kv_heads, together = rows > 1 ? group : 1, units = heads / together;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static) collapse(2)
            for (int64_t i = 0; i < rows; i++)
                for (int64_t u = 0; u < units; u++) {
                    const int64_t hi = length + i + 1, h = u * together, kvh = h / group;
                    attend_ggml(q + (first + i) * qkv_width + h * dim, dim, together, keys + kvh * p->kh[at], dim,
                                values + kvh * p->vh[at], dim, visible(window, hi), hi, dim, m->scaling,
                                s->attended + (first + i) * width + h * dim, dim);
                }
        } else if (rows == 1) {
            float *row = s->step_rows + singles * qkv_width;
            memcpy(row, s->qkv + first * qkv_width, (size_t)qkv_width * sizeof(float));
            s->lo[singles] = visible(window, length + 1), s->hi[singles] = length + 1;
            step_keys += length + 1 - s->lo[singles];
            singles++;
        } else {
            for (int64_t i = 0; i < rows; i++)
                for (int64_t h = 0; h < kv_heads; h++) {
                    const int64_t from = (first + i) * qkv_width + h * dim, to = (length + i) * dim;
                    memcpy(keys + h * p->kh[at] + to, k + from, (size_t)dim * sizeof(float));
                    memcpy(values + h * p->vh[at] + to, v + from, (size_t)dim * sizeof(float));
                }
            int64_t *lo = s->lo + p->sequences, *hi = s->hi + p->sequences;
            for (int64_t i = 0; i < rows; i++) hi[i] = length + i + 1, lo[i] = visible(window, hi[i]);
            const int threads = threads_for(m, p, attention_work(heads * rows * (length + rows), dim));
            if (((attention_function)m->attention)(q + first * qkv_width, 0, dim, qkv_width, keys, 0, p->kh[at], dim,
                                                   values, 0, p->vh[at], dim, lo, hi, s->attended + first * width, 1,
                                                   heads, kv_heads, rows, dim, m->scaling, threads))
                return 1;
        }
        first += rows;
    }
    if (singles == 0) return 0;
    /* the step call's buffers: those of the sequences with one new row, in order */
    int64_t one = 0;
    for (int64_t b = 0; b < p->sequences; b++)
        if (p->rows[b] == 1) {
            const int64_t at = b * m->layers + l;
            s->kb[one] = p->kb[at], s->vb[one] = p->vb[at], s->kh[one] = p->kh[at], s->vh[one] = p->vh[at];
            s->tb[one] = p->tb[at], s->th[one] = p->th[at], s->tc[one] = p->tc[at];
            one++;
        }
    const int threads = threads_for(m, p, attention_work(heads * step_keys, dim));
    const float *rows = s->step_rows;
    if (((step_function)m->step)(rows, qkv_width, dim, rows + width, qkv_width, dim, rows + width + kv_heads * dim,
                                 qkv_width, dim, s->kb, s->vb, s->kh, s->vh, s->tb, s->th, s->tc, s->lo, s->hi,
                                 s->step_out, singles, heads, kv_heads, dim, m->scaling, threads))
        return 1;
    first = 0, one = 0;
    for (int64_t b = 0; b < p->sequences; b++) {
        if (p->rows[b] == 1)
            memcpy(s->attended + first * width, s->step_out + (one++) * width, (size_t)width * sizeof(float));
        first += p->rows[b];
    }
    return 0;
}

/* The row loops below share their rows among the threads where they hold enough numbers: a
 * row's numbers are its own whichever thread computes them. */

/* y's rows = x's rows normalized (RMSNorm with `weight`). */
static void norm_rows(const struct model *m, const struct pass *p, const float *x, const float *weight,
                      int64_t total, float *y) {
    const int64_t width = m->hidden;
    const int threads = threads_for(m, p, total * width);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < total; r++) norm(m, x + r * width, weight, width, y + r * width);
}

/* hidden += a sublayer's output (normalized first where `norm` is given), row by row. */
static void add_to_stream(const struct model *m, const struct pass *p, float *added, int64_t total,
                          const float *sublayer_norm) {
    const int64_t width = m->hidden;
    const int threads = threads_for(m, p, total * width);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < total; r++) {
        float *row = added + r * width, *into = p->hidden + r * width;
        if (sublayer_norm != NULL) norm(m, row, sublayer_norm, width, row);
        for (int64_t i = 0; i < width; i++) into[i] = into[i] + row[i];
    }
}

/* Each row's q, k and v given their bias (Qwen2), its query and key heads normalized (Gemma 3,
 * Qwen3) and rotated, in place. */
static void place_heads(const struct model *m, const struct pass *p, const struct layer *layer, float *qkv,
                        int64_t qkv_width, int64_t total) {
    const int64_t dim = m->dim, width = m->heads * dim;
    const float *cos = p->cos + layer->rope * total * dim, *sin = p->sin + layer->rope * total * dim;
    const int threads = threads_for(m, p, total * qkv_width);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < total; r++) {
        float *row = qkv + r * qkv_width;
        if (layer->qkv_bias != NULL) /* a linear's bias joins its product's output, as F.linear's does */
            for (int64_t i = 0; i < qkv_width; i++) row[i] = row[i] + layer->qkv_bias[i];
        if (layer->norm_q != NULL) {
            for (int64_t h = 0; h < m->heads; h++) rms_norm(row + h * dim, layer->norm_q, dim, m->epsilon, row + h * dim);
            for (int64_t h = 0; h < m->kv_heads; h++)
                rms_norm(row + width + h * dim, layer->norm_k, dim, m->epsilon, row + width + h * dim);
        }
        void (*turn)(float *, int64_t, int64_t, const float *, const float *) =
            m->arithmetic == LLAMA_CPP ? rotate_ggml : rotate;
        turn(row, m->heads, dim, cos + r * dim, sin + r * dim);
        turn(row + width, m->kv_heads, dim, cos + r * dim, sin + r * dim);
        if (m->arithmetic == LLAMA_CPP) /* llama.cpp's query, and its KV cache, in float16 */
            for (int64_t i = 0; i < width + 2 * m->kv_heads * dim; i++) row[i] = half_rounded(row[i]);
    }
}

/* act's rows = activation(gate) * up, from gate_up's rows (gate, then up). */
static void activate(const struct model *m, const struct pass *p, const float *gate_up, int64_t total, float *act) {
    const int64_t inner = m->intermediate;
    const int threads = threads_for(m, p, total * inner);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < total; r++) {
        const float *gate = gate_up + r * 2 * inner, *up = gate + inner;
        float *out = act + r * inner;
        if (m->arithmetic == LLAMA_CPP) /* ggml's SwiGLU: its vector exp, libm's for the last inner % 16 */
            for (int64_t i = 0; i < inner; i++)
                out[i] = gate[i] / (1.0f + (i < inner / 16 * 16 ? ggml_expf(0.0f - gate[i]) : expf(-gate[i]))) * up[i];
        else if (m->activation == GELU_TANH)
            for (int64_t i = 0; i < inner; i++) out[i] = gelu_tanh(gate[i]) * up[i];
        else
            for (int64_t i = 0; i < inner; i++) out[i] = silu(gate[i]) * up[i];
    }
}

static int layer_pass(const struct model *m, const struct pass *p, int64_t l, const struct scratch *s, int64_t total) {
    const struct layer *layer = m->layer + l;
    const int64_t hidden = m->hidden, dim = m->dim, width = m->heads * dim;
    const int64_t qkv_width = width + 2 * m->kv_heads * dim, inner = m->intermediate;
    norm_rows(m, p, p->hidden, layer->norm_in, total, s->normed);
    if (multiply_side_by_side(m, p, layer->qkv, 3, s->normed, total, hidden, s->qkv, qkv_width, s->spare))
        return 1;
    place_heads(m, p, layer, s->qkv, qkv_width, total);
    if (attend(m, p, l, s, qkv_width)) return 1;
    if (multiply(m, p, &layer->out, s->attended, total, width, s->added)) return 1;
    add_to_stream(m, p, s->added, total, layer->norm_attended);
    norm_rows(m, p, p->hidden, layer->norm_mid, total, s->normed);
    if (multiply_side_by_side(m, p, layer->gate_up, 2, s->normed, total, hidden, s->gate_up, 2 * inner, s->spare))
        return 1;
    activate(m, p, s->gate_up, total, s->act);
    if (multiply(m, p, &layer->down, s->act, total, inner, s->added)) return 1;
    add_to_stream(m, p, s->added, total, layer->norm_out);
    return 0;
}

/* The index of the highest of x[lo..hi): the first of equal ones, and the first NaN where there
 * is one (numpy's argmax, the sampler's greedy choice). LANES running maxima, each with the
 * first place it took its value (a strict > keeps the first) and the first NaN of its lane: one
 * pass that vectorizes, where finding the maximum and then its place read the numbers twice. */
#define LANES 16
typedef float lanes_f __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t lanes_i __attribute__((vector_size(LANES * sizeof(int32_t))));

static int64_t highest_in(const float *x, int64_t lo, int64_t hi) {
    if (hi - lo < LANES) {
        int64_t best = lo;
        for (int64_t i = lo; i < hi; i++) {
            if (x[i] != x[i]) return i;
            if (x[i] > x[best]) best = i;
        }
        return best;
    }
    const lanes_i none = (lanes_i){0} + INT32_MAX, step = (lanes_i){0} + LANES;
    lanes_f most;
    lanes_i at, place;
    memcpy(&most, x + lo, sizeof most);
    for (int l = 0; l < LANES; l++) at[l] = (int32_t)(lo + l);
    place = at;
    lanes_i nan_at = ((most != most) & at) | (~(most != most) & none);
    const int64_t whole = lo + (hi - lo) / LANES * LANES;
    for (int64_t i = lo + LANES; i < whole; i += LANES) {
        lanes_f v;
        memcpy(&v, x + i, sizeof v);
        place += step;
        const lanes_i more = v > most, odd = (v != v) & (nan_at == none);
        most = (lanes_f)((more & (lanes_i)v) | (~more & (lanes_i)most));
        at = (more & place) | (~more & at);
        nan_at = (odd & place) | (~odd & nan_at);
    }
    int64_t best = at[0], first_nan = INT64_MAX;
    float top = most[0];
    for (int l = 0; l < LANES; l++) {
        if (nan_at[l] != INT32_MAX && nan_at[l] < first_nan) first_nan = nan_at[l];
        if (most[l] > top || (most[l] == top && at[l] < best)) top = most[l], best = at[l];
    }
    for (int64_t i = whole; i < hi; i++) {
        if (x[i] != x[i] && i < first_nan) first_nan = i;
        if (x[i] > top) top = x[i], best = i;
    }
    return first_nan != INT64_MAX ? first_nan : best;
}

/* best[r] = the index of the highest of row r of x (rows of n): each of `threads` threads takes
 * its part of every row, the part of the outputs it computed in the product before (equal parts,
 * as the kernels share their work items), so that it reads numbers its core's cache holds; the
 * parts are then taken in order. Returns 0, or 1 when memory ran out. */
int lmw_highest(const float *x, int64_t rows, int64_t n, int64_t *best, int threads) {
    int64_t *found = malloc((size_t)(rows * threads) * sizeof(int64_t));
    if (found == NULL) return 1;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int t = 0; t < threads; t++)
        for (int64_t r = 0; r < rows; r++)
            found[r * threads + t] = highest_in(x + r * n, n * t / threads, n * (t + 1) / threads);
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        int64_t pick = found[r * threads];
        for (int t = 1; t < threads && row[pick] == row[pick]; t++) {
            const int64_t other = found[r * threads + t];
            if (row[other] != row[other] || row[other] > row[pick]) pick = other;
        }
        best[r] = pick;
    }
    free(found);
    return 0;
}

/* The pass; returns 0, or 1 when memory ran out. */
int lmw_forward(const struct model *m, const struct pass *p) {
    int64_t total = 0;
    for (int64_t b = 0; b < p->sequences; b++) total += p->rows[b];
    const int64_t hidden = m->hidden, width = m->heads * m->dim, inner = m->intermediate;
    const int64_t qkv_width = width + 2 * m->kv_heads * m->dim;
    int64_t widest = qkv_width > 2 * inner ? qkv_width : 2 * inner;
    const int64_t rows = total > p->wanted_count ? total : p->wanted_count;
    const int64_t floats = rows * (hidden + qkv_width + width + hidden + 2 * inner + inner + widest + qkv_width + width);
    float *room = malloc((size_t)floats * sizeof(float));
    int64_t *places = malloc((size_t)(2 * (p->sequences + total) + 7 * p->sequences) * sizeof(int64_t));
    int status = 1;
    if (room == NULL || places == NULL) goto done;
    struct scratch s;
    s.normed = room, s.qkv = s.normed + rows * hidden, s.attended = s.qkv + rows * qkv_width;
    s.added = s.attended + rows * width, s.gate_up = s.added + rows * hidden, s.act = s.gate_up + rows * 2 * inner;
    s.spare = s.act + rows * inner, s.step_rows = s.spare + rows * widest, s.step_out = s.step_rows + rows * qkv_width;
    s.lo = places, s.hi = s.lo + p->sequences + total, s.kb = s.hi + p->sequences + total;
    s.vb = s.kb + p->sequences, s.kh = s.vb + p->sequences, s.vh = s.kh + p->sequences;
    s.tb = s.vh + p->sequences, s.th = s.tb + p->sequences, s.tc = s.th + p->sequences;
    for (int64_t l = 0; l < m->layers; l++)
        if (layer_pass(m, p, l, &s, total)) goto done;
    for (int64_t i = 0; i < p->wanted_count; i++)
        norm(m, p->hidden + p->wanted[i] * hidden, m->norm, hidden, s.normed + i * hidden);
    status = multiply(m, p, &m->head, s.normed, p->wanted_count, hidden, p->logits);
    if (status == 0 && p->best != NULL) /* on the threads of the head's product, each part where it was computed */
        status = lmw_highest(p->logits, p->wanted_count, m->vocab, p->best,
                             threads_for(m, p, p->wanted_count * m->head.outputs * m->head.inputs));
done:
    free(room);
    free(places);
    return status != 0;
}
