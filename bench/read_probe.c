/* What this machine's memory gives a read such as a decode step's: every byte of a buffer far
 * larger than the caches once, in order, `threads` OpenMP threads each summing its own part
 * (bench/read_bandwidth.py). The sum is returned so that no read is left out. */
#include <stdint.h>

uint64_t lmw_read_probe(const uint64_t *words, int64_t count, int threads) {
    uint64_t total = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < count; i++) total += words[i];
    return total;
}
