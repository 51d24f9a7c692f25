/* timeline.c: every kernel, memset and copy a CUDA program runs, with its start, end and stream, as CSV, for a
 * timeline of the engine's captured step (which kernels run side by side, where the GPU idles).
 * Nsight Systems would draw this, but the lent GPU machine has no working nsys
 * (docs/BENCHMARKS.md, "Where the time goes"); CUPTI's activity records are what nsys reads.
 *
 * An injection library: CUDA loads it into any program started with
 *     CUDA_INJECTION64_PATH=build/libtimeline.so TIMELINE_OUT=kernels.csv build/microgpt_cuda ...
 * and calls InitializeInjection at the program's first CUDA call; the records are written when the
 * program exits (a kernel of a CUDA graph is recorded like any other). bench/timeline.py reads the
 * CSV. Build: `make build/libtimeline.so` (needs CUPTI, which the CUDA toolkit ships). */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

#define TIMELINE_BUFFER_BYTES (8u << 20)

static FILE* g_out;

static void check(CUptiResult r, const char* what) {
    if (r == CUPTI_SUCCESS) return;
    const char* msg = "?";
    cuptiGetResultString(r, &msg);
    fprintf(stderr, "timeline: %s failed: %s\n", what, msg);
    exit(1);
}

static void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *buffer = aligned_alloc(8, TIMELINE_BUFFER_BYTES);
    *size = *buffer ? TIMELINE_BUFFER_BYTES : 0;
    *max_records = 0;
}

/* Kernel names are mangled; bench/timeline.py shortens them. Commas cannot occur in a mangled
 * name, but a demangled one may carry them, so the name is the last column. */
static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t size, size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity* rec = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            const CUpti_ActivityKernel10* k = (const CUpti_ActivityKernel10*)rec;
            fprintf(g_out, "%llu,%llu,%u,%u,%u,%u,%d,%s\n", (unsigned long long)k->start, (unsigned long long)k->end,
                    k->streamId, k->gridX * k->gridY * k->gridZ, k->blockX * k->blockY * k->blockZ,
                    k->staticSharedMemory + k->dynamicSharedMemory, k->registersPerThread, k->name ? k->name : "?");
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) { /* bytes in the blocks column */
            const CUpti_ActivityMemset4* m = (const CUpti_ActivityMemset4*)rec;
            fprintf(g_out, "%llu,%llu,%u,%llu,0,0,0,[memset]\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, m->streamId, (unsigned long long)m->bytes);
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy6* m = (const CUpti_ActivityMemcpy6*)rec;
            fprintf(g_out, "%llu,%llu,%u,%llu,0,0,0,[memcpy kind %u]\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, m->streamId, (unsigned long long)m->bytes, m->copyKind);
        }
    }
    size_t dropped = 0;
    cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped);
    if (dropped) fprintf(stderr, "timeline: %zu records dropped\n", dropped);
    free(buffer);
}

static void flush_at_exit(void) {
    check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
    fclose(g_out);
}

int InitializeInjection(void) {
    const char* path = getenv("TIMELINE_OUT");
    g_out = fopen(path ? path : "kernels.csv", "w");
    if (!g_out) {
        perror("timeline: TIMELINE_OUT");
        exit(1);
    }
    fprintf(g_out, "start_ns,end_ns,stream,blocks,threads,smem,regs,name\n");
    check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable kernels");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "cuptiActivityEnable memsets");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "cuptiActivityEnable copies");
    atexit(flush_at_exit);
    return 1;
}
