/* schedule.h: the learning rate at step index s (docs/DESIGN.md §13). Computed in double from the
 * config alone, so a resumed run gets exactly the same rates.
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_SCHEDULE_H
#define MICROGPT_HOST_SCHEDULE_H

#include "config.h"
#include "rng.h"

static int in_polish(const Config* c, int s) { return c->polish.enabled && s >= c->polish.start_step; }

static double lr_at(const Config* c, int s) {
    double lr = c->train.lr, min_lr = c->train.min_lr;
    int warmup = c->train.warmup_steps, steps = c->train.steps;
    if (in_polish(c, s)) return c->polish.lr; /* polish: constant, no warmup */
    if (s < warmup) return lr * (double)(s + 1) / (double)warmup;
    if (strcmp(c->train.schedule, "constant") == 0) return lr;
    if (strcmp(c->train.schedule, "wsd") == 0) {
        /* stable at lr until decay_start, then linear so that the last step (steps-1) runs at min_lr */
        int decay_start = (int)((double)steps * (1.0 - c->train.decay_frac));
        int last = steps - 1;
        if (decay_start < warmup) decay_start = warmup;
        if (s < decay_start) return lr;
        if (last <= decay_start) return min_lr;
        return lr + (min_lr - lr) * (double)(s - decay_start) / (double)(last - decay_start);
    }
    /* cosine from lr at the end of warmup to min_lr at p = 1 */
    {
        double p = steps > warmup ? (double)(s - warmup) / (double)(steps - warmup) : 1.0;
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + cos(RNG_PI * p));
    }
}

#endif
