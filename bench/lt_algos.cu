/* lt_algos.cu: what cuBLASLt offers, and how fast each offer runs, for every product shape of an
 * ANDREA-120M step (bf16, B8 T1024) on this GPU: its heuristic's first 8 algorithms per problem,
 * each timed over 20 launches; then the same for ANDREA-12M. A measurement tool for choosing a
 * fixed algorithm rule (the engine itself never chooses by timing, see microgpt/cuda/common.cuh);
 * not part of the engine or the tests.
 *
 *   build: nvcc -O2 -std=c++17 -arch=native -o build/lt_algos bench/lt_algos.cu -lcublas -lcublasLt
 *   run:   build/lt_algos          (one line per algorithm: config id, tile id, time, TFLOP/s)
 *
 * Tile ids are cublasLtMatmulTile_t values (20 = 128x128, 23 = 128x256, 24 = 256x128). Recorded
 * results are in docs/BENCHMARKS.md ("cuBLASLt's offers"). */
#include "../microgpt/cuda/common.cuh"

/* Zeroed device memory as the products' inputs: it ranks the offers, but zeros draw less power
 * than real operands, so the times are upper bounds on speed, not what a training step sees. */
static void *dmalloc(size_t b) {
    void *p;
    CUDA_CHECK(cudaMalloc(&p, b));
    CUDA_CHECK(cudaMemset(p, 0, b));
    return p;
}
struct Prob {
    const char *name;
    int epi;
    bool ta, tb;
    int M, N, K, lda, ldb, ldd;
    void *A, *B, *D, *aux;
    cudaDataType_t dt = CUDA_R_16BF;
};
/* One problem (row-major, as gemm_fused): every algorithm the heuristic offers, timed. */
static void run(Prob pr) {
    static const cublasLtEpilogue_t epis[3] = {CUBLASLT_EPILOGUE_DEFAULT, CUBLASLT_EPILOGUE_GELU_AUX,
                                               CUBLASLT_EPILOGUE_DGELU};
    cudaDataType_t t = CUDA_R_16BF;
    cublasOperation_t op_b = pr.tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = pr.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtMatmulDesc_t desc;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    lt_set_desc(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof op_b);
    lt_set_desc(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof op_a);
    lt_set_desc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epis[pr.epi], sizeof(cublasLtEpilogue_t));
    if (pr.aux) {
        int64_t ld = pr.ldd;
        lt_set_desc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &pr.aux, sizeof pr.aux);
        lt_set_desc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld);
    }
    cublasLtMatrixLayout_t la = lt_layout(t, pr.tb ? pr.N : pr.K, pr.tb ? pr.K : pr.N, pr.ldb);
    cublasLtMatrixLayout_t lb = lt_layout(t, pr.ta ? pr.K : pr.M, pr.ta ? pr.M : pr.K, pr.lda);
    cublasLtMatrixLayout_t ld = lt_layout(pr.dt, pr.M, pr.N, pr.ldd);
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = g_gemm_workspace_bytes;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    cublasLtMatmulHeuristicResult_t res[16];
    int found = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(g_cublaslt, desc, la, lb, ld, ld, pref, 16, res, &found);
    printf("== %s  M=%d N=%d K=%d ta=%d tb=%d: status %d, %d algos\n", pr.name, pr.M, pr.N, pr.K, pr.ta, pr.tb, (int)st,
           found);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    double flop = 2.0 * pr.M * pr.N * pr.K;
    for (int i = 0; i < found; i++) {
        float alpha = 1, beta = 0;
        cublasStatus_t s2 = CUBLAS_STATUS_SUCCESS;
        for (int r = 0; r < 3; r++)
            s2 = cublasLtMatmul(g_cublaslt, desc, &alpha, pr.B, la, pr.A, lb, &beta, pr.D, ld, pr.D, ld, &res[i].algo,
                                g_gemm_workspace, ws, g_stream);
        if (s2 != CUBLAS_STATUS_SUCCESS) {
            printf("  algo %d: launch status %d\n", i, (int)s2);
            continue;
        }
        cudaEventRecord(e0, g_stream);
        for (int r = 0; r < 20; r++)
            cublasLtMatmul(g_cublaslt, desc, &alpha, pr.B, la, pr.A, lb, &beta, pr.D, ld, pr.D, ld, &res[i].algo,
                           g_gemm_workspace, ws, g_stream);
        cudaEventRecord(e1, g_stream);
        CUDA_CHECK(cudaEventSynchronize(e1));
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        ms /= 20;
        int id = 0, tile = 0, stages = 0, splitk = 0;
        size_t sz;
        cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &sz);
        cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &sz);
        cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &sz);
        cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk,
                                             &sz);
        printf("  algo %2d: id %d tile %d stages %d splitk %d  %.1f us  %.0f TFLOP/s  (ws %zu)\n", i, id, tile, stages,
               splitk, ms * 1e3, flop / (ms * 1e-3) / 1e12, res[i].workspaceSize);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(la));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(lb));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(ld));
    CUBLAS_CHECK(cublasLtMatmulDescDestroy(desc));
}
/* The product shapes of one micro-batch of a model: N tokens, width C, MLP width F, R logits rows
 * per classifier chunk (the engine's 512 MiB chunk), Vp padded vocabulary. */
static void model_products(const char* model, int Nt, int C, int F, int R, int Vp) {
    void *x = dmalloc((size_t)Nt * C * 2), *w1 = dmalloc((size_t)C * F * 2), *w2 = dmalloc((size_t)F * C * 2),
         *dout = dmalloc((size_t)Nt * C * 2);
    void *h = dmalloc((size_t)Nt * F * 2), *g = dmalloc((size_t)Nt * F * 2), *dh = dmalloc((size_t)Nt * F * 2);
    void *big = dmalloc((size_t)R * Vp * 2), *wte = dmalloc((size_t)Vp * C * 2), *dw = dmalloc((size_t)Vp * C * 4);
    printf("######## %s: N %d, C %d, F %d, logits chunk %d x %d\n", model, Nt, C, F, R, Vp);
    run({"MLP forward, GELU + aux: h = x W1", 1, false, false, Nt, F, C, C, F, F, x, w1, g, h});
    run({"MLP backward, DGELU: dh = dout W2^T", 2, false, true, Nt, F, C, C, C, F, dout, w2, dh, h});
    run({"x W (q, k, v, W_O)", 0, false, false, Nt, C, C, C, C, C, x, w1, dout, NULL});
    run({"g W2", 0, false, false, Nt, C, F, F, C, C, g, w2, dout, NULL});
    run({"dx = dout W^T (W_O, q, k, v)", 0, false, true, Nt, C, C, C, C, C, dout, w1, x, NULL});
    run({"dx = dh W1^T", 0, false, true, Nt, C, F, F, F, C, dh, w1, x, NULL});
    run({"dW = x^T dout (fp32)", 0, true, false, C, C, Nt, C, C, C, x, dout, dw, NULL, CUDA_R_32F});
    run({"dW1 = x^T dh (fp32)", 0, true, false, C, F, Nt, C, F, F, x, dh, dw, NULL, CUDA_R_32F});
    run({"dW2 = g^T dout (fp32)", 0, true, false, F, C, Nt, F, C, C, g, dout, dw, NULL, CUDA_R_32F});
    run({"logits = x wte^T", 0, false, true, R, Vp, C, C, C, Vp, x, wte, big, NULL});
    run({"classifier dx = dlogits wte", 0, false, false, R, C, Vp, Vp, C, C, big, wte, x, NULL});
    run({"dwte = dlogits^T x (fp32)", 0, true, false, Vp, C, R, Vp, C, C, big, x, dw, NULL, CUDA_R_32F});
    for (void* p : {x, w1, w2, dout, h, g, dh, big, wte, dw}) CUDA_CHECK(cudaFree(p));
}

int main() {
    CUDA_CHECK(cudaStreamCreate(&g_stream));
    void *ws = dmalloc(CUBLAS_WORKSPACE_BYTES);
    cublas_init(ws, CUBLAS_WORKSPACE_BYTES);
    model_products("ANDREA-120M (B8, T1024)", 8192, 768, 3072, 5248, 50304);
    model_products("ANDREA-12M (B8, T512)", 4096, 192, 768, 4096, 50304);
    return 0;
}
