/* classifier_bench.cu: the classifier's training kernels alone at ANDREA-12M's shape (n = 4096
 * rows, d_model 192, the GPT-2 vocabulary; one logits chunk): cuBLAS's logits product, then the
 * fused backward of microgpt/cuda/classifier_grad.cuh half by half (dx's shares with their
 * combine, dwte), each the median of 50 launches queued back to back (bench/kernel_timer.cuh), with
 * what each would take at the GPU's bf16 product rate and at its memory bandwidth (the kernels'
 * floors: docs/BENCHMARKS.md, "What the missed targets still need"). A measurement tool, not part of
 * the engine or the tests: build/kernel_check checks these kernels against the CPU engine. The
 * memory floor counts the logits' bytes only: dx's partials (~19 MB written and read back) and
 * dwte's fp32 output (39 MB) would add 5-10 %. dwte runs here alone, on the main stream; the
 * engine runs it on its side stream.
 *
 *   build: make build/classifier_bench
 *   run:   build/classifier_bench [product TFLOP/s]   (default 780: the H200's measured bf16 rate)
 *
 * The logits are random in [-8, 8), the targets random tokens: the kernels' times do not depend on
 * the values, except where a row's running max rises (rarer as a share goes on, as in training). */
#include "kernel_timer.cuh"
#include "../microgpt/cuda/loss.cuh"

static void line(const char* kernel, float us, double flop, double bytes, double tflops, double bw) {
    printf("classifier_bench %-22s %8.1f us   %6.1f TFLOP/s  %5.2f TB/s   floor: products %6.1f us, memory %6.1f us\n",
           kernel, us, flop / (us * 1e-6) / 1e12, bytes / (us * 1e-6) / 1e12, flop / (tflops * 1e12) * 1e6,
           bytes / bw * 1e6);
}

__global__ void k_random_targets(int* targets, int n, int V) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        targets[i] = (int)(((unsigned)i * 2654435761u >> 7) % (unsigned)V);
}

int main(int argc, char** argv) {
    char* end = NULL;
    double tflops = argc > 1 ? strtod(argv[1], &end) : 780.0;
    if (argc > 2 || (end && (end == argv[1] || *end)) || !(tflops > 0.0) || !std::isfinite(tflops)) {
        fprintf(stderr, "usage: classifier_bench [bf16 product TFLOP/s, > 0]\n");
        return 2;
    }
    const int n = 4096, C = 192, V = 50257, Vp = 50304;
    CUDA_CHECK(cudaStreamCreate(&g_stream));
    void* ws;
    CUDA_CHECK(cudaMalloc(&ws, CUBLAS_WORKSPACE_BYTES));
    cublas_init(ws, CUBLAS_WORKSPACE_BYTES);
    int dev, bus_bits, mem_khz;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, dev));
    double bw = 2.0 * mem_khz * 1e3 * bus_bits / 8; /* double data rate: the datasheet's figure */

    bf16 *x = random_bf16((size_t)n * C, 1, 1.7f), *wte = random_bf16((size_t)Vp * C, 2, 0.3f);
    bf16 *logits = random_bf16((size_t)n * Vp, 3, 8.0f), *dx;
    float *losses, *lse, *dwte, *dscale, *scratch, ds = 1.0f / n;
    int* targets;
    CUDA_CHECK(cudaMalloc(&dx, (size_t)n * C * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&losses, n * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&lse, n * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&dwte, (size_t)Vp * C * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&dscale, sizeof(float)));
    CUDA_CHECK(cudaMalloc(&scratch, classifier_grad_scratch_floats(n, C) * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&targets, n * sizeof(int)));
    CUDA_CHECK(cudaMemcpy(dscale, &ds, sizeof(float), cudaMemcpyHostToDevice));
    k_random_targets<<<64, 256, 0, g_stream>>>(targets, n, V);
    LAUNCH_CHECK();
    if (!classifier_grad_fused_ok<bf16>(C, Vp)) {
        fprintf(stderr, "error: the fused classifier backward does not run on this GPU (it needs sm_90a)\n");
        return 1;
    }
    double product = 2.0 * n * Vp * C, logits_bytes = (double)n * Vp * sizeof(bf16);
    bf16* logits_out;
    CUDA_CHECK(cudaMalloc(&logits_out, (size_t)n * Vp * sizeof(bf16)));
    line("logits product", time_median_queued_us([&] { classifier_logits(logits_out, x, wte, n, C, Vp); }, 50),
         product, logits_bytes, tflops, bw);
    line("dx shares + combine", time_median_queued_us([&] {
             classifier_dx_launch<3>(losses, lse, dx, logits, wte, targets, n, V, Vp, dscale, scratch);
         }, 50), product, logits_bytes, tflops, bw);
    line("dwte", time_median_queued_us([&] {
             classifier_dwte_launch<3>(dwte, lse, logits, x, targets, n, V, Vp, dscale, 0.0f);
         }, 50), product, logits_bytes, tflops, bw);
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
    std::vector<float> row_losses(n);
    CUDA_CHECK(cudaMemcpy(row_losses.data(), losses, n * sizeof(float), cudaMemcpyDeviceToHost));
    double mean = 0.0;
    for (float l : row_losses) mean += l / n;
    /* logits uniform in [-8, 8): lse ~ ln(V) + ln((e^8 - e^-8) / 16) ~ 16.05, the target's logit 0 on average */
    printf("classifier_bench mean row loss %.3f (expected ~16.05 for these logits)\n", mean);
    return 0;
}
