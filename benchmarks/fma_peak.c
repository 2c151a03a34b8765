/* The machine's fp32 FMA peak: each of `threads` threads runs chains of independent vector FMAs
 * (enough accumulators to cover the FMA latency on both ports), timed together.
 * Picks AVX-512 when the CPU has it, else AVX2+FMA (run-time detection).
 *
 *     fma_peak THREADS SECONDS   ->  prints "isa GFLOPS"
 *
 * Built by benchmarks/conv_gemm.py (cc -O3 -pthread); not part of the package. The chains' loop is
 * unrolled whatever the flags: rolled (GCC -O2), the accumulators live in memory and a store and
 * reload sit in every chain, which halved the figure on AMD Zen 4. */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CHAINS 12
#define STEPS 100000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static long rounds;
static volatile float sink;

__attribute__((target("avx512f"))) static void *run_avx512(void *arg) {
    (void)arg;
    __m512 acc[CHAINS];
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
    for (long r = 0; r < rounds; r++)
        for (long s = 0; s < STEPS; s++)
#pragma GCC unroll 12  /* CHAINS */
            for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
    float total = 0;
    for (int c = 0; c < CHAINS; c++) total += _mm512_reduce_add_ps(acc[c]);
    sink = total;
    return NULL;
}

__attribute__((target("avx2,fma"))) static void *run_avx2(void *arg) {
    (void)arg;
    __m256 acc[CHAINS];
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_ps((float)c);
    for (long r = 0; r < rounds; r++)
        for (long s = 0; s < STEPS; s++)
#pragma GCC unroll 12  /* CHAINS */
            for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
    float lanes[8], total = 0;
    for (int c = 0; c < CHAINS; c++) {
        _mm256_storeu_ps(lanes, acc[c]);
        for (int i = 0; i < 8; i++) total += lanes[i];
    }
    sink = total;
    return NULL;
}

static double timed(void *(*kernel)(void *), int threads) {
    pthread_t ids[256];
    double start = now();
    for (int t = 0; t < threads; t++) pthread_create(&ids[t], NULL, kernel, NULL);
    for (int t = 0; t < threads; t++) pthread_join(ids[t], NULL);
    return now() - start;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s THREADS SECONDS\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[1]);
    double seconds = atof(argv[2]);
    if (threads < 1 || threads > 256 || seconds <= 0) {
        fprintf(stderr, "THREADS must be 1..256 and SECONDS positive\n");
        return 2;
    }
    __builtin_cpu_init();
    int wide = __builtin_cpu_supports("avx512f");
    if (!wide && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
        fprintf(stderr, "neither AVX-512F nor AVX2+FMA\n");
        return 1;
    }
    void *(*kernel)(void *) = wide ? run_avx512 : run_avx2;
    int lanes = wide ? 16 : 8;
    rounds = 1;
    double elapsed = timed(kernel, threads);  /* calibrate, then run for about SECONDS */
    rounds = (long)(seconds / elapsed) + 1;
    elapsed = timed(kernel, threads);
    double flops = 2.0 * lanes * CHAINS * STEPS * rounds * threads;
    printf("%s %.2f\n", wide ? "avx512" : "avx2", flops / elapsed / 1e9);
    return 0;
}
