/* lt_table_sm90.h: the fixed cuBLASLt algorithms of compute capability 9.0 (lt_table.h), generated
 * by bench/lt_table.py from the output of bench/lt_algos.cu. This one is empty: nothing measured
 * yet, so a -DLT_FIXED_TABLE=1 build runs today's rule everywhere. */
#ifndef MICROGPT_CUDA_LT_TABLE_SM90_H
#define MICROGPT_CUDA_LT_TABLE_SM90_H

#include "lt_table.h"

/* The table applies only on a GPU of this many multiprocessors with this cuBLASLt (cublasLtGetVersion). */
#define LT_TABLE_SM_COUNT 0
#define LT_TABLE_CUBLASLT_VERSION 0

static const LtTableEntry g_lt_table[] = {
    {NULL, 0, 0, 0, 0, 0, 0, 0, 0, 0},
};

#endif
