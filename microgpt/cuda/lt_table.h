/* lt_table.h: the fixed table of cuBLASLt algorithms (docs/DESIGN.md §9): for a product named by
 * its key (common.cuh's lt_key_name: types, epilogue, transposes, shape, leading dimensions,
 * batch and strides), the full configuration of the algorithm that ran fastest when the table
 * was measured (bench/lt_algos.cu), chosen offline and never by timing at run time. The data
 * lives in a generated header (lt_table_sm90.h, written by bench/lt_table.py), included by
 * common.cuh. C99, so the generator's test compiles it with gcc. */
#ifndef MICROGPT_CUDA_LT_TABLE_H
#define MICROGPT_CUDA_LT_TABLE_H

#include <stddef.h>
#include <string.h>

/* One product's algorithm: cublasLtMatmulAlgoInit's algo id, then the values of the
 * CUBLASLT_ALGO_CONFIG_* attributes it is rebuilt with. The table ends with an entry whose key is
 * NULL. */
typedef struct {
    const char* key;
    int algo_id, tile, stages, splitk, reduction, swizzle, custom, inner_shape, cluster_shape;
} LtTableEntry;

/* The entry of `key` in table, or NULL. */
static const LtTableEntry* lt_table_find(const LtTableEntry* table, const char* key) {
    for (; table->key; table++)
        if (strcmp(table->key, key) == 0) return table;
    return NULL;
}

#endif
