# ANDREA build. `make` builds build/microgpt_cpu, and build/microgpt_cuda when nvcc is on PATH.
#
# No -march=native: binaries and results must be the same on every machine, and
# -ffp-contract=off stops the compiler fusing a*b+c into FMAs differently from one build to the next.

CC        = gcc
CFLAGS    = -std=c99 -O3 -fopenmp -ffp-contract=off -Wall -D_POSIX_C_SOURCE=200809L
LDLIBS    = -lm
NVCC     ?= nvcc
# --threads 0: a fat binary's architectures compiled in parallel, one a core (the same code; on 2
# cores the five of a build without a visible GPU take 158 s instead of 269)
NVCCFLAGS = -O3 -std=c++17 -Xcompiler -fopenmp,-ffp-contract=off,-Wall --threads 0
NVLDLIBS  = -lcublas -lcublasLt -lgomp -lm
# Compile-time candidates for A/B runs, e.g. make KERNEL_VARIANTS="-DNEW_IDEA=1" (a -D macro a
# change adds beside the current code; bench/attn-variants.sh compares flash-attention builds).
# make does not track flags: run `make clean` before building with other flags, or build the
# variant's binaries beside the default ones under other names: VARIANT_SUFFIX names them
# (build/microgpt_cuda$(VARIANT_SUFFIX), build/kernel_check$(VARIANT_SUFFIX), build/attn_bench$(VARIANT_SUFFIX);
# make -B, as flags are not tracked). bench/attn-variants.sh and bench/engine-ab.sh build variants so.
NVCCFLAGS += $(KERNEL_VARIANTS)
VARIANT_SUFFIX ?=
PYTHON   ?= python3

HOST_HEADERS := $(wildcard microgpt/host/*.h)
CPU_HEADERS  := $(wildcard microgpt/cpu/*.h)
CUDA_HEADERS := $(wildcard microgpt/cuda/*.cuh microgpt/cuda/*.h)
CUDA_SOURCE  := $(wildcard microgpt/microgpt_cuda.cu)
HAVE_NVCC    := $(shell command -v $(NVCC) 2>/dev/null)
# NCCL (multi-GPU data parallelism, docs/DESIGN.md §17) where its header is found beside nvcc's or in
# /usr/include; without it the GPU engine still builds and refuses WORLD_SIZE > 1 with one error line.
NCCL_HEADER  := $(firstword $(wildcard $(dir $(HAVE_NVCC))../include/nccl.h /usr/include/nccl.h))
ifneq ($(NCCL_HEADER),)
  NVCCFLAGS += -DANDREA_NCCL
  NVLDLIBS  += -lnccl
endif

# GPU architecture: the local GPU's if nvidia-smi answers (e.g. "9.0" -> 90), else a fat binary for
# Ampere, Ada and Hopper plus compute_90 PTX that newer GPUs JIT-compile. Override: make GPU_ARCH=86
# Hopper (90) is built as sm_90a, the target with its warpgroup instructions (wgmma: the
# attention forward and dK/dV on Hopper); sm_90a code runs on compute capability 9.0 only, and other
# GPUs take the PTX or their own code (docs/DESIGN.md §9). nvcc 13.0 needs the -gencode form here:
# -arch=sm_90a also runs a plain sm_90 pass.
GPU_ARCH ?= $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')
ifeq ($(GPU_ARCH),90)
  NVCC_ARCH := -gencode arch=compute_90a,code=sm_90a
else ifneq ($(GPU_ARCH),)
  NVCC_ARCH := -gencode arch=compute_$(GPU_ARCH),code=sm_$(GPU_ARCH)
else
  NVCC_ARCH := -gencode arch=compute_80,code=sm_80 -gencode arch=compute_86,code=sm_86 \
               -gencode arch=compute_89,code=sm_89 -gencode arch=compute_90a,code=sm_90a \
               -gencode arch=compute_90,code=compute_90
endif

# `make` builds the GPU engine only where it can: with nvcc and its source present.
ALL := build/microgpt_cpu
ifneq ($(HAVE_NVCC),)
ifneq ($(CUDA_SOURCE),)
  ALL += build/microgpt_cuda
endif
endif

.PHONY: all cpu cuda kernel-check rowk-bench test data clean

all: $(ALL)

cpu: build/microgpt_cpu

cuda: build/microgpt_cuda

# KERNEL_VARIANTS (-D macros) reach the CPU engine too: a candidate that changes what is computed
# (fp8's scaling) has its CPU reference build/microgpt_cpu$(VARIANT_SUFFIX)
build/microgpt_cpu$(VARIANT_SUFFIX): microgpt/microgpt_cpu.c $(HOST_HEADERS) $(CPU_HEADERS) | build
	$(CC) $(CFLAGS) $(KERNEL_VARIANTS) -o $@ microgpt/microgpt_cpu.c $(LDLIBS)

build/microgpt_cuda$(VARIANT_SUFFIX): microgpt/microgpt_cuda.cu $(HOST_HEADERS) $(CUDA_HEADERS) $(CPU_HEADERS) | build
	@test -n "$(HAVE_NVCC)" || { echo "error: $(NVCC) not found on PATH (install the CUDA toolkit, 12 or 13)"; exit 1; }
	$(NVCC) $(NVCCFLAGS) $(NVCC_ARCH) -o $@ microgpt/microgpt_cuda.cu $(NVLDLIBS)

# GPU-vs-CPU check of every kernel pair (tests/kernel_check.cu); run by tests/test_gpu.py
kernel-check: build/kernel_check

build/kernel_check$(VARIANT_SUFFIX): tests/kernel_check.cu $(CUDA_HEADERS) $(CPU_HEADERS) | build
	$(NVCC) $(NVCCFLAGS) $(NVCC_ARCH) -o $@ tests/kernel_check.cu $(NVLDLIBS)

# flash-attention kernel times (bench/attn_bench.cu); a measurement tool, not part of `make`
build/attn_bench$(VARIANT_SUFFIX): bench/attn_bench.cu bench/kernel_timer.cuh $(CUDA_HEADERS) | build
	$(NVCC) $(NVCCFLAGS) $(NVCC_ARCH) -o $@ bench/attn_bench.cu $(NVLDLIBS)

# Timing of the row and element-wise kernels alone (bench/rowk_bench.cu; a tool, run by people)
rowk-bench: build/rowk_bench

build/rowk_bench$(VARIANT_SUFFIX): bench/rowk_bench.cu bench/kernel_timer.cuh $(CUDA_HEADERS) | build
	$(NVCC) $(NVCCFLAGS) $(NVCC_ARCH) -o $@ bench/rowk_bench.cu $(NVLDLIBS)

# the GELU backward's product alone, cuBLASLt's against the engine's Hopper kernel
# (bench/dgelu_bench.cu; a measurement tool, not part of `make`)
build/dgelu_bench: bench/dgelu_bench.cu bench/kernel_timer.cuh $(CUDA_HEADERS) | build
	$(NVCC) $(NVCCFLAGS) $(NVCC_ARCH) -o $@ bench/dgelu_bench.cu $(NVLDLIBS)

# the classifier's logits product and fused backward alone, against their floors
# (bench/classifier_bench.cu; a measurement tool, not part of `make`)
build/classifier_bench: bench/classifier_bench.cu bench/kernel_timer.cuh $(CUDA_HEADERS) | build
	$(NVCC) $(NVCCFLAGS) $(NVCC_ARCH) -o $@ bench/classifier_bench.cu $(NVLDLIBS)

# cuBLASLt's offers against the engine's rule for every product of a step (bench/lt_algos.cu; a
# tool, run by people: its output is what bench/lt_table.py makes the fixed table from)
build/lt_algos: bench/lt_algos.cu bench/kernel_timer.cuh $(CUDA_HEADERS) $(CPU_HEADERS) | build
	$(NVCC) $(NVCCFLAGS) $(NVCC_ARCH) -o $@ bench/lt_algos.cu $(NVLDLIBS)

# The kernels of a run with their start, end and stream (bench/timeline.c, an injection library
# that CUDA loads into the engine; bench/timeline.py reads its CSV; a tool, run by people)
CUPTI_LIB := $(dir $(HAVE_NVCC))../lib64
build/libtimeline.so: bench/timeline.c | build
	gcc -O2 -Wall -shared -fPIC -I$(dir $(HAVE_NVCC))../include -o $@ bench/timeline.c -L$(CUPTI_LIB) -L$(dir $(HAVE_NVCC))../lib -lcupti

build:
	mkdir -p build

# The suite in PYTEST_WORKERS processes (pytest-xdist; 0: in pytest's own process). Most tests wait on
# engines, proxies and browsers they start, so two workers halve the time on 2 cores.
PYTEST_WORKERS ?= 2
test: all
	$(PYTHON) -m pytest -q -n $(PYTEST_WORKERS)

data:
	$(PYTHON) scripts/prepare-data.py

clean:
	rm -rf build
