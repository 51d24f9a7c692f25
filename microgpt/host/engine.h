/* engine.h: the interface every engine (CPU, CUDA) implements. train_loop.h drives it; it never
 * sees device memory. All arrays passed in or out are host memory.
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_ENGINE_H
#define MICROGPT_HOST_ENGINE_H

#include "../cpu/fp8.h"
#include "config.h"
#include "params.h"

typedef struct {
    float grad_norm;  /* global L2 norm of the (1/accum-scaled) gradients, before clipping */
    int skipped;      /* 1: the update was not applied (fp16 overflow) */
    float loss_scale; /* current dynamic loss scale (fp16), 1 otherwise */
} UpdateResult;

/* Identity for the "start" event: "cpu" / "cuda", and what the engine really computes in for the
 * configured precision (the CPU engine answers "fp32", or "fp8" where it emulates the FP8 casts). */
static const char* engine_name(void);
static const char* engine_compute_precision(const Config* cfg);

/* Allocate every buffer once, print the memory plan to stderr, emit the "memory" event
 * (output.h: emit_memory); returns the bytes allocated. Must die (die_io) with needed/free bytes
 * when memory is short. The engine builds its own ParamLayout with param_layout_init(cfg): the
 * same layout train_loop uses. With cfg->generate or cfg->evaluate nothing is trained: no
 * gradients, no AdamW state. The KV cache has config_kv_slots(cfg) slots of seq_len positions. */
static size_t engine_setup(const Config* cfg);
/* Load weights and AdamW moments (n_params floats each). loss_scale <= 0 means "engine default".
 * m and v are NULL in --generate and --evaluate (weights only). */
static void engine_set_state(const float* params, const float* m, const float* v, float loss_scale);
static void engine_get_state(float* params, float* m, float* v, float* loss_scale);
/* The amax histories of delayed fp8 scaling (docs/DESIGN.md §18), layer-major: how many the engine
 * keeps (0 unless it trains in fp8), a copy of them, and their restore
 * (from the checkpoint's sidecar; each training micro-batch then extends them). */
static int engine_fp8_history_count(void);
static void engine_get_fp8_history(Fp8History* h);
static void engine_set_fp8_history(const Fp8History* h);
/* One micro-batch of B·T tokens: forward + backward, grads += . The GPU engine only queues it, so
 * that the update can follow without a round trip to the host; its mean loss is
 * engine_micro_loss()'s. */
static void engine_forward_backward(const int* inputs, const int* targets);
/* The mean loss of the last micro-batch (waiting for it to finish). */
static float engine_micro_loss(void);
/* Validation: forward only, no gradients; returns the mean loss over B·T positions. */
static float engine_forward_loss(const int* inputs, const int* targets);
/* Generation with the KV cache (docs/DESIGN.md §5a). Logits are fp32 over the real vocabulary.
 * prefill: the forward (the training kernels) over tokens[0:len] of one sequence, 1 <= len <= T;
 * keeps their keys and values in cache slot `slot` and writes the logits [vocab_size] of position
 * len-1. decode: one step of n sequences, sequence i in slot slots[i] (distinct) with token
 * tokens[i] at position positions[i] < T, whose earlier positions are in the cache: appends its
 * key and value there, writes logits[i·vocab_size ...]. Each sequence's logits do not depend on the
 * others decoded with it. */
static void engine_prefill(int slot, const int* tokens, int len, float* logits);
static void engine_decode(int n, const int* slots, const int* tokens, const int* positions, float* logits);
/* grads·1/accum, global norm (deterministic), clip to grad_clip, AdamW with decay on 2-D tensors
 * only (t = 1-based step); the next micro-batch starts the gradients afresh. */
static UpdateResult engine_update(float lr, int t, const Config* cfg);
/* Host copy of the accumulated (unscaled) grads, n_params floats (for --dump-grads). */
static void engine_get_grads(float* grads);
/* Device bytes in use right now (cudaMemGetInfo-style); 0 on the CPU. */
static size_t engine_device_bytes_in_use(void);
static void engine_shutdown(void);

#endif
