/* side_stream.cuh: the backward's weight-gradient products on a second stream, where they pay
 * (side_stream_pays; elsewhere everything runs on g_stream as common.cuh describes).
 *
 * In a linear layer's backward the input gradient (dX = dY W^T, which the layer below waits for)
 * and the weight gradient (dW = X^T dY, which only the update reads) are independent, and so are
 * the classifier's dx and dwte. The small products of a 12M step fill well under one wave of the
 * GPU each; side by side, two of them share it. Products that fill the GPU gain nothing from a
 * neighbour and lose to the contention (docs/DESIGN.md §9 has the measurements). side_product runs
 * a weight-gradient product on the side stream, forked from g_stream by an event, so that the main
 * stream's next products and kernels run beside it; captured in a CUDA graph, the fork and the
 * joins become the graph's edges (parallel branches). The side stream has its own cuBLAS handle
 * and its own workspace of the same size, and where the fixed table does not choose them its
 * products' algorithms are planned for a share of the GPU (SIDE_SM_SHARE, below): fixed for the
 * shape and the device, so a run's bits are the same every time, launched as graphs or one by one.
 *
 * What orders the two streams (the engine's backward places the waits, docs/DESIGN.md §9):
 *   fork   side_product records an event on g_stream and the side stream waits for it: the
 *          product starts after everything issued before it, its inputs included (so a layer
 *          issues its weight gradient before the input gradient it is to run beside).
 *   reads  after the product, an event on the side stream, kept per buffer the product reads that
 *          the main stream overwrites later (an activation-gradient scratch buffer).
 *   wait   side_wait(buffer), issued by the main stream before its next write of that buffer,
 *          waits for that event: the side-stream readers of the buffer are done.
 *   join   side_join: the main stream waits for all side-stream work (before the embedding
 *          backward adds into the classifier's dwte, and so before the end of the backward: the
 *          gradient norm and AdamW see every product, and a capture ends with the streams joined).
 * Without a side stream set up (kernel_check, the benches, models with large products) side_product
 * runs the product in place on g_stream and the waits are no-ops. */
#ifndef MICROGPT_CUDA_SIDE_STREAM_CUH
#define MICROGPT_CUDA_SIDE_STREAM_CUH

#include "common.cuh"

#include <functional>

/* buffers with a side-stream reader: dres, dh, dqkv, logits; fp8's g8t and the FP8 classifier's
 * dl8t; the LayerNorm backward's chunk partials (side_after_next_product) */
#define SIDE_MAX_BUFFERS 8

/* One buffer the side stream reads and the main stream overwrites later. */
struct SideRead {
    const void* buffer;
    cudaEvent_t done; /* recorded on the side stream after its last reader so far */
    bool pending;     /* recorded since the main stream last waited for it */
};

static struct {
    cudaStream_t stream; /* 0: no side stream, products run in place */
    cublasHandle_t cublas;
    void* workspace;
    int sm_target; /* the side stream's products' g_lt_sm_target (SIDE_SM_SHARE) */
    cudaEvent_t fork, joined;
    bool active; /* side-stream work issued since the last join */
    SideRead reads[SIDE_MAX_BUFFERS];
    int n_reads;
} g_side;

static struct {
    std::function<void()> work; /* side_after_next_product's, not yet issued */
    const void* reads;
} g_side_next;
static void side_issue_next(void);

/* Whether the backward's weight gradients run on the side stream: when a layer's input-gradient
 * product ([rows, d_model] out, rows = B·T) is less than one wave of 128×128 tiles on this GPU's
 * `sm_count` multiprocessors, so that two products side by side still fit. ANDREA-12M on an H200:
 * 4096·192 / 16384 = 48 tiles < 132, side stream; ANDREA-120M: 8192·768 / 16384 = 384, none. A
 * function of the shape and the device alone, so the same on every run. */
static bool side_stream_pays(long long rows, int d_model, int sm_count) {
    long long tile_elems = (long long)GEMM_TILE * GEMM_TILE;
    long long tiles = (rows * d_model + tile_elems - 1) / tile_elems;
    return tiles < sm_count;
}

/* The share of the GPU's multiprocessors cuBLASLt's heuristic is told a side-stream product may
 * have (g_lt_sm_target: 1 / SIDE_SM_SHARE of them), where the fixed table does not choose the
 * algorithms (lt_table_applies). Planned for the whole GPU, a weight gradient's kernel of
 * ANDREA-12M takes every multiprocessor for its split of K, so the input gradient beside it waits:
 * on an H100 a pair ran 9.6 µs against 10.8 in turn; planned for half, 8.3, and the 12M step 27 µs
 * faster in fp8, 35 in bf16 (docs/BENCHMARKS.md #188; a third or a quarter ran no better). Where
 * the table applies (the H200) its algorithms, tuned for the whole GPU, stay: the target does not
 * replan them, it only shrinks their grid (a probe: slower alone and no faster beside the input
 * gradient), and the heuristic's algorithms planned for half lost to them there (#110). */
#define SIDE_SM_SHARE 2

/* The side stream, its cuBLAS handle (bound to it, with its own workspace of `bytes`, the main
 * one's size, and the main handle's math mode: call after cublas_init and gemm_set_tf32) and its
 * events. */
static void side_stream_init(void* workspace, size_t bytes) {
    cublasMath_t math;
    CUDA_CHECK(cudaStreamCreate(&g_side.stream));
    CUBLAS_CHECK(cublasCreate(&g_side.cublas));
    CUBLAS_CHECK(cublasGetMathMode(g_cublas, &math));
    CUBLAS_CHECK(cublasSetMathMode(g_side.cublas, math));
    CUBLAS_CHECK(cublasSetStream(g_side.cublas, g_side.stream));
    CUBLAS_CHECK(cublasSetWorkspace(g_side.cublas, workspace, bytes));
    g_side.workspace = workspace;
    g_side.sm_target = lt_table_applies() ? 0 : lt_sm_count() / SIDE_SM_SHARE;
    g_lt_products_share_gpu = true; /* set before any product's plan: lt_call_workspace */
    CUDA_CHECK(cudaEventCreateWithFlags(&g_side.fork, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&g_side.joined, cudaEventDisableTiming));
}

/* The multiprocessors the side stream's products are planned for (SIDE_SM_SHARE); 0: the whole GPU. */
static int side_stream_sm_target(void) { return g_side.sm_target; }

static void side_stream_shutdown(void) {
    if (!g_side.stream) return;
    for (int i = 0; i < g_side.n_reads; i++) CUDA_CHECK(cudaEventDestroy(g_side.reads[i].done));
    CUDA_CHECK(cudaEventDestroy(g_side.fork));
    CUDA_CHECK(cudaEventDestroy(g_side.joined));
    CUBLAS_CHECK(cublasDestroy(g_side.cublas));
    CUDA_CHECK(cudaStreamDestroy(g_side.stream));
    memset(&g_side, 0, sizeof g_side);
    g_lt_products_share_gpu = false;
}

/* The entry of `buffer`, made on first use. */
static SideRead* side_read(const void* buffer) {
    for (int i = 0; i < g_side.n_reads; i++)
        if (g_side.reads[i].buffer == buffer) return &g_side.reads[i];
    if (g_side.n_reads == SIDE_MAX_BUFFERS)
        cuda_fail("side_read", "more buffers read on the side stream than SIDE_MAX_BUFFERS", __FILE__, __LINE__);
    SideRead* r = &g_side.reads[g_side.n_reads++];
    r->buffer = buffer;
    r->pending = false;
    CUDA_CHECK(cudaEventCreateWithFlags(&r->done, cudaEventDisableTiming));
    return r;
}

/* Swaps what the products launch on (common.cuh's stream, cuBLAS handle and workspace, and the
 * multiprocessors their algorithms are chosen for) with the side stream's: called twice, it
 * restores them. cuBLASLt's handle takes the stream per call. */
static void side_swap(void) {
    cudaStream_t s = g_stream;
    cublasHandle_t h = g_cublas;
    void* w = g_gemm_workspace;
    int n = g_lt_sm_target;
    g_stream = g_side.stream, g_cublas = g_side.cublas, g_gemm_workspace = g_side.workspace;
    g_lt_sm_target = g_side.sm_target;
    g_side.stream = s, g_side.cublas = h, g_side.workspace = w, g_side.sm_target = n;
}

/* Runs `product` (the launches of one weight gradient) on the side stream after everything issued
 * so far on g_stream; `reads`: the buffer it reads that the main stream overwrites later (the main
 * stream calls side_wait(reads) first). */
template <typename Product> static void side_product(const void* reads, Product product) {
    if (!g_side.stream) {
        product();
        return;
    }
    CUDA_CHECK(cudaEventRecord(g_side.fork, g_stream));
    CUDA_CHECK(cudaStreamWaitEvent(g_side.stream, g_side.fork, 0));
    side_swap();
    product();
    side_swap();
    SideRead* r = side_read(reads);
    CUDA_CHECK(cudaEventRecord(r->done, g_side.stream));
    r->pending = true;
    g_side.active = true;
    side_issue_next();
}

/* Issues side_after_next_product's work, if any, on the side stream. */
static void side_issue_next(void) {
    if (!g_side_next.work) return;
    std::function<void()> work = std::move(g_side_next.work);
    g_side_next.work = nullptr;
    side_product(g_side_next.reads, work);
}

/* `work`, which the main stream waits for only by a later side_wait(reads), runs on the side
 * stream right behind the next weight gradient (so it delays neither that product nor the main
 * stream's wait for it), or at side_wait(reads) or side_join if one comes first; without a side
 * stream, at once. The LayerNorm backward's final sums (layernorm.cuh's layernorm_bwd_final_issue,
 * docs/BENCHMARKS.md #90) leave the step's one chain this way. */
static void side_after_next_product(const void* reads, std::function<void()> work) {
    if (!g_side.stream) {
        work();
        return;
    }
    side_issue_next();
    g_side_next.work = std::move(work);
    g_side_next.reads = reads;
}

/* The main stream waits until the side stream's readers of `buffer` so far are done. */
static void side_wait(const void* buffer) {
    if (g_side_next.work && g_side_next.reads == buffer) side_issue_next();
    for (int i = 0; i < g_side.n_reads; i++) {
        SideRead* r = &g_side.reads[i];
        if (r->buffer == buffer && r->pending) {
            CUDA_CHECK(cudaStreamWaitEvent(g_stream, r->done, 0));
            r->pending = false;
        }
    }
}

/* The main stream waits for all side-stream work issued so far. */
static void side_join(void) {
    side_issue_next();
    if (!g_side.active) return; /* nothing forked: no event of this capture to wait for */
    CUDA_CHECK(cudaEventRecord(g_side.joined, g_side.stream));
    CUDA_CHECK(cudaStreamWaitEvent(g_stream, g_side.joined, 0));
    for (int i = 0; i < g_side.n_reads; i++) g_side.reads[i].pending = false;
    g_side.active = false;
}

/* ---------------------------------------------------------------------------------------------- */
/* The ahead stream: work that reads only a micro-batch's inputs (the embedding backward's sort of
 * the tokens, embed.cuh), forked from g_stream once they are uploaded so that it runs beside the
 * forward instead of on the step's one chain at the end of the backward, and joined right before
 * its result is read. Set up for every training run (ahead_stream_init; the products' side stream
 * above only where it pays); without it, ahead_run runs the work in place. The same kernels on the
 * same data: the same bits. */
static struct {
    cudaStream_t stream; /* 0: none, work runs in place */
    cudaEvent_t fork, done;
    bool pending; /* forked work the main stream has not joined yet */
} g_ahead;

static void ahead_stream_init(void) {
    CUDA_CHECK(cudaStreamCreate(&g_ahead.stream));
    CUDA_CHECK(cudaEventCreateWithFlags(&g_ahead.fork, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&g_ahead.done, cudaEventDisableTiming));
}

static void ahead_stream_shutdown(void) {
    if (!g_ahead.stream) return;
    CUDA_CHECK(cudaEventDestroy(g_ahead.fork));
    CUDA_CHECK(cudaEventDestroy(g_ahead.done));
    CUDA_CHECK(cudaStreamDestroy(g_ahead.stream));
    memset(&g_ahead, 0, sizeof g_ahead);
}

/* Runs `work` (launches on g_stream, which it sees as the ahead stream) after everything issued so
 * far on g_stream, beside what g_stream does next; ahead_join before anything reads its results.
 * Kernels and CUB calls only: unlike side_product it does not swap the cuBLAS handle. */
template <typename Work> static void ahead_run(Work work) {
    if (!g_ahead.stream) {
        work();
        return;
    }
    cudaStream_t main_stream = g_stream;
    CUDA_CHECK(cudaEventRecord(g_ahead.fork, main_stream));
    CUDA_CHECK(cudaStreamWaitEvent(g_ahead.stream, g_ahead.fork, 0));
    g_stream = g_ahead.stream;
    work();
    g_stream = main_stream;
    CUDA_CHECK(cudaEventRecord(g_ahead.done, g_ahead.stream));
    g_ahead.pending = true;
}

/* The main stream waits for the work ahead_run forked (a capture must join it before it ends). */
static void ahead_join(void) {
    if (!g_ahead.pending) return;
    CUDA_CHECK(cudaStreamWaitEvent(g_stream, g_ahead.done, 0));
    g_ahead.pending = false;
}

#endif
