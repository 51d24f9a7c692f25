/* dist.cuh: the CUDA engine's data parallelism (docs/DESIGN.md §17) over NCCL. host/dist.h connects
 * the ranks and carries the NCCL id and scalars; the gradients and weights travel through NCCL.
 * ZeRO-1, first version: after the backward (not yet overlapped with it), one ncclReduceScatter of
 * the fp32 gradients, AdamW on this rank's part, one ncclAllGather of the fp32 weights
 * (microgpt_cuda.cu: update_sharded). Parts are dist_part(P, DIST_CUDA_UNIT): whole words of the
 * weight-decay mask, equal strides, the buffers padded to world × stride.
 * Reproducible sums: NCCL_ALGO=Ring and NCCL_PROTO=Simple unless the environment says otherwise
 * (one ring order, run to run, on the same ranks and GPUs). NVLink multicast stays off
 * (NCCL_NVLS_ENABLE=0). Every wait polls ncclCommGetAsyncError and the ranks' sockets (a rank that
 * exited) and aborts after ANDREA_DIST_TIMEOUT_S, so a dead rank ends the run instead of hanging it.
 * Built without NCCL (no nccl.h at build time), WORLD_SIZE > 1 is refused with one error line. */
#ifndef MICROGPT_CUDA_DIST_CUH
#define MICROGPT_CUDA_DIST_CUH

#include "../host/dist.h"
#include "common.cuh"

#define DIST_CUDA_UNIT 32 /* floats: one word of the AdamW decay mask, 128 bytes (packed kernels) */

#ifdef ANDREA_NCCL
#include <nccl.h>

static ncclComm_t g_nccl = NULL;

static void nccl_fail(const char* what, ncclResult_t r) {
    if (g_nccl) ncclCommAbort(g_nccl);
    g_nccl = NULL;
    die_io("rank %d: NCCL %s: %s%s", g_dist.rank, what, ncclGetErrorString(r),
           r == ncclRemoteError || r == ncclSystemError ? " (another rank failed or exited)" : "");
}

/* Until `done()` or the timeout; an asynchronous NCCL error (a dead peer) aborts the communicator. */
static void nccl_wait(int (*done)(void), const char* what) {
    double deadline = dist_now_s() + g_dist.timeout_s;
    for (;;) {
        ncclResult_t async = ncclSuccess;
        int gone;
        if (done()) return;
        ncclCommGetAsyncError(g_nccl, &async);
        if (async != ncclSuccess && async != ncclInProgress) nccl_fail(what, async);
        if ((gone = dist_peer_gone()) >= 0) { /* NCCL would wait for it until the timeout */
            ncclCommAbort(g_nccl);
            g_nccl = NULL;
            dist_lost(gone, "it exited");
        }
        if (dist_now_s() > deadline) {
            ncclCommAbort(g_nccl);
            g_nccl = NULL;
            die_io("rank %d: NCCL %s: no progress within ANDREA_DIST_TIMEOUT_S (%.0f s); a rank is gone or stuck",
                   g_dist.rank, what, g_dist.timeout_s);
        }
    }
}

static int nccl_comm_ready(void) {
    ncclResult_t state = ncclInProgress;
    ncclCommGetAsyncError(g_nccl, &state);
    return state == ncclSuccess;
}

static int stream_idle(void) {
    cudaError_t e = cudaStreamQuery(g_stream);
    if (e != cudaSuccess && e != cudaErrorNotReady) CUDA_CHECK(e);
    return e == cudaSuccess;
}

/* This rank's GPU: LOCAL_RANK (one process per GPU). */
static int dist_device(void) { return g_dist.local_rank; }

/* After cudaSetDevice(dist_device()): one communicator over all ranks, created non-blocking so the
 * wait for the others has a timeout. */
static void dist_cuda_init(void) {
    ncclUniqueId id;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    ncclResult_t r;
    if (g_dist.world == 1) return;
    setenv("NCCL_ALGO", "Ring", 0);
    setenv("NCCL_PROTO", "Simple", 0);
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    if (g_dist.rank == 0 && (r = ncclGetUniqueId(&id)) != ncclSuccess) nccl_fail("ncclGetUniqueId", r);
    dist_broadcast(&id, sizeof id);
    config.blocking = 0;
    r = ncclCommInitRankConfig(&g_nccl, g_dist.world, id, g_dist.rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) nccl_fail("ncclCommInitRankConfig", r);
    nccl_wait(nccl_comm_ready, "communicator set-up");
    info("rank %d of %d: NCCL on GPU %d (NCCL_ALGO=%s NCCL_PROTO=%s NCCL_NVLS_ENABLE=%s)", g_dist.rank, g_dist.world,
         dist_device(), getenv("NCCL_ALGO"), getenv("NCCL_PROTO"), getenv("NCCL_NVLS_ENABLE"));
}

static void nccl_check_enqueued(const char* what, ncclResult_t r) {
    if (r != ncclSuccess && r != ncclInProgress) nccl_fail(what, r);
}

/* The ranks' gradient sums; this rank's part [rank·stride, +stride) of grads, in place. */
static void dist_reduce_scatter_grads(float* grads, size_t stride) {
    nccl_check_enqueued("ncclReduceScatter", ncclReduceScatter(grads, grads + (size_t)g_dist.rank * stride, stride,
                                                               ncclFloat32, ncclSum, g_nccl, g_stream));
    nccl_wait(stream_idle, "gradient reduce-scatter");
}

/* Every rank's part of params to every rank, in place. */
static void dist_all_gather_params(float* params, size_t stride) {
    nccl_check_enqueued("ncclAllGather", ncclAllGather(params + (size_t)g_dist.rank * stride, params, stride,
                                                       ncclFloat32, g_nccl, g_stream));
    nccl_wait(stream_idle, "weight all-gather");
}

static void dist_cuda_shutdown(void) {
    if (g_nccl) ncclCommDestroy(g_nccl);
    g_nccl = NULL;
}

#else /* built without NCCL */

static int dist_device(void) { return 0; }

static void dist_cuda_init(void) {
    if (g_dist.world > 1)
        die_input("WORLD_SIZE=%d: this build of the CUDA engine has no NCCL (nccl.h was not found at build time); "
                  "install NCCL and rebuild, or train on one GPU", g_dist.world);
}

/* only ever called with WORLD_SIZE > 1, which dist_cuda_init refused */
static void dist_reduce_scatter_grads(float* grads, size_t stride) { (void)grads; (void)stride; }
static void dist_all_gather_params(float* params, size_t stride) { (void)params; (void)stride; }
static void dist_cuda_shutdown(void) {}

#endif
#endif
