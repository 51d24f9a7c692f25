/* Residual connection: out = a + b; the gradient flows unchanged into both branches.
 * residual_backward accumulates, so da and db must not alias dout. */
#ifndef MICROGPT_CPU_RESIDUAL_H
#define MICROGPT_CPU_RESIDUAL_H

#include "common.h"

static inline void residual_forward(float* out, const float* a, const float* b, int n) {
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) out[i] = a[i] + b[i];
}

static inline void residual_backward(float* da, float* db, const float* dout, int n) {
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) { da[i] += dout[i]; db[i] += dout[i]; }
}

#endif
