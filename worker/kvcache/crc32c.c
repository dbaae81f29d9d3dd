/* CRC-32C (Castagnoli, the iSCSI checksum: reflected polynomial 0x82F63B78, initial and final
 * value 0xFFFFFFFF) of cache files (worker/kvcache/checksum.py builds and loads this file).
 *
 * lmw_crc32c(crc, data, n) continues ``crc`` over ``n`` bytes as zlib's crc32 continues its
 * CRC-32: lmw_crc32c(0, "123456789", 9) == 0xE3069283, and the CRC of a whole is that of its
 * second part continued from the CRC of its first.
 *
 * Three ways to the same value, chosen when the library is loaded:
 *   - x86-64 with AVX-512 and VPCLMULQDQ: carry-less multiplies folding 256 bytes a step
 *     (below), finished by the crc32 instruction;
 *   - x86-64 with SSE4.2: the crc32 instruction, eight bytes at a time on three independent
 *     streams (its latency is three cycles, its throughput one a cycle), the three streams'
 *     CRCs joined by shifting one over the length of the next (tables of the operator that
 *     feeds that many zero bytes: Mark Adler's construction, crc32c.c of 2013);
 *   - anywhere else: tables, eight bytes a step (slice-by-8).
 * The tables' and the crc32 instruction's ways are exported beside lmw_crc32c
 * (lmw_crc32c_portable, lmw_crc32c_sse42; lmw_crc32c_path says which way lmw_crc32c takes), so
 * that tests compare them on the same bytes.
 */

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LMW_X86 1
#include <immintrin.h>
#endif

#define POLY 0x82F63B78u
#define LONG 8192 /* bytes of each of three streams, then shorter ones: powers of two */
#define SHORT 256

static uint32_t table[8][256];         /* slice-by-8 */
static uint32_t shift_long[4][256];    /* feeds LONG zero bytes to a CRC register */
static uint32_t shift_short[4][256];   /* feeds SHORT zero bytes */
static int path; /* 2: AVX-512 carry-less multiplies, 1: the crc32 instruction, 0: tables */
static uint64_t fold_2048[2], fold_512[2]; /* constants that fold 128 bits over 2048 and 512 bits */

/* --- the operator that feeds zero bytes: a 32x32 matrix over GF(2), a column a word ---------- */

static uint32_t gf2_times(const uint32_t *matrix, uint32_t vector) {
    uint32_t sum = 0;
    while (vector) {
        if (vector & 1) sum ^= *matrix;
        vector >>= 1;
        matrix++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *matrix) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(matrix, matrix[n]);
}

/* The operator that feeds ``length`` zero bytes (a power of two) into ``even``. */
static void zeros_operator(uint32_t *even, size_t length) {
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = POLY; /* one zero bit */
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four */
    do {                   /* one zero byte in even, then two in odd, and so on */
        gf2_square(even, odd);
        length >>= 1;
        if (length == 0) return;
        gf2_square(odd, even);
        length >>= 1;
    } while (length);
    memcpy(even, odd, sizeof odd);
}

static void zeros_tables(uint32_t zeros[4][256], size_t length) {
    uint32_t op[32];
    zeros_operator(op, length);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t shift(uint32_t zeros[4][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

/* x^n mod P, bit-reflected (bit 31 is x^0, bit 0 is x^31). */
static uint32_t x_power(unsigned n) {
    uint32_t r = 0x80000000u;
    while (n--) r = r & 1 ? (r >> 1) ^ POLY : r >> 1;
    return r;
}

/* Folding a 128-bit chunk of the message (bit-reflected: its first byte's lowest bit is its
 * highest power) onto the chunk ``bits`` further on: its high-power half (the register's low
 * 64 bits) times x^(bits+64), its other half times x^bits, modulo P. A reflected carry-less
 * product carries one power of x more than its factors, and a constant in the low 32 bits
 * of its lane stands for itself times x^32: hence the 33. */
static void fold_constants(uint64_t constants[2], unsigned bits) {
    constants[0] = x_power(bits + 64 - 33);
    constants[1] = x_power(bits - 33);
}

__attribute__((constructor)) static void initialise(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t crc = n;
        for (int k = 0; k < 8; k++) crc = crc & 1 ? (crc >> 1) ^ POLY : crc >> 1;
        table[0][n] = crc;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t crc = table[0][n];
        for (int k = 1; k < 8; k++) {
            crc = table[0][crc & 0xff] ^ (crc >> 8);
            table[k][n] = crc;
        }
    }
    zeros_tables(shift_long, LONG);
    zeros_tables(shift_short, SHORT);
    fold_constants(fold_2048, 2048);
    fold_constants(fold_512, 512);
#ifdef LMW_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) path = 1;
    if (path && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq")) path = 2;
#endif
}

/* --- anywhere: slice-by-8 --------------------------------------------------------------------- */

static inline uint64_t load64(const unsigned char *p) {
    uint64_t word;
    memcpy(&word, p, 8); /* unaligned reads allowed; the byte order below is little-endian's */
    return word;
}

uint32_t lmw_crc32c_portable(uint32_t crc, const void *data, size_t length) {
    const unsigned char *next = data;
    uint32_t c = crc ^ 0xFFFFFFFFu;
    while (length && ((uintptr_t)next & 7)) {
        c = table[0][(c ^ *next++) & 0xff] ^ (c >> 8);
        length--;
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (length >= 8) {
        uint64_t word = load64(next) ^ c;
        c = table[7][word & 0xff] ^ table[6][(word >> 8) & 0xff] ^ table[5][(word >> 16) & 0xff] ^
            table[4][(word >> 24) & 0xff] ^ table[3][(word >> 32) & 0xff] ^ table[2][(word >> 40) & 0xff] ^
            table[1][(word >> 48) & 0xff] ^ table[0][word >> 56];
        next += 8;
        length -= 8;
    }
#endif
    while (length--) c = table[0][(c ^ *next++) & 0xff] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* --- x86-64 with SSE4.2: three streams of the crc32 instruction ------------------------------- */

#ifdef LMW_X86
__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t crc, const void *data, size_t length) {
    const unsigned char *next = data;
    uint64_t crc0 = crc ^ 0xFFFFFFFFu;
    while (length && ((uintptr_t)next & 7)) {
        crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
        length--;
    }
    /* three streams of `block` bytes each, joined: crc0 over the first, shifted over the
     * second's length and xored with the second's CRC from zero, and so on */
    const size_t blocks[2] = {LONG, SHORT};
    for (int b = 0; b < 2; b++) {
        size_t block = blocks[b];
        while (length >= 3 * block) {
            uint64_t crc1 = 0, crc2 = 0;
            const unsigned char *end = next + block;
            do {
                crc0 = _mm_crc32_u64(crc0, load64(next));
                crc1 = _mm_crc32_u64(crc1, load64(next + block));
                crc2 = _mm_crc32_u64(crc2, load64(next + 2 * block));
                next += 8;
            } while (next < end);
            uint32_t (*zeros)[256] = b == 0 ? shift_long : shift_short;
            crc0 = shift(zeros, (uint32_t)crc0) ^ (uint32_t)crc1;
            crc0 = shift(zeros, (uint32_t)crc0) ^ (uint32_t)crc2;
            next += 2 * block;
            length -= 3 * block;
        }
    }
    while (length >= 8) {
        crc0 = _mm_crc32_u64(crc0, load64(next));
        next += 8;
        length -= 8;
    }
    while (length--) crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
    return (uint32_t)crc0 ^ 0xFFFFFFFFu;
}
#endif

/* --- x86-64 with AVX-512 and VPCLMULQDQ: folding 256 bytes a step ------------------------------
 * Four 512-bit accumulators, each 128-bit lane folded onto the lane 2048 bits further on with
 * carry-less multiplies; then folded into one accumulator, 512 bits at a time. What is left is
 * 64 bytes with the CRC of the whole (CRC-32C is linear: the CRC register before a message
 * is the same as zeros before it with the register xored into its first four bytes), which the
 * crc32 instruction finishes, with the bytes after them. */
#ifdef LMW_X86
#define VPCLMUL_TARGET __attribute__((target("sse4.2,avx512f,vpclmulqdq")))

VPCLMUL_TARGET static inline __m512i fold(__m512i x, __m512i constants, __m512i next) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, constants, 0x00),
                                     _mm512_clmulepi64_epi128(x, constants, 0x11), next, 0x96);
}

VPCLMUL_TARGET static uint32_t crc32c_vpclmul(uint32_t crc, const void *data, size_t length) {
    const unsigned char *next = data;
    if (length < 256) return crc32c_sse42(crc, data, length);
    const __m512i far = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_2048[1], (long long)fold_2048[0]));
    const __m512i near = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_512[1], (long long)fold_512[0]));
    __m512i x0 = _mm512_loadu_si512((const void *)next);
    __m512i x1 = _mm512_loadu_si512((const void *)(next + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(next + 128));
    __m512i x3 = _mm512_loadu_si512((const void *)(next + 192));
    x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)(crc ^ 0xFFFFFFFFu))));
    next += 256;
    length -= 256;
    while (length >= 256) {
        x0 = fold(x0, far, _mm512_loadu_si512((const void *)next));
        x1 = fold(x1, far, _mm512_loadu_si512((const void *)(next + 64)));
        x2 = fold(x2, far, _mm512_loadu_si512((const void *)(next + 128)));
        x3 = fold(x3, far, _mm512_loadu_si512((const void *)(next + 192)));
        next += 256;
        length -= 256;
    }
    x1 = fold(x0, near, x1);
    x2 = fold(x1, near, x2);
    x3 = fold(x2, near, x3);
    while (length >= 64) {
        x3 = fold(x3, near, _mm512_loadu_si512((const void *)next));
        next += 64;
        length -= 64;
    }
    uint64_t rest[8];
    _mm512_storeu_si512((void *)rest, x3);
    uint64_t c = 0;
    for (int n = 0; n < 8; n++) c = _mm_crc32_u64(c, rest[n]);
    while (length >= 8) {
        c = _mm_crc32_u64(c, load64(next));
        next += 8;
        length -= 8;
    }
    while (length--) c = _mm_crc32_u8((uint32_t)c, *next++);
    return (uint32_t)c ^ 0xFFFFFFFFu;
}
#endif

/* 2: AVX-512 carry-less multiplies (VPCLMULQDQ) and the crc32 instruction; 1: the crc32
 * instruction (SSE4.2); 0: tables. */
int lmw_crc32c_path(void) { return path; }

/* The same CRC by the crc32 instruction alone (path 1 or more only), for tests. */
uint32_t lmw_crc32c_sse42(uint32_t crc, const void *data, size_t length) {
#ifdef LMW_X86
    if (path >= 1) return crc32c_sse42(crc, data, length);
#endif
    return lmw_crc32c_portable(crc, data, length);
}

uint32_t lmw_crc32c(uint32_t crc, const void *data, size_t length) {
#ifdef LMW_X86
    if (path == 2) return crc32c_vpclmul(crc, data, length);
    if (path == 1) return crc32c_sse42(crc, data, length);
#endif
    return lmw_crc32c_portable(crc, data, length);
}

/* Read ``length`` bytes of the file ``fd`` from ``offset`` into ``into``, ``piece`` bytes at
 * a time, continuing the CRC-32C ``*crc`` over each piece as soon as it is read (while it is
 * still in the core's cache). Returns the bytes read: fewer where the file ended; -errno where
 * a read failed. One call for a whole tensor: no interpreter between the pieces. */
int64_t lmw_read_crc32c(int fd, int64_t offset, void *into, int64_t length, int64_t piece, uint32_t *crc) {
    unsigned char *next = into;
    int64_t done = 0;
    uint32_t value = *crc;
    if (piece <= 0) piece = length;
    while (done < length) {
        int64_t want = length - done < piece ? length - done : piece;
        int64_t got = 0;
        while (got < want) {
            ssize_t count = pread(fd, next + got, (size_t)(want - got), (off_t)(offset + done + got));
            if (count < 0) {
                if (errno == EINTR) continue;
                *crc = value;
                return -errno;
            }
            if (count == 0) break;
            got += count;
        }
        value = lmw_crc32c(value, next, (size_t)got);
        next += got;
        done += got;
        if (got < want) break;
    }
    *crc = value;
    return done;
}

/* A reader thread's whole run of a cache file in one call, without the interpreter: item i is
 * ``lengths[i]`` bytes of the file from ``offsets[i]``, read into ``into[i]`` and checked
 * piece by piece as lmw_read_crc32c does, the CRC continuing from item i - 1's unless
 * ``fresh[i]`` (a tensor's first span); where ``into[i]`` is 0 the bytes are padding, read
 * into a scratch buffer and checked to be zero. ``crcs[i]``: the CRC after item i.
 * ``states[i]``: 1 read whole (and zero, for padding), 0 the file ended before it did, 2
 * padding that is not zero; the run stops at the first item that is not 1 (those after it
 * stay as they were). Returns 0, or -errno where a read failed. */
int64_t lmw_read_check_run(int fd, int64_t count, const int64_t *offsets, const uint64_t *into,
                           const int64_t *lengths, const uint8_t *fresh, int64_t piece, uint32_t *crcs,
                           uint8_t *states) {
    unsigned char scratch[1 << 16];
    uint32_t crc = 0;
    for (int64_t i = 0; i < count; i++) {
        if (fresh[i]) crc = 0;
        if (into[i] == 0) {
            int64_t done = 0;
            states[i] = 1;
            while (done < lengths[i]) {
                int64_t want = lengths[i] - done < (int64_t)sizeof scratch ? lengths[i] - done : (int64_t)sizeof scratch;
                ssize_t got = pread(fd, scratch, (size_t)want, (off_t)(offsets[i] + done));
                if (got < 0) {
                    if (errno == EINTR) continue;
                    return -errno;
                }
                if (got == 0) {
                    states[i] = 0;
                    break;
                }
                for (ssize_t k = 0; k < got; k++) {
                    if (scratch[k]) {
                        states[i] = 2;
                        break;
                    }
                }
                if (states[i] == 2) break;
                done += got;
            }
        } else {
            uint32_t value = crc;
            int64_t done = lmw_read_crc32c(fd, offsets[i], (void *)(uintptr_t)into[i], lengths[i], piece, &value);
            if (done < 0) return done;
            crc = value;
            states[i] = done == lengths[i];
        }
        crcs[i] = crc;
        if (states[i] != 1) return 0;
    }
    return 0;
}
