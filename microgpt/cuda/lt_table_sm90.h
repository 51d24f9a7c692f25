/* lt_table_sm90.h: the fixed cuBLASLt algorithms of compute capability 9.0 (lt_table.h), generated
 * by bench/lt_table.py from lt.txt, the output of bench/lt_algos.cu, measured on
 * NVIDIA H200 (132 multiprocessors), NVIDIA driver 580.159.04, cuBLASLt 130100, CUDA runtime 13000, 2026-12-04T16:16:09Z.
 * An entry: a product whose fastest offer beat the rule's choice by at least 3 %, with
 * the probe line it came from. Do not edit: run the probe and the generator again. */
#ifndef MICROGPT_CUDA_LT_TABLE_SM90_H
#define MICROGPT_CUDA_LT_TABLE_SM90_H

#include "lt_table.h"

/* The table applies only on a GPU of this name (cudaDeviceProp.name: an H100 has the H200's compute
 * capability and multiprocessors) and this many multiprocessors, with this cuBLASLt (cublasLtGetVersion). */
#define LT_TABLE_GPU_NAME "NVIDIA H200"
#define LT_TABLE_SM_COUNT 132
#define LT_TABLE_CUBLASLT_VERSION 130100

/* Product time a step the probe's figures save (Σ (rule_us - best_us) × launches a step):
 *   120M bf16: 142 µs
 *   120M fp8: 256 µs
 *   12M bf16: 0 µs
 *   12M fp8: 2 µs
 */
/* Left out (the rule stays):
 *   bf16.bf16.bf16.plain.nn.8192x768x768.ld768.768.768.b3.s0.589824.6291456: the rule's choice is the fastest offer
 *   bf16.bf16.bf16.residual.nn.8192x768x768.ld768.768.768: within 3 % of the rule's choice (noise)
 *   bf16.bf16.bf16.gelu_aux.nn.8192x3072x768.ld768.3072.3072: the rule's choice is the fastest offer
 *   bf16.bf16.bf16.residual.nn.8192x768x3072.ld3072.768.768: within 3 % of the rule's choice (noise)
 *   bf16.bf16.fp32.plain.tn.50304x768x8192.ld50304.768.768: the rule's choice is the fastest offer
 *   bf16.bf16.bf16.plain.nn.8192x768x50304.ld50304.768.768: within 3 % of the rule's choice (noise)
 *   bf16.bf16.fp32.plain.tn.3072x768x8192.ld3072.768.768: the rule's choice is the fastest offer
 *   bf16.bf16.fp32.plain.tn.768x3072x8192.ld768.3072.3072: the rule's choice is the fastest offer
 *   bf16.bf16.bf16.plain.nt.8192x768x3072.ld3072.3072.768: the rule's choice is the fastest offer
 *   bf16.bf16.fp32.plain.tn.768x768x8192.ld768.768.768: the rule's choice is the fastest offer
 *   bf16.bf16.bf16.plain.nt.8192x768x768.ld768.768.768: within 3 % of the rule's choice (noise)
 *   bf16.bf16.fp32.plain.tn.768x768x8192.ld768.768.768.b3.s0.6291456.589824: the rule's choice is the fastest offer
 *   e4m3.e4m3.bf16.fp8fa.nt.8192x768x768.ld768.768.768: the rule's choice is the fastest offer
 *   e4m3.e4m3.bf16.fp8fa.nt.8192x768x3072.ld3072.3072.768: the rule's choice is the fastest offer
 *   e4m3.e4m3.fp32.fp8.nt.3072x768x8192.ld8192.8192.768: the rule's choice is the fastest offer
 *   e4m3.e4m3.fp32.fp8.nt.768x3072x8192.ld8192.8192.3072: the rule's choice is the fastest offer
 *   e4m3.e4m3.bf16.fp8.nt.8192x768x3072.ld3072.3072.768: the rule's choice is the fastest offer
 *   e4m3.e4m3.fp32.fp8.nt.768x768x8192.ld8192.8192.768: the rule's choice is the fastest offer
 *   e4m3.e4m3.bf16.fp8.nt.8192x768x768.ld768.768.768: within 3 % of the rule's choice (noise)
 *   e4m3.e4m3.fp32.fp8.nt.768x768x8192.ld8192.8192.768.b3.s0.6291456.589824: the rule's choice is the fastest offer
 *   e4m3.e4m3.bf16.fp8.nt.8192x768x2304.ld2304.2304.768: the rule's choice is the fastest offer
 *   bf16.bf16.bf16.plain.nn.4096x192x192.ld192.192.192.b3.s0.36864.786432: within 3 % of the rule's choice (noise)
 *   bf16.bf16.bf16.residual.nn.4096x192x192.ld192.192.192: within 3 % of the rule's choice (noise)
 *   bf16.bf16.bf16.gelu_aux.nn.4096x768x192.ld192.768.768: the rule's choice is the fastest offer
 *   bf16.bf16.bf16.residual.nn.4096x192x768.ld768.192.192: within 3 % of the rule's choice (noise)
 *   bf16.bf16.bf16.plain.nt.4096x50304x192.ld192.192.50304: the rule's choice is the fastest offer
 *   bf16.bf16.fp32.plain.tn.50304x192x4096.ld50304.192.192: within 3 % of the rule's choice (noise)
 *   bf16.bf16.bf16.plain.nn.4096x192x50304.ld50304.192.192: the rule's choice is the fastest offer
 *   bf16.bf16.fp32.plain.tn.768x192x4096.ld768.192.192: the rule's choice is the fastest offer
 *   bf16.bf16.fp32.plain.tn.192x768x4096.ld192.768.768: the rule's choice is the fastest offer
 *   bf16.bf16.bf16.plain.nt.4096x192x768.ld768.768.192: the rule's choice is the fastest offer
 *   bf16.bf16.fp32.plain.tn.192x192x4096.ld192.192.192: within 3 % of the rule's choice (noise)
 *   bf16.bf16.bf16.plain.nt.4096x192x192.ld192.192.192: within 3 % of the rule's choice (noise)
 *   bf16.bf16.fp32.plain.tn.192x192x4096.ld192.192.192.b3.s0.786432.36864: the rule's choice is the fastest offer
 *   e4m3.e4m3.bf16.fp8fa.nt.4096x192x192.ld192.192.192.b3.s0.36864.786432: within 3 % of the rule's choice (noise)
 *   e4m3.e4m3.bf16.fp8fa.nt.4096x192x192.ld192.192.192: within 3 % of the rule's choice (noise)
 *   e4m3.e4m3.bf16.fp8fa.nt.4096x192x768.ld768.768.192: the rule's choice is the fastest offer
 *   e4m3.e4m3.fp32.fp8.nt.768x192x4096.ld4096.4096.192: within 3 % of the rule's choice (noise)
 *   e4m3.e4m3.bf16.fp8.nt.4096x768x192.ld192.192.768: within 3 % of the rule's choice (noise)
 *   e4m3.e4m3.fp32.fp8.nt.192x768x4096.ld4096.4096.768: within 3 % of the rule's choice (noise)
 *   e4m3.e4m3.bf16.fp8.nt.4096x192x768.ld768.768.192: within 3 % of the rule's choice (noise)
 *   e4m3.e4m3.fp32.fp8.nt.192x192x4096.ld4096.4096.192: within 3 % of the rule's choice (noise)
 *   e4m3.e4m3.bf16.fp8.nt.4096x192x192.ld192.192.192: the rule's choice is the fastest offer
 *   e4m3.e4m3.fp32.fp8.nt.192x192x4096.ld4096.4096.192.b3.s0.786432.36864: within 3 % of the rule's choice (noise)
 *   e4m3.e4m3.bf16.fp8.nt.4096x192x576.ld576.576.192: within 3 % of the rule's choice (noise)
 */
static const LtTableEntry g_lt_table[] = {
    /* LTPROBE model=120M prec=bf16 product=classifier key=bf16.bf16.bf16.plain.nt.8192x50304x768.ld768.768.50304 calls=1 offers=8 rule_us=958.40 best_us=816.38 gain_pct=14.8 repeat=1 diff=0 ws=4 rule=66:209:35:1:0:0:4:0:3 best=66:197:35:1:0:0:2:0:5 */
    {"bf16.bf16.bf16.plain.nt.8192x50304x768.ld768.768.50304", 66, 197, 35, 1, 0, 0, 2, 0, 5},
    /* LTPROBE model=120M prec=fp8 product=fp8_qkv_fwd key=e4m3.e4m3.bf16.fp8fa.nt.8192x768x768.ld768.768.768.b3.s0.589824.6291456 calls=12 offers=8 rule_us=30.18 best_us=27.30 gain_pct=9.5 repeat=1 diff=0 ws=4 rule=66:209:36:1:0:0:6:0:5 best=66:20:36:1:0:0:1:0:3 */
    {"e4m3.e4m3.bf16.fp8fa.nt.8192x768x768.ld768.768.768.b3.s0.589824.6291456", 66, 20, 36, 1, 0, 0, 1, 0, 3},
    /* LTPROBE model=120M prec=fp8 product=fp8_w1_fwd key=e4m3.e4m3.bf16.fp8fa.nt.8192x3072x768.ld768.768.3072 calls=12 offers=8 rule_us=37.70 best_us=32.74 gain_pct=13.2 repeat=1 diff=0 ws=4 rule=66:24:36:1:0:0:7:0:5 best=66:201:36:1:0:0:2:0:5 */
    {"e4m3.e4m3.bf16.fp8fa.nt.8192x3072x768.ld768.768.3072", 66, 201, 36, 1, 0, 0, 2, 0, 5},
    /* LTPROBE model=120M prec=fp8 product=fp8_w2_bwd key=e4m3.e4m3.bf16.fp8.nt.8192x3072x768.ld768.768.3072 calls=12 offers=8 rule_us=42.85 best_us=41.22 gain_pct=3.8 repeat=1 diff=0 ws=4 rule=66:20:36:1:0:0:5:0:3 best=66:400:36:1:0:0:3:0:5 */
    {"e4m3.e4m3.bf16.fp8.nt.8192x3072x768.ld768.768.3072", 66, 400, 36, 1, 0, 0, 3, 0, 5},
    /* LTPROBE model=12M prec=fp8 product=fp8_w1_fwd key=e4m3.e4m3.bf16.fp8fa.nt.4096x768x192.ld192.192.768 calls=6 offers=8 rule_us=8.51 best_us=8.19 gain_pct=3.8 repeat=1 diff=0 ws=0 rule=66:31:36:1:0:0:7:0:5 best=66:28:36:1:0:0:0:0:3 */
    {"e4m3.e4m3.bf16.fp8fa.nt.4096x768x192.ld192.192.768", 66, 28, 36, 1, 0, 0, 0, 0, 3},
    {NULL, 0, 0, 0, 0, 0, 0, 0, 0, 0},
};

#endif
