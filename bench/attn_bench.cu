/* attn_bench.cu: the flash-attention kernels alone (microgpt/cuda/attention.cuh), bf16, at the
 * attention shapes of ANDREA-120M (B 8, T 1024, H 12, head size 64) and ANDREA-12M (B 8, T 512,
 * H 6, head size 32): forward, the backward's delta, dK/dV and dQ kernels, and the whole backward,
 * each the median of 50 launches (bench/kernel_timer.cuh) on random q, k, v, dout. A measurement
 * tool for changes to those kernels (docs/BENCHMARKS.md, log #40 on), not part of the engine or
 * the tests: build/kernel_check checks the same build's results.
 *
 *   build: make build/attn_bench       (a candidate behind a -D macro of attention.cuh:
 *          make -B build/attn_bench KERNEL_VARIANTS="-DNAME=1")
 *   run:   build/attn_bench
 *   builds of other -D flags, checked and timed side by side: bench/attn-variants.sh
 *
 * One line per kernel and model: µs per launch (one layer), TFLOP/s of the causal half (the
 * diagonal tiles' masked half not counted; delta moves bytes only: GB/s), and µs per training step
 * (× layers). */
#include "kernel_timer.cuh"
#include "../microgpt/cuda/attention.cuh"

template <int D> static void bench_model(const char* model, int B, int T_, int C, int H, int layers) {
    size_t nc = (size_t)B * T_ * C;
    bf16 *q = random_bf16(nc, 1), *k = random_bf16(nc, 2), *v = random_bf16(nc, 3), *dout = random_bf16(nc, 4);
    bf16 *out, *dq, *dk, *dv, *ds;
    float *lse, *delta;
    CUDA_CHECK(cudaMalloc(&out, nc * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&dq, nc * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&dk, nc * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&dv, nc * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&ds, attn_ds_elems(true, B, T_, C, H) * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&lse, (size_t)B * H * T_ * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&delta, attn_delta_elems(true, B, T_, C, H) * sizeof(float)));

    /* one product over the causal half: 2 * pairs * D FLOP (pairs = key <= query) */
    double product = 2.0 * B * H * ((double)T_ * (T_ + 1) / 2) * D;
    auto line = [&](const char* kernel, float us, double work, const char* unit) {
        printf("attn_bench %-5s %-8s %9.1f us %8.1f %s %9.1f us/step\n", model, kernel, us,
               work / (us * 1e-6) / 1e12 * (unit[0] == 'G' ? 1e3 : 1.0), unit, us * layers);
    };
    const int reps = 50;
    line("forward", time_median_us([&] { attn_fwd_flash<bf16, D>(out, lse, q, k, v, B, T_, C, H); }, reps),
         2 * product, "TFLOP/s");
    line("delta", time_median_us([&] { attn_bwd_flash_delta<bf16, D>(delta, dout, out, B, T_, C, H); }, reps),
         2.0 * nc * sizeof(bf16) + (double)B * H * T_ * sizeof(float), "GB/s");
    line("dk_dv", time_median_us([&] {
             attn_bwd_flash_dkv<bf16, D>(dk, dv, ds, dout, lse, delta, q, k, v, B, T_, C, H);
         }, reps),
         4 * product, "TFLOP/s");
    line("dq", time_median_us([&] { attn_bwd_flash_dq<bf16, D>(dq, ds, k, B, T_, C, H); }, reps), product,
         "TFLOP/s");
    line("backward", time_median_us([&] {
             attn_bwd_flash<bf16, D>(dq, dk, dv, dout, out, lse, q, k, v, B, T_, C, H, delta, ds);
         }, reps),
         5 * product, "TFLOP/s");
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
    for (void* p : {(void*)q, (void*)k, (void*)v, (void*)dout, (void*)out, (void*)dq, (void*)dk, (void*)dv, (void*)ds,
                    (void*)lse, (void*)delta})
        CUDA_CHECK(cudaFree(p));
}

int main(int argc, char** argv) {
    if (argc > 1) {
        fprintf(stderr, "error: attn_bench takes no arguments (candidates are compile-time: see its header)\n");
        return 2;
    }
    CUDA_CHECK(cudaStreamCreate(&g_stream));
    bench_model<64>("120M", 8, 1024, 768, 12, 12);
    bench_model<32>("12M", 8, 512, 192, 6, 6);
    return 0;
}
