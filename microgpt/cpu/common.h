/* Small helpers shared by the CPU layer headers (microgpt/cpu/ one per layer).
 *
 * Every CPU layer is deterministic: work is split over independent outputs, and every sum is
 * taken in a fixed order that does not depend on the number of threads. The headers compile as
 * C99 and as C++ (nvcc includes them in the GPU-vs-CPU checker), so: static functions, casts on
 * malloc, no VLAs, no `restrict`.
 */
#ifndef MICROGPT_CPU_COMMON_H
#define MICROGPT_CPU_COMMON_H

#include <math.h>
#include <stdlib.h>

/* Dot product of two contiguous float vectors. Eight independent partial sums let the compiler
 * vectorise without -ffast-math, and the fixed lane layout keeps the result bit-reproducible. */
static inline float dot_f32(const float* a, const float* b, int n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        #pragma omp simd
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    }
    for (; i < n; i++) acc[i & 7] += a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* Four dot products against one shared vector b: out[r] = a[r] . b, each bit-identical to
 * dot_f32(a[r], b, n) (same lanes, same final order), with b loaded once for all four. */
static inline void dot4_f32(float out[4], const float* const a[4], const float* b, int n) {
    float acc[4][8];
    for (int r = 0; r < 4; r++) for (int l = 0; l < 8; l++) acc[r][l] = 0.0f;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int r = 0; r < 4; r++) {
            #pragma omp simd
            for (int l = 0; l < 8; l++) acc[r][l] += a[r][i + l] * b[i + l];
        }
    }
    for (; i < n; i++) for (int r = 0; r < 4; r++) acc[r][i & 7] += a[r][i] * b[i];
    for (int r = 0; r < 4; r++) {
        const float* c = acc[r];
        out[r] = ((c[0] + c[4]) + (c[1] + c[5])) + ((c[2] + c[6]) + (c[3] + c[7]));
    }
}

/* y[0:n] += a * x[0:n]. `omp simd` vectorises it even at -O2 (y and x never overlap); each element
 * is computed on its own, so the result does not depend on the vector width. */
static inline void axpy_f32(float* y, float a, const float* x, int n) {
    #pragma omp simd
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

#endif
