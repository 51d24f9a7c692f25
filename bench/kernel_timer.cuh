/* kernel_timer.cuh: the time of a launch sequence on g_stream, for the kernel microbenchmarks in
 * bench/ (never for tests: no test times anything), and their random inputs (random_bf16).
 * `launch` is called `warmup` times, then `reps` times, each call timed alone between two CUDA
 * events; the median of those times, in µs. The median, not the mean: one slow launch (a clock
 * change, another process) does not move it. */
#ifndef BENCH_KERNEL_TIMER_CUH
#define BENCH_KERNEL_TIMER_CUH

#include <algorithm>
#include <vector>

#include "../microgpt/cuda/common.cuh"

/* x[i] uniform in [-lim, lim) from a hash of (seed, i): the same inputs in every run and variant. */
__global__ void k_fill_uniform(bf16* x, size_t n, unsigned seed, float lim) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed * 0x9e3779b9u;
        h ^= h >> 16;
        h *= 0x85ebca6bu;
        h ^= h >> 13;
        h *= 0xc2b2ae35u;
        h ^= h >> 16;
        x[i] = __float2bfloat16(lim * ((float)(h >> 8) * (2.0f / 16777216.0f) - 1.0f));
    }
}

/* n such values on the device (lim 1.7: variance ~1, as kernel_check's randn). */
static inline bf16* random_bf16(size_t n, unsigned seed, float lim = 1.7f) {
    bf16* p;
    CUDA_CHECK(cudaMalloc(&p, n * sizeof(bf16)));
    k_fill_uniform<<<1024, 256, 0, g_stream>>>(p, n, seed, lim);
    LAUNCH_CHECK();
    return p;
}

template <typename F> static float time_median_us(F launch, int reps = 20, int warmup = 3) {
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    for (int i = 0; i < warmup; i++) launch();
    std::vector<float> us(reps);
    for (int i = 0; i < reps; i++) {
        CUDA_CHECK(cudaEventRecord(e0, g_stream));
        launch();
        CUDA_CHECK(cudaEventRecord(e1, g_stream));
        CUDA_CHECK(cudaEventSynchronize(e1));
        float ms;
        CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        us[i] = ms * 1000.0f;
    }
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    std::sort(us.begin(), us.end());
    return us[reps / 2];
}

/* A kernel that holds the GPU for `cycles` clock cycles (one thread). */
__global__ void k_hold(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

/* The same median over launches queued back to back, as in a captured step: `warmup` calls, then
 * k_hold keeps the GPU busy while the host queues `reps` calls with an event between each two, so
 * the GPU never waits for the host and no launch latency is counted; launch i's time is the span
 * between events i and i + 1. For launches of a few µs, whose host cost is close to their own. */
template <typename F> static float time_median_queued_us(F launch, int reps = 20, int warmup = 3) {
    std::vector<cudaEvent_t> ev(reps + 1);
    for (cudaEvent_t& e : ev) CUDA_CHECK(cudaEventCreate(&e));
    for (int i = 0; i < warmup; i++) launch();
    int dev, khz;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev));
    k_hold<<<1, 1, 0, g_stream>>>((long long)khz * (1 + reps / 5)); /* 1 ms + 0.2 ms a launch queued */
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaEventRecord(ev[0], g_stream));
    for (int i = 0; i < reps; i++) {
        launch();
        CUDA_CHECK(cudaEventRecord(ev[i + 1], g_stream));
    }
    CUDA_CHECK(cudaEventSynchronize(ev[reps]));
    std::vector<float> us(reps);
    for (int i = 0; i < reps; i++) {
        float ms;
        CUDA_CHECK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
        us[i] = ms * 1000.0f;
    }
    for (cudaEvent_t& e : ev) CUDA_CHECK(cudaEventDestroy(e));
    std::sort(us.begin(), us.end());
    return us[reps / 2];
}

#endif
