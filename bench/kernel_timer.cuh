/* kernel_timer.cuh: the time of a launch sequence on g_stream, for the kernel microbenchmarks in
 * bench/ (never for tests: no test times anything). `launch` is called `warmup` times, then `reps`
 * times, each call timed alone between two CUDA events; the median of those times, in µs. The
 * median, not the mean: one slow launch (a clock change, another process) does not move it. */
#ifndef BENCH_KERNEL_TIMER_CUH
#define BENCH_KERNEL_TIMER_CUH

#include <algorithm>
#include <vector>

#include "../microgpt/cuda/common.cuh"

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

#endif
