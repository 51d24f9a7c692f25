/* rng.h: counter-based random numbers. Every draw is a pure function of (seed, stream, counter), so
 * the batch of a step, an initial weight or a sampled token never depends on what was drawn before
 * it: that is what makes resume exact and lets both engines produce the same numbers.
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_RNG_H
#define MICROGPT_HOST_RNG_H

#include <math.h>
#include <stdint.h>

/* Streams keep independent uses of the generator apart (see docs/DESIGN.md). */
enum { STREAM_INIT = 1, STREAM_TRAIN = 2, STREAM_VAL = 3, STREAM_SAMPLE = 4, STREAM_GENERATE = 5 };

static const double RNG_PI = 3.14159265358979323846;

/* splitmix64's finaliser: a bijection on 64-bit words with good avalanche. */
static uint64_t rng_mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* Chained mixing: for a fixed (seed, stream) the map counter -> word is a bijection, so distinct
 * counters never collide. */
static uint64_t rng_u64(uint64_t seed, uint64_t stream, uint64_t counter) {
    return rng_mix(rng_mix(rng_mix(seed) ^ stream) ^ counter);
}

/* Uniform double in [0, 1) with 53 random bits. */
static double rng_uniform(uint64_t seed, uint64_t stream, uint64_t counter) {
    return (double)(rng_u64(seed, stream, counter) >> 11) * (1.0 / 9007199254740992.0);
}

/* Integer in [0, n). The modulo bias is below n/2^64, negligible for any n we use. */
static uint64_t rng_below(uint64_t seed, uint64_t stream, uint64_t counter, uint64_t n) {
    return rng_u64(seed, stream, counter) % n;
}

/* Standard normal (Box-Muller, cosine branch only, so one counter gives one value). */
static double rng_normal(uint64_t seed, uint64_t stream, uint64_t counter) {
    uint64_t h1 = rng_u64(seed, stream, counter);
    uint64_t h2 = rng_mix(h1);
    double u1 = (double)((h1 >> 11) + 1) * (1.0 / 9007199254740992.0); /* (0, 1]: log is finite */
    double u2 = (double)(h2 >> 11) * (1.0 / 9007199254740992.0);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * RNG_PI * u2);
}

#endif
