/* AdamW step over a flat tensor, t = 1-based step. With bias corrections c1 = 1 - beta1^t and
 * c2 = 1 - beta2^t (computed in double, then rounded to float):
 *   m = beta1 m + (1-beta1) g ;  v = beta2 v + (1-beta2) g^2
 *   p = p - lr * ( (m/c1) / (sqrt(v/c2) + eps) + wd * p )      (decoupled decay, old p)
 * The caller passes wd = 0 for LayerNorm tensors. Element-wise, so any thread split is exact. */
#ifndef MICROGPT_CPU_ADAMW_H
#define MICROGPT_CPU_ADAMW_H

#include "common.h"

static inline void adamw_update(float* p, const float* g, float* m, float* v, long n, float lr, float beta1,
                         float beta2, float eps, float wd, int t) {
    float c1 = (float)(1.0 - pow((double)beta1, (double)t));
    float c2 = (float)(1.0 - pow((double)beta2, (double)t));
    #pragma omp parallel for schedule(static)
    for (long i = 0; i < n; i++) {
        float mi = beta1 * m[i] + (1.0f - beta1) * g[i];
        float vi = beta2 * v[i] + (1.0f - beta2) * g[i] * g[i];
        m[i] = mi;
        v[i] = vi;
        p[i] -= lr * ((mi / c1) / (sqrtf(vi / c2) + eps) + wd * p[i]);
    }
}

#endif
