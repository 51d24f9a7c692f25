/* kernel_check.cu: every CUDA kernel pair of microgpt/cuda/ against its CPU reference in
 * microgpt/cpu/, in fp32, bf16 and fp16, on fresh random inputs and a few awkward shapes; and, on
 * compute capability 8.9+, precision fp8's casts and products (run_fp8, with its own tolerances).
 *
 *   build: make kernel-check    (the engine's architectures: a Hopper build without sm_90a code
 *                                 fails the check of which attention forward ran)
 *   run:   build/kernel_check [--seed N] [--prec fp32|bf16|fp16|fp8|all] [--only attn|classifier|embed|mlp]
 *
 * How each check works:
 *   - inputs are drawn from a seeded generator (the seed differs per run unless --seed is given,
 *     and is printed first so any failure can be replayed); inputs the GPU holds in 16 bits are
 *     rounded to that type first, so the CPU sees exactly the values the GPU sees;
 *   - outputs a kernel overwrites (forward outputs, and the activation gradients a backward hands
 *     to the layer below) are poisoned with NaN before the launch; outputs a backward accumulates
 *     into (+=: LayerNorm's residual-stream dx) are prefilled with random values of the size of
 *     the expected increment, so "=" instead of "+=" fails; parameter gradients are checked both
 *     ways, as the engine uses them (matmul.cuh): grad_beta 0 over poison ("dw="), grad_beta 1
 *     over a prefill ("dw+=");
 *   - the error reported is ||gpu - cpu|| / ||cpu - prefill||: relative to what the kernel had to
 *     compute; any non-finite GPU element (an unwritten NaN) fails on its own;
 *   - backward kernels with reductions are launched twice from the same state and must agree bit
 *     for bit (determinism);
 *   - the decode kernels (cuda/decode.cuh) are also run on one sequence alone, which must give
 *     the bits that sequence got in the batch.
 *
 * Tolerances (relative, normwise). fp32 has no TF32 and the only differences from the CPU are
 * summation order and FMA contraction (~1e-7..1e-6); 16-bit runs are dominated by rounding of the
 * stored outputs (bf16: 2^-9 relative per element, fp16: 2^-11) and of intermediates in fused
 * pairs. A real indexing or formula bug gives errors of order 1.
 *                      element-wise   products/reductions   fused (attention, MLP, loss)
 *   fp32                   5e-6             2e-5                   5e-5
 *   bf16                   1e-2             2e-2                   3e-2
 *   fp16                   2e-3             5e-3                   1e-2
 * The mean loss is compared at 2e-5 in fp32, 3e-3 in bf16 and 1e-3 in fp16: 16-bit logits are
 * stored in T (see Tol below for the derivation). Measured on a CPU emulation of the kernels before
 * 16-bit logits: fp32 errors <= 5e-7, bf16 <= 3.8e-3, fp16 <= 1e-3. Exit status 1 if any check
 * fails. */
#include "../microgpt/cpu/adamw.h"
#include "../microgpt/cpu/attention.h"
#include "../microgpt/cpu/classifier.h"
#include "../microgpt/cpu/embed.h"
#include "../microgpt/cpu/fp8.h"
#include "../microgpt/cpu/gelu.h"
#include "../microgpt/cpu/layernorm.h"
#include "../microgpt/cpu/matmul.h"
#include "../microgpt/cpu/residual.h"

#include "../microgpt/cuda/attention.cuh"
#include "../microgpt/cuda/decode.cuh"
#include "../microgpt/cuda/embed.cuh"
#include "../microgpt/cuda/fp8.cuh"
#include "../microgpt/cuda/layernorm.cuh"
#include "../microgpt/cuda/loss.cuh"
#include "../microgpt/cuda/mlp.cuh"
#include "../microgpt/cuda/optimizer.cuh"
#include "../microgpt/cuda/residual.cuh"

#include <stdarg.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <array>
#include <string>
#include <vector>

typedef std::vector<float> Vec;

/* ---------------------------------------------------------------------------------------------- */
/* Random inputs (splitmix64; normals by Box-Muller) */

static uint64_t g_state;

static uint64_t next_u64(void) {
    uint64_t z = (g_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double next_uniform(void) { return ((next_u64() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

static float next_normal(void) {
    double u1 = next_uniform(), u2 = next_uniform();
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static Vec randn(size_t n, float scale, float offset = 0.0f) {
    Vec v(n);
    for (size_t i = 0; i < n; i++) v[i] = offset + scale * next_normal();
    return v;
}

static std::vector<int> rand_ints(size_t n, int hi) {
    std::vector<int> v(n);
    for (size_t i = 0; i < n; i++) v[i] = (int)(next_u64() % (uint64_t)hi);
    return v;
}

/* The values a T buffer would hold. */
template <typename T> static Vec rounded(Vec v) {
    for (float& x : v) x = to_f(from_f<T>(x));
    return v;
}

static double rms(const Vec& v) {
    double s = 0.0;
    for (float x : v) s += (double)x * x;
    return v.empty() ? 0.0 : sqrt(s / v.size());
}

/* Random prefill for an accumulating output, at the scale of its expected increment. */
template <typename T> static Vec prefill_like(const Vec& incr) {
    double s = rms(incr);
    return rounded<T>(randn(incr.size(), (float)(s > 0 ? s : 1.0)));
}

static Vec plus(const Vec& a, const Vec& b) {
    Vec r(a.size());
    for (size_t i = 0; i < a.size(); i++) r[i] = (float)((double)a[i] + b[i]);
    return r;
}

/* ---------------------------------------------------------------------------------------------- */
/* Device buffers: every allocation of a test is freed at its end */

/* The two ways a backward writes parameter gradients: grad_beta 0 overwrites, 1 adds. */
static const float GRAD_BETAS[2] = {0.0f, 1.0f};

static std::vector<void*> g_allocs;

static void* dalloc(size_t bytes) {
    void* p = NULL;
    CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1));
    g_allocs.push_back(p);
    return p;
}

static void dfree_all(void) {
    for (void* p : g_allocs) CUDA_CHECK(cudaFree(p));
    g_allocs.clear();
}

/* n elements of p set to NaN (all-ones bytes are a NaN in fp32, bf16 and fp16) */
template <typename T> static void poison(T* p, size_t n) { CUDA_CHECK(cudaMemset(p, 0xFF, n * sizeof(T))); }

template <typename T> static T* poisoned(size_t n) {
    T* p = (T*)dalloc(n * sizeof(T));
    poison(p, n);
    return p;
}

template <typename T> static T* upload(const Vec& v) {
    std::vector<T> h(v.size());
    for (size_t i = 0; i < v.size(); i++) h[i] = from_f<T>(v[i]);
    T* p = (T*)dalloc(v.size() * sizeof(T));
    CUDA_CHECK(cudaMemcpy(p, h.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
}

template <typename T> static void upload_into(T* p, const Vec& v) {
    std::vector<T> h(v.size());
    for (size_t i = 0; i < v.size(); i++) h[i] = from_f<T>(v[i]);
    CUDA_CHECK(cudaMemcpy(p, h.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
}

static int* upload_ints(const std::vector<int>& v) {
    int* p = (int*)dalloc(v.size() * sizeof(int));
    CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(int), cudaMemcpyHostToDevice));
    return p;
}

template <typename T> static Vec download(const T* p, size_t n) {
    std::vector<T> h(n);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    Vec v(n);
    for (size_t i = 0; i < n; i++) v[i] = to_f(h[i]);
    return v;
}

/* ---------------------------------------------------------------------------------------------- */
/* Checks */

/* Relative tolerances: elem (element-wise kernels), prod (one product or row reduction), fused
 * (several products in a row), loss (the mean loss of loss_fwd). In 16-bit types the loss is taken
 * from logits rounded to T: each row's loss carries up to half an ulp of its target logit
 * (2^-9 relative in bf16, 2^-11 in fp16) of logits of size ~3 here, so the mean over >= 5 rows is
 * within about 1e-3 (bf16) / 2.5e-4 (fp16) of the exact one. Measured on the H200 over 69 checks
 * each (14 runs with fresh seeds, 2026-11-29): at most 3.0e-4 (bf16) and 7e-5 (fp16). */
struct Tol {
    double elem, prod, fused, loss;
};
template <typename T> static Tol tol_for(void);
template <> Tol tol_for<float>(void) { return {5e-6, 2e-5, 5e-5, 2e-5}; }
template <> Tol tol_for<bf16>(void) { return {1e-2, 2e-2, 3e-2, 3e-3}; }
template <> Tol tol_for<fp16>(void) { return {2e-3, 5e-3, 1e-2, 1e-3}; }

static int g_checks = 0, g_failed = 0;
static std::string g_ctx; /* "bf16 attn B=2 T=37 C=48 H=4" */

static bool report(bool ok, const char* what, const char* fmt, ...) {
    char detail[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    printf("%s  %-44s %-8s %s\n", ok ? "PASS" : "FAIL", g_ctx.c_str(), what, detail);
    fflush(stdout);
    g_checks++;
    if (!ok) g_failed++;
    return ok;
}

/* ||gpu - cpu|| / ||cpu - base|| (base: the prefill of an accumulating output, or none) */
static bool check(const char* what, const Vec& gpu, const Vec& cpu, double tol, const Vec* base = NULL) {
    double num = 0.0, den = 0.0;
    size_t bad = 0;
    if (gpu.size() != cpu.size()) {
        return report(false, what, "size mismatch: gpu %zu, cpu %zu", gpu.size(), cpu.size());
    }
    for (size_t i = 0; i < gpu.size(); i++) {
        if (!isfinite(gpu[i])) {
            bad++;
            continue;
        }
        double d = (double)gpu[i] - cpu[i], r = (double)cpu[i] - (base ? (*base)[i] : 0.0);
        num += d * d;
        den += r * r;
    }
    if (bad) return report(false, what, "%zu of %zu elements unwritten or non-finite", bad, gpu.size());
    double err = den > 0 ? sqrt(num / den) : sqrt(num);
    return report(err <= tol, what, "rel_err %.2e  tol %.0e", err, tol);
}

/* A parameter gradient's device buffer before a backward with grad_beta gb: poisoned (gb 0, it
 * must be overwritten) or the prefill (gb 1, it must be added into). */
template <typename T> static void init_grad(T* d, const Vec& prefill, float gb) {
    if (gb != 0.0f) upload_into(d, prefill);
    else poison(d, prefill.size());
}
/* ... and its check: "name=" against the increment, or "name+=" against prefill + increment. */
static bool check_grad(const char* name, const Vec& gpu, const Vec& inc, const Vec& prefill, float gb, double tol) {
    std::string label = std::string(name) + (gb != 0.0f ? "+=" : "=");
    if (gb != 0.0f) return check(label.c_str(), gpu, plus(prefill, inc), tol, &prefill);
    return check(label.c_str(), gpu, inc, tol);
}

static bool check_scalar(const char* what, double gpu, double cpu, double tol) {
    double err = fabs(gpu - cpu) / (fabs(cpu) > 0 ? fabs(cpu) : 1.0);
    if (!isfinite(gpu)) return report(false, what, "non-finite %g (cpu %g)", gpu, cpu);
    return report(err <= tol, what, "rel_err %.2e  tol %.0e", err, tol);
}

/* Two launches from the same state must give the same bits. */
static bool check_same(const char* what, const std::vector<Vec>& a, const std::vector<Vec>& b) {
    bool same = a.size() == b.size();
    for (size_t i = 0; same && i < a.size(); i++)
        same = a[i].size() == b[i].size() && memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) == 0;
    return report(same, what, same ? "bitwise identical on relaunch" : "DIFFERENT bits on relaunch");
}

static void set_ctx(const char* prec, const char* test, const char* shape) {
    g_ctx = std::string(prec) + " " + test + " " + shape;
}

/* ---------------------------------------------------------------------------------------------- */
/* Shapes: odd sequence lengths and row counts (not multiples of 4 or of any tile), head sizes
 * from 1 to 32, padded and unpadded vocabularies. */

struct Shape {
    int B, T, C, H, F, V, Vp, chunk; /* chunk: logits rows per loss_fwd call */
};

static const Shape SHAPES[] = {
    {2, 37, 48, 4, 192, 97, 128, 16},
    {3, 64, 64, 2, 100, 50, 64, 64},
    {1, 5, 8, 8, 32, 7, 7, 5},
    {4, 33, 96, 3, 384, 300, 320, 50},
    {2, 9, 20, 5, 36, 11, 13, 7}, /* rows of no whole 16-byte packets: the element-by-element kernels */
    {2, 128, 128, 2, 512, 300, 320, 64}, /* whole 128-row tiles: Hopper's GELU-backward product (mlp.cuh) */
};

/* Extra attention-only shapes: in bf16/fp16, head sizes 16, 32 and 64 take the flash kernels
 * (SHAPES covers 32), and T here spans several 64-row tiles with a partial last one (filled from
 * 2 to 44 rows, so also past half a tile: blocks of other sizes, bench/attn-variants.sh) or whole
 * tiles only (T = 256). */
static const Shape ATTN_SHAPES[] = {
    {2, 130, 128, 2, 0, 0, 0, 0},
    {1, 256, 128, 2, 0, 0, 0, 0},
    {1, 77, 64, 4, 0, 0, 0, 0},
    {1, 300, 64, 1, 0, 0, 0, 0},
    {1, 200, 96, 3, 0, 0, 0, 0},
};

static std::string shape_str(const Shape& s) {
    char b[96];
    snprintf(b, sizeof b, "B=%d T=%d C=%d H=%d F=%d V=%d/%d", s.B, s.T, s.C, s.H, s.F, s.V, s.Vp);
    return b;
}

/* ---------------------------------------------------------------------------------------------- */
/* The tests. Each draws its inputs, computes the CPU reference, runs the GPU pair, compares. */

/* dwte0 plus the token rows' sums added exactly as k_embed_bwd_chunks and k_embed_bwd_join add them
 * (embed.cuh): the (token, position) entries in the stable sort's order cut into chunks of
 * EMBED_CHUNK; per token, each piece of its run a chunk holds summed from 0 in order, the pieces'
 * sums added in chunk order into one total, which is added to the row. */
static Vec embed_dwte_in_kernel_order(const Vec& dwte0, const Vec& dout, const std::vector<int>& tokens, int C) {
    Vec out = dwte0;
    std::vector<std::vector<int>> positions(dwte0.size() / C);
    for (size_t n = 0; n < tokens.size(); n++) positions[tokens[n]].push_back((int)n);
    size_t entry = 0; /* the sorted index of the token's first position */
    for (size_t tok = 0; tok < positions.size(); tok++) {
        const std::vector<int>& ps = positions[tok];
        for (int c = 0; c < C && !ps.empty(); c++) {
            float total = 0.0f, piece = 0.0f;
            bool first = true;
            for (size_t j = 0; j < ps.size(); j++) {
                piece += dout[(size_t)ps[j] * C + c];
                if (j + 1 == ps.size() || (entry + j + 1) % EMBED_CHUNK == 0) { /* the piece ends */
                    total = first ? piece : total + piece;
                    first = false;
                    piece = 0.0f;
                }
            }
            out[tok * C + c] += total;
        }
        entry += ps.size();
    }
    return out;
}

/* tokens from the first token_range of the vocabulary (by default a quarter: many repeats, so dwte
 * rows sum several positions; 1: one token everywhere) */
template <typename T> static void test_embed(const Shape& s, Tol tol, int token_range = 0) {
    int N = s.B * s.T, C = s.C;
    std::vector<int> tokens = rand_ints(N, token_range > 0 ? token_range : s.V / 4 > 1 ? s.V / 4 : 2);
    Vec wte = randn((size_t)s.Vp * C, 0.5f), wpe = randn((size_t)s.T * C, 0.5f);
    Vec out_c((size_t)N * C);
    embed_forward(out_c.data(), tokens.data(), wte.data(), wpe.data(), s.B, s.T, C);
    int* d_tok = upload_ints(tokens);
    float *d_wte = upload<float>(wte), *d_wpe = upload<float>(wpe);
    T* d_out = poisoned<T>((size_t)N * C);
    embed_fwd<T>(d_out, d_tok, d_wte, d_wpe, s.B, s.T, C);
    check("out", download(d_out, (size_t)N * C), out_c, tol.elem);

    Vec dout = rounded<T>(randn((size_t)N * C, 1.0f));
    Vec dwte_inc(wte.size(), 0.0f), dwpe_inc(wpe.size(), 0.0f);
    embed_backward(dwte_inc.data(), dwpe_inc.data(), dout.data(), tokens.data(), s.B, s.T, C);
    Vec dwte0 = prefill_like<float>(dwte_inc), dwpe0 = prefill_like<float>(dwpe_inc);
    T* d_dout = upload<T>(dout);
    float *d_dwte = upload<float>(dwte0), *d_dwpe = upload<float>(dwpe0);
    int* d_scratch = poisoned<int>(ceil_div(embed_bwd_scratch_bytes(s.V, N, C), sizeof(int)));
    for (float gb : GRAD_BETAS) { /* dwte always adds (the classifier wrote it first); dwpe by gb */
        auto gpu = [&]() {
            upload_into(d_dwte, dwte0);
            init_grad(d_dwpe, dwpe0, gb);
            embed_bwd<T>(d_dwte, d_dwpe, d_dout, d_tok, d_scratch, s.V, s.B, s.T, C, gb);
            return std::vector<Vec>{download(d_dwte, wte.size()), download(d_dwpe, wpe.size())};
        };
        std::vector<Vec> r1 = gpu(), r2 = gpu();
        check("dwte", r1[0], plus(dwte0, dwte_inc), tol.prod, &dwte0);
        bool ordered = !memcmp(r1[0].data(), embed_dwte_in_kernel_order(dwte0, dout, tokens, C).data(),
                               r1[0].size() * sizeof(float));
        report(ordered, "dwte_ord", ordered ? "the bits of its fixed summation order" : "DIFFERENT bits from its order");
        check_grad("dwpe", r1[1], dwpe_inc, dwpe0, gb, tol.prod);
        check_same("determ", r1, r2);
    }
    dfree_all();
}

/* A zeroed amax for a kernel with precision fp8's amax fused (common.cuh's block_amax_commit). */
static unsigned* amax_slot(void) {
    unsigned* p = (unsigned*)dalloc(sizeof(unsigned));
    CUDA_CHECK(cudaMemset(p, 0, sizeof(unsigned)));
    return p;
}

/* The fused amax must be the standalone one's bits: cpu/fp8.h's fp8_amax of the values the kernel
 * stored (downloaded: exactly the stored values). */
static void check_amax(const char* what, const unsigned* d_amax, const Vec& stored) {
    unsigned got = 0, want = fp8_float_bits(fp8_amax(stored.data(), stored.size()));
    CUDA_CHECK(cudaMemcpy(&got, d_amax, sizeof got, cudaMemcpyDeviceToHost));
    report(got == want, what, "0x%08x, cpu 0x%08x", got, want);
}

template <typename T> static void test_layernorm(const Shape& s, Tol tol) {
    /* more rows than LN_REGS_CHUNKS and LN_MAX_CHUNKS in the larger shapes, so chunks hold several
     * rows (and some warps none). The GPU sums dgamma/dbeta in chunks of rows, then the chunks'
     * partials in groups (layernorm.cuh), not row after row as the CPU does: a different
     * summation order only, which is what the product/reduction tolerance allows for. Rows up to
     * LN_SLAB_COLS take the register kernel where a lane holds them, wider ones the slab kernel
     * (run_precision's shapes cover both). */
    int N = s.B * s.T * 4 + 1, C = s.C;
    Vec x = rounded<T>(randn((size_t)N * C, 1.0f, 0.3f));
    Vec gamma = randn(C, 0.2f, 1.0f), beta = randn(C, 0.2f);
    Vec out_c((size_t)N * C), mean_c(N), rstd_c(N);
    layernorm_forward(out_c.data(), mean_c.data(), rstd_c.data(), x.data(), gamma.data(), beta.data(), N, C);
    T* d_x = upload<T>(x);
    float *d_gamma = upload<float>(gamma), *d_beta = upload<float>(beta);
    T* d_out = poisoned<T>((size_t)N * C);
    float *d_mean = poisoned<float>(N), *d_rstd = poisoned<float>(N);
    unsigned* d_amax = amax_slot(); /* the forward with precision fp8's amax fused */
    layernorm_fwd<T>(d_out, d_mean, d_rstd, d_x, d_gamma, d_beta, N, C, d_amax);
    Vec out_g = download(d_out, (size_t)N * C);
    check("out", out_g, out_c, tol.prod);
    check_amax("amax", d_amax, out_g);
    check("mean", download(d_mean, N), mean_c, tol_for<float>().prod);
    check("rstd", download(d_rstd, N), rstd_c, tol_for<float>().prod);

    Vec dout = rounded<T>(randn((size_t)N * C, 1.0f));
    Vec dx_inc((size_t)N * C, 0.0f), dg_inc(C, 0.0f), db_inc(C, 0.0f);
    layernorm_backward(dx_inc.data(), dg_inc.data(), db_inc.data(), dout.data(), x.data(), gamma.data(), mean_c.data(),
                       rstd_c.data(), N, C);
    Vec dx0 = prefill_like<T>(dx_inc), dg0 = prefill_like<float>(dg_inc), db0 = prefill_like<float>(db_inc);
    T* d_dout = upload<T>(dout);
    float *d_mean_c = upload<float>(mean_c), *d_rstd_c = upload<float>(rstd_c); /* backward alone: CPU statistics */
    T* d_dx = upload<T>(dx0);
    float *d_dg = upload<float>(dg0), *d_db = upload<float>(db0);
    float* d_scratch = poisoned<float>(layernorm_scratch_floats(C));
    for (float gb : GRAD_BETAS) { /* dx always adds (the residual stream); dgamma, dbeta by gb */
        auto gpu = [&](unsigned* amax) {
            upload_into(d_dx, dx0);
            init_grad(d_dg, dg0, gb);
            init_grad(d_db, db0, gb);
            layernorm_bwd<T>(d_dx, d_dg, d_db, d_dout, d_x, d_gamma, d_mean_c, d_rstd_c, N, C, d_scratch, gb, amax);
            return std::vector<Vec>{download(d_dx, (size_t)N * C), download(d_dg, C), download(d_db, C)};
        };
        unsigned* d_dx_amax = amax_slot(); /* the first run with the amax fused, the second without */
        std::vector<Vec> r1 = gpu(d_dx_amax), r2 = gpu(NULL);
        check("dx", r1[0], plus(dx0, dx_inc), tol.prod, &dx0);
        check_amax("dx amax", d_dx_amax, r1[0]);
        check_grad("dgamma", r1[1], dg_inc, dg0, gb, tol.prod);
        check_grad("dbeta", r1[2], db_inc, db0, gb, tol.prod);
        check_same("determ", r1, r2);
    }
    dfree_all();
}

/* The output projection with the residual join after it: out = res + x @ W_O. */
template <typename T> static void test_attn_out(const Shape& s, Tol tol) {
    int N = s.B * s.T, C = s.C;
    Vec x = rounded<T>(randn((size_t)N * C, 1.0f)), w = rounded<T>(randn((size_t)C * C, 1.0f / sqrtf((float)C)));
    Vec res = rounded<T>(randn((size_t)N * C, 1.0f)), proj((size_t)N * C), out_c((size_t)N * C);
    matmul_forward(proj.data(), x.data(), w.data(), N, C, C);
    residual_forward(out_c.data(), res.data(), proj.data(), N * C);
    T *d_x = upload<T>(x), *d_w = upload<T>(w), *d_res = upload<T>(res), *d_out = poisoned<T>((size_t)N * C);
    attn_out_fwd<T>(d_out, d_x, d_w, d_res, N, C);
    check("out", download(d_out, (size_t)N * C), out_c, tol.prod);

    Vec dout = rounded<T>(randn((size_t)N * C, 1.0f));
    Vec dx_inc((size_t)N * C, 0.0f), dw_inc((size_t)C * C, 0.0f);
    matmul_backward(dx_inc.data(), dw_inc.data(), dout.data(), x.data(), w.data(), N, C, C);
    Vec dw0 = prefill_like<float>(dw_inc);
    T *d_dout = upload<T>(dout), *d_dx = poisoned<T>((size_t)N * C); /* dx is overwritten */
    float* d_dw = upload<float>(dw0);
    for (float gb : GRAD_BETAS) {
        poison(d_dx, (size_t)N * C);
        init_grad(d_dw, dw0, gb);
        attn_out_bwd<T>(d_dx, d_dw, d_dout, d_x, d_w, N, C, gb);
        check("dx", download(d_dx, (size_t)N * C), dx_inc, tol.prod);
        check_grad("dw", download(d_dw, (size_t)C * C), dw_inc, dw0, gb, tol.prod);
    }
    dfree_all();
}

template <typename T> static void test_attn_qkv(const Shape& s, Tol tol) {
    int N = s.B * s.T, C = s.C;
    size_t nc = (size_t)N * C, cc = (size_t)C * C;
    Vec x = rounded<T>(randn(nc, 1.0f)), w = rounded<T>(randn(3 * cc, 1.0f / sqrtf((float)C)));
    Vec qkv_c(3 * nc);
    for (int i = 0; i < 3; i++) matmul_forward(qkv_c.data() + i * nc, x.data(), w.data() + i * cc, N, C, C);
    T *d_x = upload<T>(x), *d_w = upload<T>(w), *d_qkv = poisoned<T>(3 * nc);
    attn_qkv_fwd<T>(d_qkv, d_x, d_w, N, C);
    check("qkv", download(d_qkv, 3 * nc), qkv_c, tol.prod);

    Vec dqkv = rounded<T>(randn(3 * nc, 1.0f));
    Vec dx_inc(nc, 0.0f), dw_inc(3 * cc, 0.0f);
    for (int i = 0; i < 3; i++)
        matmul_backward(dx_inc.data(), dw_inc.data() + i * cc, dqkv.data() + i * nc, x.data(), w.data() + i * cc, N, C, C);
    Vec dw0 = prefill_like<float>(dw_inc);
    T *d_dqkv = upload<T>(dqkv), *d_dx = poisoned<T>(nc); /* dx is overwritten */
    float* d_dw = upload<float>(dw0);
    for (float gb : GRAD_BETAS) {
        poison(d_dx, nc);
        init_grad(d_dw, dw0, gb);
        attn_qkv_bwd<T>(d_dx, d_dw, d_dqkv, d_x, d_w, N, C, gb);
        check("dx", download(d_dx, nc), dx_inc, tol.prod);
        check_grad("dw", download(d_dw, 3 * cc), dw_inc, dw0, gb, tol.prod);
    }
    dfree_all();
}

/* Attention's scratch for either path (attn_fwd, attn_bwd), poisoned. */
template <typename T> static AttnScratch<T> attn_scratch_poisoned(int B, int Tn, int C, int H) {
    bool half = sizeof(T) == 2;
    size_t tt = attn_scratch_elems(half, B, Tn, C, H);
    AttnScratch<T> sc;
    sc.S = poisoned<float>(tt);
    sc.dP = poisoned<float>(tt);
    sc.P = poisoned<T>(tt);
    sc.delta = poisoned<float>(attn_delta_elems(half, B, Tn, C, H));
    sc.ds = poisoned<T>(attn_ds_elems(half, B, Tn, C, H));
    return sc;
}

/* ramp > 0: key j's row scaled by 1 + ramp * j / T, so the scores grow along the keys and the
 * flash kernels' running max keeps moving from key tile to key tile (with ramp 0 it settles after
 * the first), which exercises their rescaling paths. */
template <typename T> static void test_attn(const Shape& s, Tol tol, float ramp = 0.0f) {
    int B = s.B, Tn = s.T, C = s.C, H = s.H, hs = C / H, N = B * Tn;
    size_t nc = (size_t)N * C;
    Vec q = rounded<T>(randn(nc, 1.0f)), k = randn(nc, 1.0f), v = rounded<T>(randn(nc, 1.0f));
    if (ramp > 0.0f)
        for (int n = 0; n < N; n++)
            for (int c = 0; c < C; c++) k[(size_t)n * C + c] *= 1.0f + ramp * (float)(n % Tn) / (float)Tn;
    k = rounded<T>(k);
    Vec out_c(nc), att((size_t)B * H * Tn * Tn);
    attention_forward(out_c.data(), att.data(), q.data(), k.data(), v.data(), B, Tn, C, H);
    /* reference log-sum-exp of each score row, in double */
    Vec lse_c((size_t)B * H * Tn);
    double scale = 1.0 / sqrt((double)hs);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < Tn; i++) {
                std::vector<double> sc(i + 1);
                double mx = -1e300, sum = 0.0;
                for (int j = 0; j <= i; j++) {
                    double d = 0.0;
                    for (int c = 0; c < hs; c++)
                        d += (double)q[((size_t)b * Tn + i) * C + h * hs + c] * k[((size_t)b * Tn + j) * C + h * hs + c];
                    sc[j] = d * scale;
                    if (sc[j] > mx) mx = sc[j];
                }
                for (int j = 0; j <= i; j++) sum += exp(sc[j] - mx);
                lse_c[((size_t)b * H + h) * Tn + i] = (float)(mx + log(sum));
            }
    T *d_q = upload<T>(q), *d_k = upload<T>(k), *d_v = upload<T>(v), *d_out = poisoned<T>(nc);
    float* d_lse = poisoned<float>((size_t)B * H * Tn);
    AttnScratch<T> sc = attn_scratch_poisoned<T>(B, Tn, C, H);
    attn_fwd<T>(d_out, d_lse, d_q, d_k, d_v, B, Tn, C, H, sc);
    Vec out_g = download(d_out, nc);
    check("out", out_g, out_c, tol.fused);
    check("lse", download(d_lse, (size_t)B * H * Tn), lse_c, tol_for<float>().prod);
    /* precision fp8's amax fused (flash path; the cuBLAS path says it did not): the same outputs, and
     * the amax of them as stored */
    T* d_out_amax = poisoned<T>(nc);
    unsigned* d_amax = amax_slot();
    if (attn_fwd<T>(d_out_amax, d_lse, d_q, d_k, d_v, B, Tn, C, H, sc, d_amax)) {
        check_same("out+amax", {out_g}, {download(d_out_amax, nc)});
        check_amax("amax", d_amax, out_g);
    }

    Vec dout = rounded<T>(randn(nc, 1.0f));
    Vec dq_inc(nc, 0.0f), dk_inc(nc, 0.0f), dv_inc(nc, 0.0f);
    attention_backward(dq_inc.data(), dk_inc.data(), dv_inc.data(), dout.data(), att.data(), q.data(), k.data(), v.data(),
                       B, Tn, C, H);
    /* dq, dk, dv are overwritten: poisoned before each launch */
    T *d_dout = upload<T>(dout), *d_dq = poisoned<T>(nc), *d_dk = poisoned<T>(nc), *d_dv = poisoned<T>(nc);
    bool fused = false;
    auto gpu = [&](unsigned* amax) {
        poison(d_dq, nc);
        poison(d_dk, nc);
        poison(d_dv, nc);
        fused = attn_bwd<T>(d_dq, d_dk, d_dv, d_dout, d_out, d_lse, d_q, d_k, d_v, B, Tn, C, H, sc, amax);
        return std::vector<Vec>{download(d_dq, nc), download(d_dk, nc), download(d_dv, nc)};
    };
    unsigned* d_dqkv_amax = amax_slot(); /* the third run with precision fp8's amax fused */
    std::vector<Vec> r1 = gpu(NULL), r2 = gpu(NULL), r3 = gpu(d_dqkv_amax);
    check("dq", r1[0], dq_inc, tol.fused);
    check("dk", r1[1], dk_inc, tol.fused);
    check("dv", r1[2], dv_inc, tol.fused);
    check_same("determ", r1, r2);
    if (fused) { /* the same outputs, and the amax of dq, dk and dv together as stored */
        check_same("dqkv+amax", r1, r3);
        Vec dqkv = r3[0];
        dqkv.insert(dqkv.end(), r3[1].begin(), r3[1].end());
        dqkv.insert(dqkv.end(), r3[2].begin(), r3[2].end());
        check_amax("dqkv amax", d_dqkv_amax, dqkv);
    }
    dfree_all();
}

template <typename T> static void test_mlp(const Shape& s, Tol tol) {
    int N = s.B * s.T, C = s.C, F = s.F;
    size_t nc = (size_t)N * C, nf = (size_t)N * F;
    Vec x = rounded<T>(randn(nc, 1.0f));
    Vec w1 = rounded<T>(randn((size_t)C * F, 1.0f / sqrtf((float)C))), w2 = rounded<T>(randn((size_t)F * C, 1.0f / sqrtf((float)F)));
    Vec res = rounded<T>(randn(nc, 1.0f)), h_c(nf), h_gelu_c(nf), mlp(nc), out_c(nc);
    matmul_forward(h_c.data(), x.data(), w1.data(), N, C, F);
    gelu_forward(h_gelu_c.data(), h_c.data(), (int)nf);
    matmul_forward(mlp.data(), h_gelu_c.data(), w2.data(), N, F, C);
    residual_forward(out_c.data(), res.data(), mlp.data(), (int)nc); /* the join after the MLP */
    T *d_x = upload<T>(x), *d_w1 = upload<T>(w1), *d_w2 = upload<T>(w2), *d_res = upload<T>(res);
    T *d_out = poisoned<T>(nc), *d_h = poisoned<T>(nf), *d_h_gelu = poisoned<T>(nf), *d_dh = poisoned<T>(nf);
    mlp_fwd<T>(d_out, d_h, d_h_gelu, d_x, d_w1, d_w2, d_res, N, C, F);
    check("out", download(d_out, nc), out_c, tol.fused);
    check("h", download(d_h, nf), h_c, tol.prod);
    check("h_gelu", download(d_h_gelu, nf), h_gelu_c, tol.prod);

    Vec dout = rounded<T>(randn(nc, 1.0f));
    Vec dh_gelu(nf, 0.0f), dh(nf, 0.0f), dx_inc(nc, 0.0f), dw1_inc(w1.size(), 0.0f), dw2_inc(w2.size(), 0.0f);
    matmul_backward(dh_gelu.data(), dw2_inc.data(), dout.data(), h_gelu_c.data(), w2.data(), N, F, C);
    gelu_backward(dh.data(), h_c.data(), dh_gelu.data(), (int)nf);
    matmul_backward(dx_inc.data(), dw1_inc.data(), dh.data(), x.data(), w1.data(), N, C, F);
    Vec dw10 = prefill_like<float>(dw1_inc), dw20 = prefill_like<float>(dw2_inc);
    T *d_dout = upload<T>(dout), *d_dx = poisoned<T>(nc); /* dx is overwritten */
    float *d_dw1 = upload<float>(dw10), *d_dw2 = upload<float>(dw20);
    for (float gb : GRAD_BETAS) {
        poison(d_dx, nc);
        init_grad(d_dw1, dw10, gb);
        init_grad(d_dw2, dw20, gb);
        /* h and h_gelu are the forward's */
        mlp_bwd<T>(d_dx, d_dw1, d_dw2, d_dout, d_x, d_h, d_h_gelu, d_w1, d_w2, d_dh, N, C, F, gb);
        check("dh", download(d_dh, nf), dh, tol.fused);
        check("dx", download(d_dx, nc), dx_inc, tol.fused);
        check_grad("dw1", download(d_dw1, w1.size()), dw1_inc, dw10, gb, tol.fused);
        check_grad("dw2", download(d_dw2, w2.size()), dw2_inc, dw20, gb, tol.fused);
    }
    dfree_all();
}

/* n: B·T·F (packed when F allows) and, from the caller, B·T·F + 3 (element by element) */
template <typename T> static void test_gelu(size_t n, Tol tol) {
    Vec x = rounded<T>(randn(n, 2.0f)), out_c(n);
    gelu_forward(out_c.data(), x.data(), (int)n);
    T *d_x = upload<T>(x), *d_out = poisoned<T>(n), *d_out_amax = poisoned<T>(n);
    unsigned *d_amax = amax_slot(), *d_dx_amax = amax_slot();
    gelu_fwd<T>(d_out, d_x, n);
    gelu_fwd<T>(d_out_amax, d_x, n, d_amax); /* precision fp8's amax fused: the same outputs */
    Vec out_g = download(d_out, n);
    check("out", out_g, out_c, tol.elem);
    check_same("out+amax", {out_g}, {download(d_out_amax, n)});
    check_amax("amax", d_amax, out_g);
    Vec dout = rounded<T>(randn(n, 1.0f)), dx_c(n, 0.0f);
    gelu_backward(dx_c.data(), x.data(), dout.data(), (int)n);
    T *d_d = upload<T>(dout), *d_d_amax = upload<T>(dout);
    gelu_bwd_inplace<T>(d_d, d_x, n);
    gelu_bwd_inplace<T>(d_d_amax, d_x, n, d_dx_amax);
    Vec dx_g = download(d_d, n);
    check("dx", dx_g, dx_c, tol.elem);
    check_same("dx+amax", {dx_g}, {download(d_d_amax, n)});
    check_amax("dx amax", d_dx_amax, dx_g);
    dfree_all();
}

template <typename T> static void test_residual(const Shape& s, Tol tol) {
    size_t n = (size_t)s.B * s.T * s.C;
    Vec a = rounded<T>(randn(n, 1.0f)), b = rounded<T>(randn(n, 1.0f)), out_c(n);
    residual_forward(out_c.data(), a.data(), b.data(), (int)n);
    T *d_a = upload<T>(a), *d_b = upload<T>(b), *d_out = poisoned<T>(n);
    residual_add<T>(d_out, d_a, d_b, n);
    check("out", download(d_out, n), out_c, tol.elem);
    Vec dout = rounded<T>(randn(n, 1.0f)), da_inc(n, 0.0f), db_inc(n, 0.0f);
    residual_backward(da_inc.data(), db_inc.data(), dout.data(), (int)n);
    Vec da0 = prefill_like<T>(da_inc), db0 = prefill_like<T>(db_inc);
    T *d_dout = upload<T>(dout), *d_da = upload<T>(da0), *d_db = upload<T>(db0);
    residual_add_bwd<T>(d_da, d_db, d_dout, n);
    check("da", download(d_da, n), plus(da0, da_inc), tol.elem, &da0);
    check("db", download(d_db, n), plus(db0, db_inc), tol.elem, &db0);
    dfree_all();
}

/* The classifier the way the engine runs it: chunks of s.chunk rows, each the fused forward and
 * backward, then the mean loss on the device; and the evaluation path, which must give the same
 * row losses: bit for bit where both run the loss rows, and within LOSS_FUSED_EVAL_TOL where the
 * training took classifier_grad.cuh's backward (its lse joins the vocabulary's shares in another
 * order: fp32 sums of the same exponentials). Returns whether that backward ran. */
#define LOSS_FUSED_EVAL_TOL 1e-6
template <typename T> static bool test_loss(const Shape& s, Tol tol) {
    int N = s.B * s.T, C = s.C, V = s.V, Vp = s.Vp;
    Vec x = rounded<T>(randn((size_t)N * C, 1.0f)), wte = rounded<T>(randn((size_t)Vp * C, 0.3f));
    std::vector<int> targets = rand_ints(N, V);
    Vec probs((size_t)N * Vp);
    float loss_c = classifier_forward(probs.data(), x.data(), wte.data(), targets.data(), N, C, V, Vp);
    Vec dx_inc((size_t)N * C, 0.0f), dwte_inc(wte.size(), 0.0f);
    classifier_backward(dx_inc.data(), dwte_inc.data(), probs.data(), x.data(), wte.data(), targets.data(), N, C, V, Vp);
    Vec dwte0 = prefill_like<float>(dwte_inc);

    T *d_x = upload<T>(x), *d_wte = upload<T>(wte), *d_dx = poisoned<T>((size_t)N * C); /* dx is overwritten */
    int* d_targets = upload_ints(targets);
    float *d_losses = poisoned<float>(N), *d_lse = poisoned<float>(N), *d_dwte = upload<float>(dwte0);
    T* d_logits = poisoned<T>((size_t)s.chunk * Vp); /* as in the engine: overwritten by their gradient */
    float* d_dscale = upload<float>(Vec(1, 1.0f / N));
    float* d_mean = poisoned<float>(1);
    /* scratch whatever the shape: where the fused backward does not run, its own tests say so */
    float* d_part = poisoned<float>(classifier_grad_scratch_floats(s.chunk, C));
    long fused_before = g_classifier_grad_runs;
    for (float gb : GRAD_BETAS) { /* dwte by gb in the first chunk, added to by the later ones (the engine's order) */
        auto gpu = [&]() {
            poison(d_dx, (size_t)N * C);
            init_grad(d_dwte, dwte0, gb);
            for (int r0 = 0; r0 < N; r0 += s.chunk) {
                int n = N - r0 < s.chunk ? N - r0 : s.chunk;
                loss_fwd_bwd<T>(d_losses + r0, d_lse + r0, d_dx + (size_t)r0 * C, d_dwte, d_logits,
                                d_x + (size_t)r0 * C, d_wte, d_targets + r0, n, C, V, Vp, d_dscale,
                                r0 == 0 ? gb : 1.0f, d_part);
            }
            loss_mean(d_mean, d_losses, N);
            return std::vector<Vec>{download(d_losses, N), download(d_dx, (size_t)N * C),
                                    download(d_dwte, wte.size()), download(d_mean, 1)};
        };
        std::vector<Vec> r1 = gpu(), r2 = gpu();
        if (gb == GRAD_BETAS[0]) { /* the losses do not depend on gb: checked once */
            float* d_eval = poisoned<float>(N);
            for (int r0 = 0; r0 < N; r0 += s.chunk) {
                int n = N - r0 < s.chunk ? N - r0 : s.chunk;
                loss_fwd<T>(d_eval + r0, d_lse + r0, d_logits, d_x + (size_t)r0 * C, d_wte, d_targets + r0, n, C, V,
                            Vp);
            }
            Vec ev = download(d_eval, N);
            if (g_classifier_grad_runs > fused_before) check("eval_loss", ev, r1[0], LOSS_FUSED_EVAL_TOL);
            else {
                bool same = memcmp(ev.data(), r1[0].data(), N * sizeof(float)) == 0;
                report(same, "eval_loss",
                       same ? "evaluation row losses identical to training's" : "evaluation row losses DIFFER");
            }
            double sum = 0.0;
            size_t bad = 0;
            for (float l : r1[0]) {
                if (!isfinite(l)) bad++;
                sum += l;
            }
            if (bad) report(false, "loss", "%zu of %d row losses unwritten or non-finite", bad, N);
            else check_scalar("loss", sum / N, loss_c, tol.loss);
            check_scalar("loss_mean", r1[3][0], sum / N, 1e-6); /* the device mean of the same row losses */
            check("dx", r1[1], dx_inc, tol.fused);
        }
        check_grad("dwte", r1[2], dwte_inc, dwte0, gb, tol.fused);
        /* padded rows: never any gradient, so exactly the prefill (gb 1) or exactly zero (gb 0) */
        {
            Vec pad_gpu(r1[2].begin() + (size_t)V * C, r1[2].end()), pad0(dwte0.begin() + (size_t)V * C, dwte0.end());
            if (gb == 0.0f) pad0.assign(pad0.size(), 0.0f);
            bool same = true; /* by value: a zero may come back as -0 */
            for (size_t i = 0; i < pad0.size(); i++) same = same && pad_gpu[i] == pad0[i];
            report(same, "dwte_pad", same ? "padded rows: no gradient" : "padded rows CHANGED");
        }
        check_same("determ", r1, r2);
    }
    dfree_all();
    return g_classifier_grad_runs > fused_before;
}

/* AdamW, the weight copy, and the norm/scale kernels work on fp32 gradients whatever T is. */
/* n: odd (element by element) or a multiple of 8 (16-byte packets) */
template <typename T> static void test_adamw(size_t n, Tol tol) {
    Vec p = randn(n, 1.0f), g = randn(n, 0.1f), m = randn(n, 0.01f), v = randn(n, 0.01f);
    for (float& x : v) x = x * x;
    float lr = 1e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
    int t = 7;
    /* three runs as tensors lie in the engine's layout: decayed, not decayed, decayed; the
     * boundaries at n/3 and 2n/3 (inside packets and words when n is odd) */
    size_t runs[4] = {0, n / 3, 2 * n / 3, n};
    std::vector<unsigned> bits(adamw_decay_words(n), 0u);
    for (int r = 0; r < 3; r += 2)
        for (size_t i = runs[r]; i < runs[r + 1]; i++) bits[i / 32] |= 1u << (i % 32);
    unsigned* d_bits = (unsigned*)dalloc(bits.size() * sizeof(unsigned));
    CUDA_CHECK(cudaMemcpy(d_bits, bits.data(), bits.size() * sizeof(unsigned), cudaMemcpyHostToDevice));
    /* the CPU update, run by run */
    auto cpu_update = [&](Vec& pc, const Vec& gc, Vec& mc, Vec& vc) {
        for (int r = 0; r < 3; r++)
            adamw_update(pc.data() + runs[r], gc.data() + runs[r], mc.data() + runs[r], vc.data() + runs[r],
                         (long)(runs[r + 1] - runs[r]), lr, b1, b2, eps, r == 1 ? 0.0f : wd, t);
    };
    Vec pc = p, mc = m, vc = v;
    cpu_update(pc, g, mc, vc);
    float *d_p = upload<float>(p), *d_g = upload<float>(g), *d_m = upload<float>(m), *d_v = upload<float>(v);
    T* d_low = sizeof(T) == 4 ? (T*)NULL : poisoned<T>(n);
    /* the kernel reads the step's values and the norm from device memory */
    UpdateCtl* d_ctl = (UpdateCtl*)dalloc(sizeof(UpdateCtl));
    float* d_norm = (float*)dalloc(sizeof(float));
    auto set_ctl = [&](double unscale, float clip, int skip, float norm) {
        UpdateCtl c = update_ctl(lr, t, b1, b2, unscale, clip, skip);
        CUDA_CHECK(cudaMemcpy(d_ctl, &c, sizeof c, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(d_norm, &norm, sizeof norm, cudaMemcpyHostToDevice));
    };
    set_ctl(1.0, 0.0f, 0, 1.0f);
    adamw<T>(d_p, d_g, d_m, d_v, d_low, n, b1, b2, eps, wd, d_bits, d_ctl, d_norm);
    check("p", download(d_p, n), pc, tol_for<float>().elem);
    check("m", download(d_m, n), mc, tol_for<float>().elem);
    check("v", download(d_v, n), vc, tol_for<float>().elem);
    if (d_low) check("p_low", download(d_low, n), rounded<T>(pc), tol.elem);
    /* gradient multiplier and clipping: g * 0.25, clipped from norm 3 to 1.5 */
    {
        float u = 0.25f, norm = 3.0f, clip = 1.5f;
        Vec gs(n), pc2 = p, mc2 = m, vc2 = v;
        for (size_t i = 0; i < n; i++) gs[i] = (g[i] * u) * (float)((double)clip / norm);
        cpu_update(pc2, gs, mc2, vc2);
        upload_into(d_p, p);
        upload_into(d_m, m);
        upload_into(d_v, v);
        set_ctl(u, clip, 0, norm);
        adamw<T>(d_p, d_g, d_m, d_v, d_low, n, b1, b2, eps, wd, d_bits, d_ctl, d_norm);
        check("p_clip", download(d_p, n), pc2, tol_for<float>().elem);
        check("m_clip", download(d_m, n), mc2, tol_for<float>().elem);
        /* fp16 overflow: a non-finite norm with skip set leaves everything as it was */
        Vec p_before = download(d_p, n), m_before = download(d_m, n), v_before = download(d_v, n);
        set_ctl(1.0, 1.0f, 1, INFINITY);
        adamw<T>(d_p, d_g, d_m, d_v, d_low, n, b1, b2, eps, wd, d_bits, d_ctl, d_norm);
        std::vector<Vec> after{download(d_p, n), download(d_m, n), download(d_v, n)};
        check_same("skip", std::vector<Vec>{p_before, m_before, v_before}, after);
    }
    T* d_conv = poisoned<T>(n);
    convert<T>(d_conv, d_p, n);
    check("convert", download(d_conv, n), rounded<T>(download(d_p, n)), tol.elem);
    dfree_all();
}

/* copy_words (common.cuh), the engine's uploads and downloads: n random words from pinned host
 * memory to a poisoned device buffer and back into poisoned pinned memory, read and written by the
 * kernel through their host addresses; exact. */
static void test_copy_words(int n) {
    unsigned *src, *back, *dev;
    CUDA_CHECK(cudaMallocHost((void**)&src, n * sizeof(unsigned)));
    CUDA_CHECK(cudaMallocHost((void**)&back, n * sizeof(unsigned)));
    for (int i = 0; i < n; i++) src[i] = (unsigned)next_u64(), back[i] = 0xFFFFFFFFu;
    dev = poisoned<unsigned>(n);
    copy_words(dev, src, n * sizeof(unsigned));
    copy_words(back, dev, n * sizeof(unsigned));
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
    int bad = 0;
    for (int i = 0; i < n; i++) bad += back[i] != src[i];
    report(bad == 0, "copy_words", "%d of %d words wrong after host -> device -> host", bad, n);
    CUDA_CHECK(cudaFreeHost(src));
    CUDA_CHECK(cudaFreeHost(back));
}

/* n: odd (element by element) or a multiple of 4 (16-byte packets) */
static void test_grad_norm(size_t n) {
    Vec g = randn(n, 0.01f);
    double s = 0.0;
    for (float x : g) s += (double)x * x;
    float *d_g = upload<float>(g), *d_partial = poisoned<float>(NORM_BLOCKS), *d_norm = poisoned<float>(1);
    auto norm = [&]() {
        grad_norm_partial(d_partial, d_g, n, NULL);
        grad_norm_final(d_norm, d_partial);
        return std::vector<Vec>{download(d_norm, 1)};
    };
    std::vector<Vec> r1 = norm(), r2 = norm();
    check_scalar("norm", r1[0][0], sqrt(s), tol_for<float>().prod);
    check_same("determ", r1, r2);
    /* a single inf must make the norm non-finite (fp16 overflow detection relies on it) */
    float inf = INFINITY;
    CUDA_CHECK(cudaMemcpy(d_g + n / 2, &inf, sizeof inf, cudaMemcpyHostToDevice));
    Vec r3 = norm()[0];
    report(!isfinite(r3[0]), "inf", "norm with one inf gradient: %g", (double)r3[0]);
    /* with a device multiplier: the norm of g * 0.5, g itself untouched */
    {
        float* d_u = upload<float>(Vec(1, 0.5f));
        CUDA_CHECK(cudaMemcpy(d_g + n / 2, &g[n / 2], sizeof(float), cudaMemcpyHostToDevice));
        grad_norm_partial(d_partial, d_g, n, d_u);
        grad_norm_final(d_norm, d_partial);
        check_scalar("norm_unscaled", download(d_norm, 1)[0], 0.5 * sqrt(s), tol_for<float>().prod);
        check("norm_g_kept", download(d_g, n), g, 0.0);
    }
    /* scale */
    Vec small = randn(4099, 1.0f), scaled(small.size());
    for (size_t i = 0; i < small.size(); i++) scaled[i] = small[i] * 0.37f;
    float* d_s = upload<float>(small);
    grad_scale(d_s, small.size(), 0.37f);
    check("scale", download(d_s, small.size()), scaled, tol_for<float>().elem);
    dfree_all();
}

/* The fused products (common.cuh) must really have run in this precision, or the checks above
 * would only have seen the unfused path: every tested shape whose rows are whole multiples of 8
 * elements has a cuBLASLt kernel for each epilogue on sm_80 and later. */
/* The KV-cache decode step's kernels for s.B sequences in slots s.B-1 .. 0 of s.B + 1 (one unused),
 * at random positions < s.T: each against the CPU layer it stands for, and sequence 0 alone
 * against its row of the batch, bit for bit. */
template <typename T> static void test_decode(const Shape& s, Tol tol) {
    int n = s.B, S = s.B + 1, Tc = s.T, C = s.C, H = s.H, F = s.F, hs = C / H;
    std::vector<int> slots(n), positions = rand_ints(n, Tc), tokens = rand_ints(n, s.V);
    for (int i = 0; i < n; i++) slots[i] = n - 1 - i;
    int *d_slots = upload_ints(slots), *d_pos = upload_ints(positions), *d_tok = upload_ints(tokens);

    /* embedding */
    Vec wte = randn((size_t)s.Vp * C, 0.5f), wpe = randn((size_t)Tc * C, 0.5f), emb_c((size_t)n * C);
    for (int i = 0; i < n; i++)
        embed_forward(emb_c.data() + (size_t)i * C, &tokens[i], wte.data(), wpe.data() + (size_t)positions[i] * C, 1,
                      1, C);
    T* d_emb = poisoned<T>((size_t)n * C);
    decode_embed<T>(d_emb, d_tok, d_pos, upload<float>(wte), upload<float>(wpe), n, C);
    check("embed", download(d_emb, (size_t)n * C), emb_c, tol.elem);

    /* products: plain (three consecutive matrices), gelu, residual */
    Vec x = rounded<T>(randn((size_t)n * C, 1.0f)), w3 = rounded<T>(randn(3 * (size_t)C * F, 1.0f / sqrtf((float)C)));
    Vec res = rounded<T>(randn((size_t)n * F, 1.0f)), out_c(3 * (size_t)n * F), pre((size_t)n * F), act_c((size_t)n * F);
    for (int z = 0; z < 3; z++)
        matmul_forward(out_c.data() + (size_t)z * n * F, x.data(), w3.data() + (size_t)z * C * F, n, C, F);
    gelu_forward(act_c.data(), out_c.data(), n * F);
    Vec res_c((size_t)n * F);
    residual_forward(res_c.data(), res.data(), out_c.data(), n * F);
    T *d_x = upload<T>(x), *d_w = upload<T>(w3), *d_res = upload<T>(res), *d_out = poisoned<T>(3 * (size_t)n * F);
    decode_matmul<T>(d_out, d_x, d_w, NULL, n, C, F, DECODE_PLAIN, 3);
    Vec batched = download(d_out, 3 * (size_t)n * F);
    check("matmul", batched, out_c, tol.prod);
    /* the first m rows alone (the kernel then holds fewer rows per block) give the same bits */
    for (int m : {1, 3}) {
        if (m >= n) continue;
        decode_matmul<T>(d_out, d_x, d_w, NULL, m, C, F, DECODE_PLAIN, 3); /* out[z] is [m, F] */
        Vec alone = download(d_out, 3 * (size_t)m * F), first;
        for (int z = 0; z < 3; z++)
            first.insert(first.end(), batched.begin() + (size_t)z * n * F, batched.begin() + ((size_t)z * n + m) * F);
        check_same(m == 1 ? "matmul_1" : "matmul_3", std::vector<Vec>{alone}, std::vector<Vec>{first});
    }
    poison(d_out, 3 * (size_t)n * F);
    decode_matmul<T>(d_out, d_x, d_w, NULL, n, C, F, DECODE_PLAIN, 3);
    check_same("matmul", std::vector<Vec>{download(d_out, 3 * (size_t)n * F)}, std::vector<Vec>{batched});
    poison(d_out, (size_t)n * F);
    decode_matmul<T>(d_out, d_x, d_w, NULL, n, C, F, DECODE_GELU);
    check("gelu", download(d_out, (size_t)n * F), act_c, tol.fused);
    poison(d_out, (size_t)n * F);
    decode_matmul<T>(d_out, d_x, d_w, d_res, n, C, F, DECODE_RESIDUAL);
    check("residual", download(d_out, (size_t)n * F), res_c, tol.prod);

    /* the new keys and values into the caches, then attention over them */
    size_t cache = (size_t)S * Tc * C;
    Vec kc = rounded<T>(randn(cache, 1.0f)), vc = rounded<T>(randn(cache, 1.0f));
    Vec q = rounded<T>(randn((size_t)n * C, 1.0f)), kn = rounded<T>(randn((size_t)n * C, 1.0f)),
        vn = rounded<T>(randn((size_t)n * C, 1.0f));
    T *d_kc = upload<T>(kc), *d_vc = upload<T>(vc);
    decode_kv_append<T>(d_kc, d_vc, upload<T>(kn), upload<T>(vn), d_slots, d_pos, n, Tc, C);
    for (int i = 0; i < n; i++) {
        size_t row = ((size_t)slots[i] * Tc + positions[i]) * C;
        memcpy(kc.data() + row, kn.data() + (size_t)i * C, C * sizeof(float));
        memcpy(vc.data() + row, vn.data() + (size_t)i * C, C * sizeof(float));
    }
    check("k_append", download(d_kc, cache), kc, 0.0); /* copies: exact, and every other row untouched */
    check("v_append", download(d_vc, cache), vc, 0.0);
    Vec att_c((size_t)n * C), probs(Tc);
    float scale = (float)(1.0 / sqrt((double)hs));
    for (int i = 0; i < n; i++)
        for (int h = 0; h < H; h++) {
            size_t head = (size_t)slots[i] * Tc * C + (size_t)h * hs;
            attention_row(att_c.data() + (size_t)i * C + h * hs, probs.data(), q.data() + (size_t)i * C + h * hs,
                          kc.data() + head, vc.data() + head, positions[i], (size_t)C, hs, scale);
        }
    T *d_q = upload<T>(q), *d_att = poisoned<T>((size_t)n * C);
    float* d_scores = poisoned<float>((size_t)n * H * Tc);
    decode_attention<T>(d_att, d_scores, d_q, d_kc, d_vc, d_slots, d_pos, n, Tc, C, H);
    Vec att_batched = download(d_att, (size_t)n * C);
    check("attn", att_batched, att_c, tol.fused);
    decode_attention<T>(d_att, d_scores, d_q, d_kc, d_vc, d_slots, d_pos, 1, Tc, C, H);
    check_same("attn_1", std::vector<Vec>{download(d_att, (size_t)C)},
               std::vector<Vec>{Vec(att_batched.begin(), att_batched.begin() + C)});

    /* the tied classifier over the real vocabulary */
    Vec wte_t = rounded<T>(wte), logits_c((size_t)n * s.V);
    for (int i = 0; i < n; i++)
        for (int v = 0; v < s.V; v++)
            logits_c[(size_t)i * s.V + v] = dot_f32(x.data() + (size_t)i * C, wte_t.data() + (size_t)v * C, C);
    float* d_logits = poisoned<float>((size_t)n * s.V);
    T* d_wte = upload<T>(wte_t);
    decode_logits<T>(d_logits, d_x, d_wte, n, C, s.V);
    Vec logits_batched = download(d_logits, (size_t)n * s.V);
    check("logits", logits_batched, logits_c, tol_for<float>().prod);
    for (int m : {1, 3}) {
        if (m >= n) continue;
        decode_logits<T>(d_logits, d_x, d_wte, m, C, s.V);
        check_same(m == 1 ? "logits_1" : "logits_3", std::vector<Vec>{download(d_logits, (size_t)m * s.V)},
                   std::vector<Vec>{Vec(logits_batched.begin(), logits_batched.begin() + (size_t)m * s.V)});
    }
    dfree_all();
}

static void check_fused_taken(const long* before) {
    static const char* names[GEMM_N_FUSED] = {"residual", "gelu_aux", "dgelu"};
    for (int e = 0; e < GEMM_N_FUSED; e++) {
        long n = g_gemm_fused_runs[e] - before[e];
        report(n > 0, "fused", "%s epilogue: %ld fused products", names[e], n);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Precision fp8 (cuda/fp8.cuh against cpu/fp8.h). The casts must match the CPU emulation bit for
 * bit; the products are compared with fp32 products of the dequantised operands at a normwise
 * tolerance of 2e-3 (fp32 output) or 6e-3 (bf16 output: 2^-9 per element on top): every product
 * of two fp8 values is exact in fp32, so what remains is the accumulation (Hopper's FP8 tensor
 * cores add in reduced precision between cuBLASLt's fp32 promotions, which costs a few 1e-4 at
 * these K) and the output rounding; a layout or scale bug gives errors of order 1. */

#define FP8_ALL_INPUTS (1ull << 32)

/* Over every fp32 bit pattern: the hardware conversion (what the engine's casts use) against
 * cpu/fp8.h's fp8_from_float compiled for the device. Counts mismatches (mismatches[1]: those with
 * a NaN input); keeps the smallest mismatching pattern. */
__global__ void k_fp8_cvt_all(unsigned long long* mismatches, unsigned* first, int fmt) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < FP8_ALL_INPUTS;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float x = __uint_as_float((unsigned)i);
        if (fp8_cvt(x, fmt) != fp8_from_float(x, fmt)) {
            atomicAdd(mismatches, 1ull);
            if (isnan(x)) atomicAdd(mismatches + 1, 1ull);
            atomicMin(first, (unsigned)i);
        }
    }
}

/* Every code's value through cuda_fp8.h's conversion (to half, exact, then to float). */
__global__ void k_fp8_decode_all(float* out, int fmt) {
    int c = threadIdx.x;
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, fmt == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
    out[c] = __half2float(__half(h));
}

/* The conversion of n given inputs on the device, for the host-compiled fp8_from_float. */
__global__ void k_fp8_cvt_list(fp8* out, const float* x, size_t n, int fmt) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = fp8_cvt(x[i], fmt);
}

static const char* fp8_name(int fmt) { return fmt == FP8_E4M3 ? "e4m3" : "e5m2"; }

/* Random fp32 values of every kind: normals of many magnitudes, fp32 subnormals, values around the
 * formats' overflow and underflow thresholds and rounding midpoints, infinities, NaNs, zeros. */
static Vec fp8_awkward_inputs(size_t n) {
    Vec v(n);
    for (size_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)next_u64();
        float x;
        switch (i % 4) {
        case 0: memcpy(&x, &bits, sizeof x); break;                                    /* any pattern */
        case 1: x = ldexpf(next_normal(), (int)(next_u64() % 60) - 30); break;        /* -30..30 binades */
        case 2: x = ldexpf(1.0f + (float)(next_u64() % 64) / 64.0f, (int)(next_u64() % 36) - 20); break; /* midpoints */
        default: { uint32_t sub = bits & 0x807FFFFFu; memcpy(&x, &sub, sizeof x); } /* fp32 subnormals */
        }
        v[i] = x;
    }
    const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 448.0f, 464.0f, 464.0001f, 480.0f, 57344.0f,
                             61440.0f, 61439.99f, 65536.0f, 1e30f, -1e30f, ldexpf(1.0f, -10), ldexpf(1.0f, -17),
                             ldexpf(3.0f, -11), ldexpf(1.0f, -6), ldexpf(1.0f, -14)};
    for (size_t i = 0; i < sizeof special / sizeof *special && i < n; i++) v[i] = special[i];
    return v;
}

static void test_fp8_conversion(int fmt) {
    unsigned long long* mism = (unsigned long long*)dalloc(2 * sizeof(unsigned long long));
    unsigned* first = (unsigned*)dalloc(sizeof(unsigned));
    unsigned long long h_mism[2] = {0, 0};
    unsigned h_first = 0xFFFFFFFFu;
    CUDA_CHECK(cudaMemcpy(mism, h_mism, sizeof h_mism, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(first, &h_first, sizeof h_first, cudaMemcpyHostToDevice));
    k_fp8_cvt_all<<<4096, 256>>>(mism, first, fmt);
    LAUNCH_CHECK();
    CUDA_CHECK(cudaMemcpy(h_mism, mism, sizeof h_mism, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&h_first, first, sizeof h_first, cudaMemcpyDeviceToHost));
    {
        float x;
        unsigned char hw = 0;
        memcpy(&x, &h_first, sizeof x);
        if (h_mism[0]) { /* the first mismatch's hardware code, for the report */
            float* dx1 = (float*)dalloc(sizeof(float));
            fp8* dq1 = (fp8*)dalloc(1);
            CUDA_CHECK(cudaMemcpy(dx1, &x, sizeof x, cudaMemcpyHostToDevice));
            k_fp8_cvt_list<<<1, 1>>>(dq1, dx1, 1, fmt);
            LAUNCH_CHECK();
            CUDA_CHECK(cudaMemcpy(&hw, dq1, 1, cudaMemcpyDeviceToHost));
        }
        report(h_mism[0] == 0, "cvt_all",
               "all 2^32 fp32 inputs: %llu mismatches, %llu of them NaN inputs (first 0x%08x = %g: hardware 0x%02x, "
               "emulation 0x%02x)",
               h_mism[0], h_mism[1], h_first, (double)x, hw, fp8_from_float(x, fmt));
    }
    /* the host-compiled emulation (the CPU engine's) on awkward inputs against the hardware */
    Vec x = fp8_awkward_inputs(1 << 22);
    float* dx = (float*)dalloc(x.size() * sizeof(float));
    CUDA_CHECK(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
    fp8* dq = (fp8*)dalloc(x.size());
    k_fp8_cvt_list<<<1024, 256>>>(dq, dx, x.size(), fmt);
    LAUNCH_CHECK();
    std::vector<unsigned char> q(x.size());
    CUDA_CHECK(cudaMemcpy(q.data(), dq, q.size(), cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (size_t i = 0; i < x.size(); i++) bad += q[i] != fp8_from_float(x[i], fmt);
    report(bad == 0, "cvt_host", "%zu random inputs (specials, subnormals, midpoints): %zu mismatches", x.size(), bad);
    /* decoding: all 256 codes */
    float* dv = (float*)dalloc(256 * sizeof(float));
    k_fp8_decode_all<<<1, 256>>>(dv, fmt);
    LAUNCH_CHECK();
    Vec v(256);
    CUDA_CHECK(cudaMemcpy(v.data(), dv, 256 * sizeof(float), cudaMemcpyDeviceToHost));
    size_t bad_dec = 0, bad_trip = 0;
    for (int c = 0; c < 256; c++) {
        float mine = fp8_to_float((unsigned char)c, fmt);
        if (isnan(mine) != isnan(v[c]) || (!isnan(mine) && memcmp(&mine, &v[c], sizeof mine))) bad_dec++;
        if (!isnan(mine) && !isinf(mine) && fp8_from_float(mine, fmt) != c) bad_trip++;
    }
    report(bad_dec == 0 && bad_trip == 0, "codes", "256 codes: %zu decode mismatches, %zu round-trip failures", bad_dec,
           bad_trip);
    dfree_all();
}

/* Random input for an fp8 cast of n values of T: normal, every 97th below the fp8 range; `special`:
 * a NaN or an infinity (the scale falls back to 1). */
template <typename T> static Vec fp8_cast_input(size_t n, int fmt, int special) {
    Vec x = rounded<T>(randn(n, fmt == FP8_E4M3 ? 3.0f : 1e-3f));
    for (size_t i = 0; i < n; i += 97) x[i] = rounded<T>(Vec(1, ldexpf(x[i], -20)))[0];
    if (special == 1) x[n / 2] = NAN;
    if (special == 2) x[n / 3] = -INFINITY;
    return x;
}

/* A cast's outputs: codes (poisoned with 0xAB where no layout is written) and the scale (poisoned,
 * with the amax zeroed as fp8_zero_scales leaves it). */
struct Fp8CastOut {
    fp8 *n, *t;
    Fp8Scale* sc;
};
static Fp8CastOut fp8_cast_out(size_t n) {
    Fp8CastOut o = {(fp8*)dalloc(n), (fp8*)dalloc(n), (Fp8Scale*)dalloc(sizeof(Fp8Scale))};
    CUDA_CHECK(cudaMemset(o.n, 0xAB, n));
    CUDA_CHECK(cudaMemset(o.t, 0xAB, n));
    CUDA_CHECK(cudaMemset(o.sc, 0xFF, sizeof(Fp8Scale)));
    CUDA_CHECK(cudaMemset(&o.sc->amax_bits, 0, sizeof(unsigned)));
    return o;
}

/* The codes in the layouts asked for (`layouts`: 1 out_n, 2 out_t, 3 both; the other must stay
 * poisoned) and the scale of a cast of batch blocks [R, Cc] of x, against the CPU emulation, exactly.
 * `hist`: the cast was at that history's delayed scale (cpu/fp8.h), not at x's current one. */
static void check_fp8_cast(const Fp8CastOut& o, const Vec& x, int batch, int R, int Cc, int fmt, int layouts,
                           const Fp8History* hist = NULL) {
    size_t n = x.size(), bad_n = 0, bad_t = 0;
    std::vector<unsigned char> gn(n), gt(n);
    Fp8Scale gs;
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(gn.data(), o.n, n, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(gt.data(), o.t, n, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&gs, o.sc, sizeof gs, cudaMemcpyDeviceToHost));
    float amax = fp8_amax(x.data(), n), s = fp8_scale_for_amax(amax, fmt);
    unsigned amax_bits = fp8_float_bits(amax);
    if (hist && fp8_history_scale(hist) > 0.0f) s = fp8_history_scale(hist);
    for (int b = 0; b < batch; b++)
        for (int r = 0; r < R; r++)
            for (int c = 0; c < Cc; c++) {
                unsigned char want = fp8_from_float(x[((size_t)b * R + r) * Cc + c] * s, fmt);
                bad_n += gn[((size_t)r * batch + b) * Cc + c] != (layouts & 1 ? want : 0xAB);
                bad_t += gt[((size_t)b * Cc + c) * R + r] != (layouts & 2 ? want : 0xAB);
            }
    /* A NaN amax matches any NaN: its payload is the input's encoding (a bf16 NaN uploaded from the
     * host reads 0x7fff0000 on the GPU, the CPU's NaN is 0x7fc00000), and only "is NaN" decides the
     * scale (it falls back to 1 on both sides, checked next). */
    int amax_same = gs.amax_bits == amax_bits || ((gs.amax_bits & 0x7FFFFFFFu) > 0x7F800000u && isnan(amax));
    report(amax_same && gs.scale == s && gs.descale == 1.0f / s, "scale",
           "amax bits 0x%08x (cpu 0x%08x), scale %g (cpu %g), descale %g", gs.amax_bits, amax_bits,
           (double)gs.scale, (double)s, (double)gs.descale);
    report(bad_n == 0, "codes", "%zu of %zu differ from the CPU emulation", bad_n, n);
    report(bad_t == 0, "codes^T", "%zu of %zu differ from the CPU emulation", bad_t, n);
}

/* The standalone amax, then the cast, of batch blocks [R, Cc] of T (shapes with Cc a multiple of 8
 * and R of 16 take the packed cast). `layouts` as in check_fp8_cast. */
template <typename T> static void test_fp8_quantize(int batch, int R, int Cc, int fmt, int special, int layouts = 3) {
    size_t n = (size_t)batch * R * Cc;
    Vec x = fp8_cast_input<T>(n, fmt, special);
    T* dx = upload<T>(x);
    Fp8CastOut o = fp8_cast_out(n);
    fp8_reduce_amax(o.sc, dx, n);
    fp8_cast(layouts & 1 ? o.n : (fp8*)NULL, layouts & 2 ? o.t : (fp8*)NULL, o.sc, dx, batch, R, Cc, fmt);
    check_fp8_cast(o, x, batch, R, Cc, fmt, layouts);
    dfree_all();
}

/* Delayed scaling (docs/DESIGN.md §18): the cast of bf16 [R, C] at the scale of a history
 * (its amax still the tensor's own) for a history that is empty (current scaling), one whose scale is
 * below the current one, and one above it (the largest values saturate); then the history push after
 * a forward against cpu/fp8.h's, for histories empty, part full, full and all-zero amaxes. */
static void test_fp8_delayed(int R, int C) {
    const signed char below[3] = {5, 2, 9}, above[2] = {8, 7}; /* x ~ 3 N(0,1): current scale 2^4 or 2^5 */
    Fp8History hists[3];
    memset(hists, 0, sizeof hists);
    memcpy(hists[1].exp, below, sizeof below), hists[1].count = 3;
    memcpy(hists[2].exp, above, sizeof above), hists[2].count = 2;
    for (int i = 0; i < 3; i++) {
        Vec x = fp8_cast_input<bf16>((size_t)R * C, FP8_E4M3, 0);
        bf16* dx = upload<bf16>(x);
        Fp8History* dh = (Fp8History*)dalloc(sizeof(Fp8History));
        CUDA_CHECK(cudaMemcpy(dh, &hists[i], sizeof(Fp8History), cudaMemcpyHostToDevice));
        Fp8CastOut o = fp8_cast_out((size_t)R * C);
        fp8_reduce_amax(o.sc, dx, (size_t)R * C);
        fp8_cast(o.n, o.t, o.sc, dx, 1, R, C, FP8_E4M3, dh);
        check_fp8_cast(o, x, 1, R, C, FP8_E4M3, 3, &hists[i]);
        dfree_all();
    }
    /* the push: FP8_DELAYED_PER_LAYER histories a layer (ln1, ln2, h_gelu, att; dh, W_2's and
     * W_O's output gradients, dqkv), their amaxes at scales[l * stride + at[which]]; all of them
     * by one launch, as the engine after the backward */
    const int layers = 5, stride = 8, n = FP8_DELAYED_PER_LAYER * layers;
    const int at[8] = {0, 2, 3, 1, 7, 5, 6, 4};
    static_assert(FP8_DELAYED_PER_LAYER <= 8, "a scale for every history a layer");
    std::vector<Fp8History> h(n), want;
    std::vector<Fp8Scale> sc((size_t)layers * stride);
    Vec amax = randn(sc.size(), 100.0f);
    for (size_t i = 0; i < sc.size(); i++) amax[i] = i % 5 == 3 ? 0.0f : fabsf(amax[i]);
    for (size_t i = 0; i < sc.size(); i++) sc[i].amax_bits = fp8_float_bits(amax[i]);
    for (int i = 0; i < n; i++) {
        memset(&h[i], 0, sizeof h[i]);
        h[i].count = (i * 7) % (FP8_HISTORY_LEN + 1); /* 0 .. full */
        for (int e = 0; e < h[i].count; e++) h[i].exp[e] = (signed char)(i - e);
    }
    want = h;
    for (int i = 0; i < n; i++)
        fp8_history_push(&want[i], amax[(size_t)(i / FP8_DELAYED_PER_LAYER) * stride + at[i % FP8_DELAYED_PER_LAYER]],
                         fp8_delayed_fmt(i % FP8_DELAYED_PER_LAYER));
    Fp8History* dh = (Fp8History*)dalloc(n * sizeof(Fp8History));
    Fp8Scale* dsc = (Fp8Scale*)dalloc(sc.size() * sizeof(Fp8Scale));
    CUDA_CHECK(cudaMemcpy(dh, h.data(), n * sizeof(Fp8History), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dsc, sc.data(), sc.size() * sizeof(Fp8Scale), cudaMemcpyHostToDevice));
    Fp8DelayedScales where;
    where.scales = dsc, where.stride = stride;
    for (int w = 0; w < FP8_DELAYED_PER_LAYER; w++) where.at[w] = at[w];
    fp8_history_push_all(dh, where, layers);
    CUDA_CHECK(cudaMemcpy(h.data(), dh, n * sizeof(Fp8History), cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int i = 0; i < n; i++)
        bad += h[i].count != want[i].count || memcmp(h[i].exp, want[i].exp, (size_t)want[i].count) != 0;
    report(bad == 0, "history push", "%d of %d histories differ from cpu/fp8.h's push", bad, n);
    dfree_all();
}

/* A history of `count` exponents, on the host and (*dev) the device. */
static Fp8History fp8_history_with(const signed char* exps, int count, Fp8History** dev) {
    Fp8History h;
    memset(&h, 0, sizeof h);
    memcpy(h.exp, exps, (size_t)count), h.count = count;
    *dev = (Fp8History*)dalloc(sizeof h);
    CUDA_CHECK(cudaMemcpy(*dev, &h, sizeof h, cudaMemcpyHostToDevice));
    return h;
}

/* A fused producer's n codes (both layouts, format fmt), amax and scale (`got`) against those of
 * the unfused kernel + cast it replaces (`ref`, named `unfused`), bit for bit, at the history h's
 * scale; codes at the largest finite value where `saturates`, else none. */
static void check_fp8_fused(const Fp8CastOut& ref, const Fp8CastOut& got, size_t n, const Fp8History& h, bool saturates,
                            const char* unfused, int fmt = FP8_E4M3) {
    std::vector<unsigned char> rb(2 * n), gb(2 * n);
    Fp8Scale rs, gs;
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(rb.data(), ref.n, n, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(rb.data() + n, ref.t, n, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(gb.data(), got.n, n, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(gb.data() + n, got.t, n, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&rs, ref.sc, sizeof rs, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&gs, got.sc, sizeof gs, cudaMemcpyDeviceToHost));
    size_t bad_n = 0, bad_t = 0, sat = 0;
    for (size_t e = 0; e < n; e++) {
        bad_n += gb[e] != rb[e];
        bad_t += gb[n + e] != rb[n + e];
        sat += (rb[e] & 0x7F) == fp8_max_code(fmt);
    }
    report(bad_n == 0, "codes", "%zu of %zu differ from %s", bad_n, n, unfused);
    report(bad_t == 0, "codes^T", "%zu of %zu differ from %s", bad_t, n, unfused);
    report(rs.amax_bits == gs.amax_bits && rs.scale == gs.scale && rs.descale == gs.descale &&
               gs.scale == fp8_history_scale(&h),
           "scale", "amax 0x%08x (unfused 0x%08x), scale %g (unfused %g, history %g)", gs.amax_bits, rs.amax_bits,
           (double)gs.scale, (double)rs.scale, (double)fp8_history_scale(&h));
    report(saturates == (sat > 0), "saturation", "%zu codes at the largest finite value", sat);
}

/* Delayed scaling's fused LayerNorm (layernorm_fwd_fp8) against the unfused path it replaces,
 * layernorm_fwd with the amax fused then fp8_cast at the history's scale (itself checked against
 * cpu/fp8.h above and the CPU LayerNorm in run_prec): the codes of both layouts, mean, rstd, amax
 * and scale, bit for bit, for a history below and one above (saturating) the current scale. */
static void test_fp8_layernorm_fused(int N, int C) {
    /* outputs xhat * gamma + beta, gamma ~ N(0, 1.5^2): amax about 10 to 25, current scale 2^4 or 2^5 */
    const signed char below[2] = {3, 6}, above[1] = {7};
    size_t n = (size_t)N * C;
    for (int i = 0; i < 2; i++) {
        Fp8History* dh;
        Fp8History h = i ? fp8_history_with(above, 1, &dh) : fp8_history_with(below, 2, &dh);
        Vec x = rounded<bf16>(randn(n, 2.0f, 0.5f)), g = randn(C, 1.5f), b = randn(C, 0.1f);
        bf16* dx = upload<bf16>(x);
        float *dg = upload<float>(g), *db = upload<float>(b);
        Fp8CastOut ref = fp8_cast_out(n), got = fp8_cast_out(n);
        bf16* ln = (bf16*)dalloc(n * sizeof(bf16));
        float* stats = (float*)dalloc(4 * (size_t)N * sizeof(float)); /* mean, rstd: reference, fused */
        CUDA_CHECK(cudaMemset(stats, 0xFF, 4 * (size_t)N * sizeof(float)));
        layernorm_fwd<bf16>(ln, stats, stats + N, dx, dg, db, N, C, &ref.sc->amax_bits);
        fp8_cast(ref.n, ref.t, ref.sc, ln, 1, N, C, FP8_E4M3, dh);
        layernorm_fwd_fp8<bf16>(got.n, got.t, got.sc, dh, stats + 2 * N, stats + 3 * N, dx, dg, db, N, C);
        check_fp8_fused(ref, got, n, h, i == 1, "layernorm_fwd + fp8_cast");
        std::vector<float> st(4 * (size_t)N);
        CUDA_CHECK(cudaMemcpy(st.data(), stats, st.size() * sizeof(float), cudaMemcpyDeviceToHost));
        report(memcmp(st.data(), st.data() + 2 * N, 2 * (size_t)N * sizeof(float)) == 0, "mean, rstd",
               "differ from layernorm_fwd's");
        dfree_all();
    }
}

/* Delayed scaling's fused GELU (fp8_cast_gelu) against the unfused path it replaces, gelu_fwd with
 * the amax fused then fp8_cast at the history's scale: codes of both layouts, amax and scale, bit
 * for bit, for a history below and one above (saturating) the current scale. */
static void test_fp8_gelu_fused(int R, int Cc) {
    /* gelu of h ~ N(0, 3^2): amax about 10 to 15, current scale 2^5 */
    const signed char below[2] = {2, 4}, above[1] = {8};
    size_t n = (size_t)R * Cc;
    for (int i = 0; i < 2; i++) {
        Fp8History* dh;
        Fp8History h = i ? fp8_history_with(above, 1, &dh) : fp8_history_with(below, 2, &dh);
        Vec x = rounded<bf16>(randn(n, 3.0f));
        bf16* dx = upload<bf16>(x);
        bf16* dgelu = (bf16*)dalloc(n * sizeof(bf16));
        Fp8CastOut ref = fp8_cast_out(n), got = fp8_cast_out(n);
        gelu_fwd<bf16, FP8_GELU_TANH>(dgelu, dx, n, &ref.sc->amax_bits);
        fp8_cast(ref.n, ref.t, ref.sc, dgelu, 1, R, Cc, FP8_E4M3, dh);
        fp8_cast_gelu<bf16>(got.n, got.t, got.sc, dx, R, Cc, dh);
        check_fp8_fused(ref, got, n, h, i == 1, "gelu_fwd + fp8_cast");
        dfree_all();
    }
}

/* Delayed scaling's fused GELU backward (fp8_cast_dgelu) against the unfused path it replaces
 * (a run's first micro-batch), gelu_bwd_inplace with the amax fused then fp8_cast at the history's scale, in the gradients' format: codes of both layouts,
 * amax and scale, bit for bit, for a history below and one above (saturating) the current scale. */
static void test_fp8_dgelu_fused(int R, int Cc) {
    /* dout ~ N(0, 1e-3^2), h ~ N(0, 3^2): gelu'(h) within [-0.13, 1.13], amax of dh about 4e-3 to
     * 6e-3, current scale 2^16 (E4M3) or 2^23 (E5M2) */
    const int fmt = FP8_GRAD_FMT, cur = fmt == FP8_E4M3 ? 16 : 23;
    const signed char below[2] = {(signed char)(cur - 1), (signed char)(cur - 3)}, above[1] = {(signed char)(cur + 3)};
    size_t n = (size_t)R * Cc;
    for (int i = 0; i < 2; i++) {
        Fp8History* dh;
        Fp8History h = i ? fp8_history_with(above, 1, &dh) : fp8_history_with(below, 2, &dh);
        Vec g = rounded<bf16>(randn(n, 1e-3f)), x = rounded<bf16>(randn(n, 3.0f));
        bf16 *dg = upload<bf16>(g), *dx = upload<bf16>(x), *dref = upload<bf16>(g);
        Fp8CastOut ref = fp8_cast_out(n), got = fp8_cast_out(n);
        gelu_bwd_inplace<bf16, FP8_GELU_TANH>(dref, dx, n, &ref.sc->amax_bits);
        fp8_cast(ref.n, ref.t, ref.sc, dref, 1, R, Cc, fmt, dh);
        fp8_cast_dgelu<bf16>(got.n, got.t, got.sc, dg, dx, R, Cc, fmt, dh);
        check_fp8_fused(ref, got, n, h, i == 1, "gelu_bwd_inplace + fp8_cast", fmt);
        dfree_all();
    }
}

/* The GELU with the hardware's tanh (GELU_TANH_APPROX: precision fp8's, docs/BENCHMARKS.md #87)
 * and the accurate one. (1) A dense sweep of h over [-10, 10] in fp32: gelu and gelu' against float64 within the PTX ISA's bound on tanh.approx.f32 (relative
 * error at most 2^-11) carried through the formulas, plus fp32 rounding (which alone bounds the
 * accurate kernels here). (2) Values as they occur (bf16 h ~ N(0, 3^2), dout ~ N(0, 1e-3^2), as the
 * fused casts' checks): the E4M3 codes of the outputs at the scale of their amax, approximate
 * against accurate, must move (normwise, dequantised) by less than half of what the cast itself
 * moves the values: the margin docs/DESIGN.md §18 gives the GPU-vs-CPU fp8 tolerances, which the
 * CPU emulation's glibc tanhf then still meets. Prints the errors and the fractions of bf16 outputs
 * and codes that differ. */
static void test_gelu_fast_tanh(void) {
    const double eps = 1.0 / 2048.0, sqrt_2_pi = 0.7978845608028654, cubic = 0.044715; /* eps: 2^-11 */
    const size_t n = (size_t)1 << 21;
    Vec x(n), ones(n, 1.0f);
    for (size_t i = 0; i < n; i++) x[i] = (float)(-10.0 + 20.0 * (double)i / (double)(n - 1));
    float *dx = upload<float>(x), *out = poisoned<float>(n), *dg = upload<float>(ones);
    for (int approx = 0; approx < 2; approx++) {
        if (approx) {
            gelu_fwd<float, GELU_TANH_APPROX>(out, dx, n);
            gelu_bwd_inplace<float, GELU_TANH_APPROX>(dg, dx, n);
        } else {
            gelu_fwd<float>(out, dx, n);
            gelu_bwd_inplace<float>(dg, dx, n);
        }
        Vec g = download(out, n), d = download(dg, n);
        upload_into(dg, ones);
        double worst[2] = {0, 0}, max_abs[2] = {0, 0}, max_rel[2] = {0, 0};
        for (size_t i = 0; i < n; i++) {
            double h = x[i], t = tanh(sqrt_2_pi * (h + cubic * h * h * h));
            double k = sqrt_2_pi * (1.0 + 3.0 * cubic * h * h); /* du/dh */
            double ref[2] = {0.5 * h * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * k};
            double slack[2] = {1e-6 * (1.0 + fabs(h)), 2e-6 * (1.0 + fabs(h) * (1.0 + 3.0 * cubic * h * h))};
            double bound[2] = {slack[0] + approx * 0.5 * fabs(h) * eps * fabs(t),
                               slack[1] + approx * eps * fabs(t) * (0.5 + fabs(h) * k * (fabs(t) + eps))};
            double got[2] = {g[i], d[i]};
            for (int w = 0; w < 2; w++) {
                double e = fabs(got[w] - ref[w]);
                worst[w] = std::max(worst[w], e / bound[w]);
                max_abs[w] = std::max(max_abs[w], e);
                if (fabs(ref[w]) >= 1e-2) max_rel[w] = std::max(max_rel[w], e / fabs(ref[w]));
            }
        }
        const char* names[2][2] = {{"gelu", "gelu'"}, {"gelu~", "gelu'~"}};
        for (int w = 0; w < 2; w++)
            report(worst[w] <= 1.0, names[approx][w], "[-10,10] max abs %.2e, rel %.2e (|ref| >= 1e-2); err/bound %.3f",
                   max_abs[w], max_rel[w], worst[w]);
    }
    dfree_all();
    const size_t m = (size_t)1 << 22;
    Vec h = rounded<bf16>(randn(m, 3.0f)), dout = rounded<bf16>(randn(m, 1e-3f));
    bf16 *d_h = upload<bf16>(h), *y[2] = {poisoned<bf16>(m), poisoned<bf16>(m)};
    bf16* dh[2] = {upload<bf16>(dout), upload<bf16>(dout)};
    gelu_fwd<bf16>(y[0], d_h, m);
    gelu_fwd<bf16, GELU_TANH_APPROX>(y[1], d_h, m);
    gelu_bwd_inplace<bf16>(dh[0], d_h, m);
    gelu_bwd_inplace<bf16, GELU_TANH_APPROX>(dh[1], d_h, m);
    const char* what[2] = {"gelu~ codes", "dh~ codes"};
    for (int w = 0; w < 2; w++) {
        const int fmt = w ? FP8_GRAD_FMT : FP8_E4M3;
        Vec acc = download(w ? dh[0] : y[0], m), apx = download(w ? dh[1] : y[1], m);
        float s = fp8_scale_for_amax(fp8_amax(acc.data(), m), fmt);
        double moved = 0, noise = 0, norm = 0;
        size_t vals_differ = 0, codes_differ = 0;
        for (size_t i = 0; i < m; i++) {
            unsigned char ca = fp8_from_float(acc[i] * s, fmt), cb = fp8_from_float(apx[i] * s, fmt);
            double qa = fp8_to_float(ca, fmt) / s, qb = fp8_to_float(cb, fmt) / s;
            vals_differ += acc[i] != apx[i];
            codes_differ += ca != cb;
            moved += (qb - qa) * (qb - qa);
            noise += (qa - acc[i]) * (qa - acc[i]);
            norm += (double)acc[i] * acc[i];
        }
        double rel_moved = sqrt(moved / norm), rel_noise = sqrt(noise / norm);
        report(rel_moved <= 0.5 * rel_noise, what[w],
               "moved %.2e (cast's noise %.2e); differ: bf16 %.3f%%, codes %.3f%% (scale 2^%d)", rel_moved, rel_noise,
               100.0 * vals_differ / m, 100.0 * codes_differ / m, (int)log2f(s));
    }
    dfree_all();
}

/* Delayed scaling's fused LayerNorm backward (layernorm_bwd_fp8) of bf16 rows [N, C], adding into dx (the residual gradient) and writing or
 * adding dgamma, dbeta by grad_beta: dx, dgamma, dbeta those of the CPU layer (as test_layernorm)
 * and the bits of layernorm_bwd's, the unfused path; the codes of both layouts, amax and scale
 * those of the CPU emulation's cast (cpu/fp8.h) of that dx at the history's scale, exactly, for a
 * history below dx's current scale and one above it (saturating). Every shape the register kernel
 * takes must fit the fused one. */
static void test_fp8_layernorm_bwd_fused(int N, int C) {
    const int fmt = FP8_GRAD_FMT;
    const Tol tol = tol_for<bf16>();
    size_t n = (size_t)N * C;
    Vec x = rounded<bf16>(randn(n, 1.0f, 0.3f)), dout = rounded<bf16>(randn(n, 1.0f));
    Vec gamma = randn(C, 0.2f, 1.0f), beta = randn(C, 0.2f), ln(n), mean(N), rstd(N);
    layernorm_forward(ln.data(), mean.data(), rstd.data(), x.data(), gamma.data(), beta.data(), N, C);
    Vec dx_inc(n, 0.0f), dg_inc(C, 0.0f), db_inc(C, 0.0f);
    layernorm_backward(dx_inc.data(), dg_inc.data(), db_inc.data(), dout.data(), x.data(), gamma.data(), mean.data(),
                       rstd.data(), N, C);
    Vec dx0 = prefill_like<bf16>(dx_inc), dg0 = prefill_like<float>(dg_inc), db0 = prefill_like<float>(db_inc);
    bf16 *d_x = upload<bf16>(x), *d_dout = upload<bf16>(dout), *d_dx = upload<bf16>(dx0);
    float *d_gamma = upload<float>(gamma), *d_mean = upload<float>(mean), *d_rstd = upload<float>(rstd);
    float *d_dg = upload<float>(dg0), *d_db = upload<float>(db0), *d_scratch = poisoned<float>(layernorm_scratch_floats(C));
    bool regs = ln_bwd_regs_plan(d_dx, d_dout, d_x, d_gamma, N, C).packets > 0;
    bool fits = layernorm_bwd_fp8_fits(d_dx, d_dout, d_x, d_gamma, N, C);
    report(fits && regs, "fits", "the fused kernel takes the shape: %d, the register kernel: %d", fits, regs);
    if (!fits) {
        dfree_all();
        return;
    }
    for (float gb : GRAD_BETAS) {
        /* fp8 != NULL: the fused kernel writing the codes there at the history's scale */
        auto gpu = [&](const Fp8CastOut* fp8, const Fp8History* hist) {
            upload_into(d_dx, dx0);
            init_grad(d_dg, dg0, gb);
            init_grad(d_db, db0, gb);
            if (fp8)
                layernorm_bwd_fp8<bf16>(fp8->n, fp8->t, fp8->sc, hist, fmt, d_dx, d_dg, d_db, d_dout, d_x, d_gamma,
                                        d_mean, d_rstd, N, C, d_scratch, gb);
            else
                layernorm_bwd<bf16>(d_dx, d_dg, d_db, d_dout, d_x, d_gamma, d_mean, d_rstd, N, C, d_scratch, gb);
            return std::vector<Vec>{download(d_dx, n), download(d_dg, C), download(d_db, C)};
        };
        std::vector<Vec> plain = gpu(NULL, NULL);
        check("dx", plain[0], plus(dx0, dx_inc), tol.prod, &dx0);
        check_grad("dgamma", plain[1], dg_inc, dg0, gb, tol.prod);
        check_grad("dbeta", plain[2], db_inc, db0, gb, tol.prod);
        int cur = fp8_history_exponent(fp8_amax(plain[0].data(), n), fmt);
        const signed char below[2] = {(signed char)(cur - 1), (signed char)(cur - 3)};
        const signed char above[1] = {(signed char)(cur + 3)};
        for (int i = 0; i < 2; i++) {
            Fp8History* dh;
            Fp8History h = i ? fp8_history_with(above, 1, &dh) : fp8_history_with(below, 2, &dh);
            Fp8CastOut o = fp8_cast_out(n);
            check_same(i ? "dx, dgamma, dbeta (history above)" : "dx, dgamma, dbeta (history below)", gpu(&o, dh),
                       plain);
            check_fp8_cast(o, plain[0], 1, N, C, fmt, 3, &h);
        }
    }
    dfree_all();
}

/* History case i of the check `what` of a fused attention kernel at shape s (0: two entries below
 * the current scale of the values x, 1: one above it, saturating; on the host, and *dev the
 * device), the unfused path's cast of x (d_x: `batch` blocks [R, Cc], its amax already in ref.sc)
 * at its scale into ref, and the context of the checks that follow. */
static Fp8History fp8_unfused_at_history(int i, const char* what, const Shape& s, const Vec& x, const bf16* d_x,
                                         int batch, int R, int Cc, int fmt, const Fp8CastOut& ref, Fp8History** dev) {
    int cur = fp8_history_exponent(fp8_amax(x.data(), x.size()), fmt);
    const signed char below[2] = {(signed char)(cur - 1), (signed char)(cur - 3)};
    const signed char above[1] = {(signed char)(cur + 3)};
    Fp8History h = i ? fp8_history_with(above, 1, dev) : fp8_history_with(below, 2, dev);
    fp8_cast(ref.n, ref.t, ref.sc, d_x, batch, R, Cc, fmt, *dev);
    set_ctx("fp8", (std::string(what) + (i ? " (history above)" : " (history below)")).c_str(), shape_str(s).c_str());
    return h;
}

/* Delayed scaling's fused flash-attention backward (attn_bwd_fp8) of bf16 attention of shape s: where attn_bwd_fp8_fits (Hopper's kernels,
 * head sizes 32 and 64), its codes of dq, dk, dv as one tensor (both layouts), amax and scale
 * against the unfused path it replaces, attn_bwd with the amax fused then fp8_cast at the history's
 * scale, bit for bit, and against the CPU emulation's cast (cpu/fp8.h) of the dq, dk, dv attn_bwd
 * stored, exactly, for a history below their current scale and one above it (saturating); elsewhere
 * the engine's fallback, that unfused path, against the emulation. A path line says which kernels
 * wrote the codes: on a compute capability 9.0 GPU the fused ones at head sizes 32 and 64. */
static void test_fp8_attn_bwd_fused(const Shape& s) {
    const int fmt = FP8_GRAD_FMT;
    int B = s.B, Tn = s.T, C = s.C, H = s.H, N = B * Tn, hs = C / H;
    size_t nc = (size_t)N * C;
    bf16 *d_q = upload<bf16>(rounded<bf16>(randn(nc, 1.0f))), *d_k = upload<bf16>(rounded<bf16>(randn(nc, 1.0f)));
    bf16 *d_v = upload<bf16>(rounded<bf16>(randn(nc, 1.0f))), *d_dout = upload<bf16>(rounded<bf16>(randn(nc, 1e-2f)));
    bf16 *d_out = poisoned<bf16>(nc), *d_dqkv = poisoned<bf16>(3 * nc);
    float* d_lse = poisoned<float>((size_t)B * H * Tn);
    AttnScratch<bf16> sc = attn_scratch_poisoned<bf16>(B, Tn, C, H);
    attn_fwd<bf16>(d_out, d_lse, d_q, d_k, d_v, B, Tn, C, H, sc);
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    bool fits = attn_bwd_fp8_fits<bf16>(C, H);
    bool want = p.major == 9 && p.minor == 0 && attn_flash_ok<bf16>(C, H) && (hs == 32 || hs == 64);
    report(fits == want, "path",
           fits ? "k_attn_bwd_dkv_wgmma_fp8 + k_attn_bwd_dq_fp8 write the codes"
                : "unfused: attn_bwd, then fp8_cast at the delayed scale");
    for (int i = 0; i < 2; i++) {
        Fp8CastOut ref = fp8_cast_out(3 * nc);
        bool amax = attn_bwd<bf16>(d_dqkv, d_dqkv + nc, d_dqkv + 2 * nc, d_dout, d_out, d_lse, d_q, d_k, d_v, B, Tn, C,
                                   H, sc, &ref.sc->amax_bits);
        if (!amax) fp8_reduce_amax(ref.sc, d_dqkv, 3 * nc);
        Vec dqkv = download(d_dqkv, 3 * nc);
        Fp8History* dh;
        Fp8History h =
            fp8_unfused_at_history(i, "delayed attention backward fused", s, dqkv, d_dqkv, 3, N, C, fmt, ref, &dh);
        if (fits) {
            Fp8CastOut got = fp8_cast_out(3 * nc);
            attn_bwd_fp8<bf16>(got.n, got.t, got.sc, dh, fmt, d_dout, d_out, d_lse, d_q, d_k, d_v, B, Tn, C, H, sc);
            check_fp8_fused(ref, got, 3 * nc, h, i == 1, "attn_bwd + fp8_cast", fmt);
            check_fp8_cast(got, dqkv, 3, N, C, fmt, 3, &h);
        } else {
            check_fp8_cast(ref, dqkv, 3, N, C, fmt, 3, &h);
        }
    }
    dfree_all();
}

/* Delayed scaling's fused flash-attention forward (attn_fwd_fp8) of bf16 attention of shape s: where attn_fwd_fp8_fits (Hopper's kernel, head
 * sizes 32 and 64), its out and lse against attn_fwd's, and its codes of out (both layouts), amax
 * and scale against the unfused path it replaces, attn_fwd with the amax fused then fp8_cast at the
 * history's scale, bit for bit, and against the CPU emulation's cast (cpu/fp8.h) of the out attn_fwd
 * stored, exactly, for a history below the current scale and one above it (saturating); elsewhere
 * the engine's fallback, that unfused path, against the emulation. A path line says which kernel
 * wrote the codes: on a compute capability 9.0 GPU the fused one at head sizes 32 and 64. */
static void test_fp8_attn_fwd_fused(const Shape& s) {
    int B = s.B, Tn = s.T, C = s.C, H = s.H, N = B * Tn, hs = C / H;
    size_t nc = (size_t)N * C, n_lse = (size_t)B * H * Tn;
    bf16 *d_q = upload<bf16>(rounded<bf16>(randn(nc, 1.0f))), *d_k = upload<bf16>(rounded<bf16>(randn(nc, 1.0f)));
    bf16* d_v = upload<bf16>(rounded<bf16>(randn(nc, 1.0f)));
    bf16 *d_out = poisoned<bf16>(nc), *d_out_fused = poisoned<bf16>(nc);
    float *d_lse = poisoned<float>(n_lse), *d_lse_fused = poisoned<float>(n_lse);
    AttnScratch<bf16> sc = attn_scratch_poisoned<bf16>(B, Tn, C, H);
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    bool fits = attn_fwd_fp8_fits<bf16>(C, H);
    bool want = p.major == 9 && p.minor == 0 && attn_flash_ok<bf16>(C, H) && (hs == 32 || hs == 64);
    report(fits == want, "path",
           fits ? "k_attn_fwd_wgmma_fp8 writes the codes" : "unfused: attn_fwd, then fp8_cast at the delayed scale");
    for (int i = 0; i < 2; i++) {
        Fp8CastOut ref = fp8_cast_out(nc);
        bool amax = attn_fwd<bf16>(d_out, d_lse, d_q, d_k, d_v, B, Tn, C, H, sc, &ref.sc->amax_bits);
        if (!amax) fp8_reduce_amax(ref.sc, d_out, nc);
        Vec out = download(d_out, nc), lse = download(d_lse, n_lse);
        Fp8History* dh;
        Fp8History h =
            fp8_unfused_at_history(i, "delayed attention forward fused", s, out, d_out, 1, N, C, FP8_E4M3, ref, &dh);
        if (fits) {
            Fp8CastOut got = fp8_cast_out(nc);
            attn_fwd_fp8<bf16>(got.n, got.t, got.sc, dh, d_out_fused, d_lse_fused, d_q, d_k, d_v, B, Tn, C, H);
            check_same("out, lse", {download(d_out_fused, nc), download(d_lse_fused, n_lse)}, {out, lse});
            check_fp8_fused(ref, got, nc, h, i == 1, "attn_fwd + fp8_cast");
            check_fp8_cast(got, out, 1, N, C, FP8_E4M3, 3, &h);
        } else {
            check_fp8_cast(ref, out, 1, N, C, FP8_E4M3, 3, &h);
        }
    }
    dfree_all();
}

/* A list of casts in two launches (fp8_quantize_jobs, the engine's weights), each job checked as
 * one cast: shapes[i] = {batch, R, Cc}; all packable (the packed kernels) or not (the others). */
template <typename T> static void test_fp8_quantize_jobs(const std::vector<std::array<int, 3>>& shapes, int fmt) {
    std::vector<Fp8CastJob<T>> jobs;
    std::vector<Vec> xs;
    std::vector<Fp8CastOut> outs;
    for (const auto& sh : shapes) {
        size_t n = (size_t)sh[0] * sh[1] * sh[2];
        xs.push_back(fp8_cast_input<T>(n, fmt, 0));
        outs.push_back(fp8_cast_out(n));
        Fp8CastJob<T> j = {upload<T>(xs.back()), outs.back().n, outs.back().t, outs.back().sc, sh[0], sh[1], sh[2],
                           fmt, 0};
        jobs.push_back(j);
    }
    Fp8CastJob<T>* dev = (Fp8CastJob<T>*)dalloc(jobs.size() * sizeof(Fp8CastJob<T>));
    Fp8CastJobs<T> js = fp8_jobs_upload(jobs.data(), (int)jobs.size(), dev);
    fp8_quantize_jobs(js);
    for (size_t i = 0; i < shapes.size(); i++) check_fp8_cast(outs[i], xs[i], shapes[i][0], shapes[i][1], shapes[i][2], fmt, 3);
    report(js.packed == (shapes[0][2] % 8 == 0), "packed", "the list took the %s kernels", js.packed ? "packed" : "element-wise");
    dfree_all();
}

/* AdamW with the fp8 weights' amax folded in (adamw_amax, precision fp8's): the update bit for bit
 * adamw's, and each range's amax the bits of the standalone amax (fp8_reduce_amax, the weights'
 * amax launch's reduction) and of cpu/fp8.h's amax of the weights it stored. The ranges start and
 * end inside blocks (a block spans 256 packets) and inside packets, abut, leave gaps, hold one
 * element or only zeros, and have a weight 1000 times larger just outside them. Then a skipped
 * update (fp16's non-finite norm: weights and moments unchanged, the amax of the weights as they
 * are), the kernel on a grid of 3 blocks (the grid-stride loop the launcher takes for more than
 * 65535 x 8 blocks), and lazy_low (the engine's: p_low left to generation). n: a multiple of 8
 * (16-byte packets) or odd (element by element). */
static void test_adamw_amax(size_t n) {
    Vec p = randn(n, 1.0f), g = randn(n, 0.1f), m = randn(n, 0.01f), v = randn(n, 0.01f);
    for (float& x : v) x = x * x;
    std::vector<std::array<size_t, 2>> spans = {{n / 40 + 3, n / 7},      {n / 7, n / 7 + 5},         {n / 7 + 9, n / 7 + 10},
                                                {n / 3 + 1, 2 * n / 3 - 1}, {2 * n / 3 + 7, 2 * n / 3 + 700},
                                                {n - n / 9 - 5, n}};
    for (size_t i = spans[4][0]; i < spans[4][1]; i++) p[i] = g[i] = m[i] = v[i] = 0.0f; /* stays 0: amax 0 */
    p[spans[3][0] - 1] = p[spans[3][1]] = 1000.0f;
    float lr = 1e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
    std::vector<unsigned> bits(adamw_decay_words(n), 0x5555AAAAu);
    unsigned* d_bits = (unsigned*)dalloc(bits.size() * sizeof(unsigned));
    CUDA_CHECK(cudaMemcpy(d_bits, bits.data(), bits.size() * sizeof(unsigned), cudaMemcpyHostToDevice));
    UpdateCtl* d_ctl = (UpdateCtl*)dalloc(sizeof(UpdateCtl));
    float* d_norm = (float*)dalloc(sizeof(float));
    auto set_ctl = [&](int skip, float norm) {
        UpdateCtl c = update_ctl(lr, 7, b1, b2, 0.5, 1.0f, skip); /* the norm 2 clips */
        CUDA_CHECK(cudaMemcpy(d_ctl, &c, sizeof c, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(d_norm, &norm, sizeof norm, cudaMemcpyHostToDevice));
    };
    size_t nr = spans.size();
    Fp8Scale* d_sc = (Fp8Scale*)dalloc(2 * nr * sizeof(Fp8Scale)); /* [0, nr): fused, [nr, 2 nr): standalone */
    std::vector<AmaxRange> ranges(nr);
    for (size_t r = 0; r < nr; r++) ranges[r] = {spans[r][0], spans[r][1], &d_sc[r].amax_bits, 0};
    AmaxRange* d_ranges = (AmaxRange*)dalloc(nr * sizeof(AmaxRange));
    CUDA_CHECK(cudaMemcpy(d_ranges, ranges.data(), nr * sizeof(AmaxRange), cudaMemcpyHostToDevice));
    float *p0 = upload<float>(p), *d_g = upload<float>(g), *m0 = upload<float>(m), *v0 = upload<float>(v);
    bf16* low0 = poisoned<bf16>(n);
    float *d_p = upload<float>(p), *d_m = upload<float>(m), *d_v = upload<float>(v);
    bf16* d_low = poisoned<bf16>(n);
    /* the update's bits, each range's amax against the standalone amax and the CPU's */
    auto check_ranges = [&](const char* what) {
        Vec stored = download(d_p, n);
        bool same = true;
        for (size_t r = 0; r < nr; r++) {
            size_t lo = spans[r][0], len = spans[r][1] - lo;
            fp8_reduce_amax(d_sc + nr + r, d_p + lo, len);
            unsigned fused = 0, alone = 0, cpu = fp8_float_bits(fp8_amax(stored.data() + lo, len));
            CUDA_CHECK(cudaMemcpy(&fused, &d_sc[r].amax_bits, sizeof fused, cudaMemcpyDeviceToHost));
            CUDA_CHECK(cudaMemcpy(&alone, &d_sc[nr + r].amax_bits, sizeof alone, cudaMemcpyDeviceToHost));
            if (fused != alone || fused != cpu) {
                report(false, what, "range %zu [%zu, %zu): 0x%08x, standalone 0x%08x, cpu 0x%08x", r, lo, lo + len,
                       fused, alone, cpu);
                same = false;
            }
        }
        if (same) report(true, what, "%zu ranges: the standalone amax's bits", nr);
    };
    auto same_state = [&](const char* what, const std::vector<Vec>& want) {
        std::vector<Vec> got{download(d_p, n), download(d_m, n), download(d_v, n), download(d_low, n)};
        bool same = true;
        for (size_t k = 0; k < want.size(); k++)
            same = same && memcmp(got[k].data(), want[k].data(), n * sizeof(float)) == 0;
        report(same, what, same ? "p, m, v, p_low bitwise adamw's" : "p, m, v or p_low DIFFER from adamw's");
    };
    set_ctl(0, 2.0f);
    adamw<bf16>(p0, d_g, m0, v0, low0, n, b1, b2, eps, wd, d_bits, d_ctl, d_norm);
    std::vector<Vec> want{download(p0, n), download(m0, n), download(v0, n), download(low0, n)};
    CUDA_CHECK(cudaMemset(d_sc, 0, 2 * nr * sizeof(Fp8Scale)));
    adamw_amax<bf16>(d_p, d_g, d_m, d_v, d_low, n, b1, b2, eps, wd, d_bits, d_ctl, d_norm, d_ranges, (int)nr, 0);
    same_state("update", want);
    check_ranges("amax");
    /* skipped: the state as it was, the amax of the weights as they are */
    set_ctl(1, INFINITY);
    CUDA_CHECK(cudaMemset(d_sc, 0, 2 * nr * sizeof(Fp8Scale)));
    adamw_amax<bf16>(d_p, d_g, d_m, d_v, d_low, n, b1, b2, eps, wd, d_bits, d_ctl, d_norm, d_ranges, (int)nr, 0);
    same_state("skip", want);
    check_ranges("skip_amax");
    /* 3 blocks, each several spans of the grid-stride loop */
    upload_into(d_p, p);
    upload_into(d_m, m);
    upload_into(d_v, v);
    poison(d_low, n);
    set_ctl(0, 2.0f);
    CUDA_CHECK(cudaMemset(d_sc, 0, 2 * nr * sizeof(Fp8Scale)));
    if (packable(n, sizeof(bf16), {d_p, d_g, d_m, d_v, d_low}))
        launch_kernel(k_adamw_amax<bf16, PACK(bf16)>, 3, 256, d_p, d_g, d_m, d_v, d_low, n, b1, b2, eps, wd, d_bits,
                      d_ctl, d_norm, d_ranges, (int)nr, 0);
    else
        launch_kernel(k_adamw_amax<bf16, 1>, 3, 256, d_p, d_g, d_m, d_v, d_low, n, b1, b2, eps, wd, d_bits, d_ctl,
                      d_norm, d_ranges, (int)nr, 0);
    same_state("strided", want);
    check_ranges("strided_amax");
    /* lazy_low: p_low untouched (still poisoned) where a packet lies wholly in a range, adamw's
     * elsewhere (packets across a boundary included) and in the range marked keep_low (the
     * forward-only FP8 classifier's wte); the rest as before */
    size_t kept = 0;
    ranges[kept].keep_low = 1;
    CUDA_CHECK(cudaMemcpy(d_ranges, ranges.data(), nr * sizeof(AmaxRange), cudaMemcpyHostToDevice));
    upload_into(d_p, p);
    upload_into(d_m, m);
    upload_into(d_v, v);
    poison(d_low, n);
    Vec poison_values = download(d_low, n);
    CUDA_CHECK(cudaMemset(d_sc, 0, 2 * nr * sizeof(Fp8Scale)));
    adamw_amax<bf16>(d_p, d_g, d_m, d_v, d_low, n, b1, b2, eps, wd, d_bits, d_ctl, d_norm, d_ranges, (int)nr, 1);
    size_t vec = packable(n, sizeof(bf16), {d_p, d_g, d_m, d_v, d_low}) ? PACK(bf16) : 1, left = 0;
    std::vector<Vec> lazy_want = want;
    for (size_t e = 0; e < n; e++) {
        size_t first = e / vec * vec;
        for (size_t r = 0; r < nr; r++)
            if (r != kept && spans[r][0] <= first && first + vec <= spans[r][1]) {
                lazy_want[3][e] = poison_values[e];
                left++;
            }
    }
    same_state("lazy_low", lazy_want);
    report(left > n / 3, "lazy_left", "%zu of %zu 16-bit weights left unwritten", left, n);
    check_ranges("lazy_amax");
    dfree_all();
}

/* Random fp8 codes of n normal values of size `scale` (cast by the CPU emulation) and their values. */
static std::vector<unsigned char> fp8_random_codes(size_t n, int fmt, Vec* values) {
    std::vector<unsigned char> q(n);
    values->resize(n);
    for (size_t i = 0; i < n; i++) {
        q[i] = fp8_from_float(next_normal() * (fmt == FP8_E4M3 ? 100.0f : 5000.0f), fmt);
        (*values)[i] = fp8_to_float(q[i], fmt);
    }
    return q;
}

/* D [M,N] = da db A[M,K] Bt[N,K]^T + beta C, batched, against the fp32 product of the values, as a
 * product of pass `pass`, accumulated as fp8_fast_accum(pass) says. */
template <typename TD>
static void test_fp8_gemm(Fp8Pass pass, int M, int N, int K, int batch, int a_fmt, int b_fmt, float beta) {
    Vec av, bv;
    std::vector<unsigned char> aq = fp8_random_codes((size_t)M * K, a_fmt, &av);
    std::vector<unsigned char> bq = fp8_random_codes((size_t)batch * N * K, b_fmt, &bv);
    Fp8Scale hs[2] = {{0.125f, 8.0f, 0}, {1.0f / 1024.0f, 1024.0f, 0}}; /* descale, scale, amax bits */
    Fp8Scale* sc = (Fp8Scale*)dalloc(sizeof hs);
    CUDA_CHECK(cudaMemcpy(sc, hs, sizeof hs, cudaMemcpyHostToDevice));
    fp8* da = (fp8*)dalloc(aq.size());
    fp8* db = (fp8*)dalloc(bq.size());
    CUDA_CHECK(cudaMemcpy(da, aq.data(), aq.size(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(db, bq.data(), bq.size(), cudaMemcpyHostToDevice));
    size_t nd = (size_t)batch * M * N;
    Vec prefill = rounded<TD>(randn(nd, 1.0f));
    TD* dd = beta != 0.0f ? upload<TD>(prefill) : poisoned<TD>(nd);
    fp8_gemm<TD>(pass, M, N, K, fp8_mat(da, a_fmt, sc), fp8_mat(db, b_fmt, sc + 1, (long long)N * K), dd, NULL, beta,
                 batch, (long long)M * N);
    Vec got = download(dd, nd), want(nd);
    for (int b = 0; b < batch; b++)
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                double acc = 0.0;
                for (int k = 0; k < K; k++) acc += (double)av[(size_t)i * K + k] * bv[((size_t)b * N + j) * K + k];
                size_t o = ((size_t)b * M + i) * N + j;
                want[o] = (float)(acc * hs[0].descale * hs[1].descale + (beta != 0.0f ? prefill[o] : 0.0));
            }
    char what[64];
    snprintf(what, sizeof what, "%s x %s%s%s", fp8_name(a_fmt), fp8_name(b_fmt), beta != 0.0f ? " +=" : "",
             fp8_fast_accum(pass) ? " fast" : "");
    check(what, got, want, sizeof(TD) == 4 ? 2e-3 : 6e-3, beta != 0.0f ? &prefill : NULL);
    dfree_all();
}

/* fp8_transpose (the FP8 classifier's dlogits codes for dwte; k_fp8_transpose) of random bytes
 * [R, Cc] against the CPU's transpose, byte for byte, into an output poisoned twice (0x00, then
 * 0xFF: a byte left unwritten differs from one of them) with guard bytes after it that must stay
 * poisoned. */
static void test_fp8_transpose(int R, int Cc) {
    const size_t n = (size_t)R * Cc, guard = 256;
    std::vector<unsigned char> in(n), want(n + guard), got(n + guard);
    for (unsigned char& b : in) b = (unsigned char)(next_u64() >> 56);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < Cc; c++) want[(size_t)c * R + r] = in[(size_t)r * Cc + c];
    fp8 *d_in = (fp8*)dalloc(n), *d_out = (fp8*)dalloc(n + guard);
    CUDA_CHECK(cudaMemcpy(d_in, in.data(), n, cudaMemcpyHostToDevice));
    size_t bad = 0;
    for (int poison_byte : {0x00, 0xFF}) {
        CUDA_CHECK(cudaMemset(d_out, poison_byte, n + guard));
        fp8_transpose(d_out, d_in, R, Cc);
        CUDA_CHECK(cudaMemcpy(got.data(), d_out, n + guard, cudaMemcpyDeviceToHost));
        memset(want.data() + n, poison_byte, guard);
        for (size_t i = 0; i < n + guard; i++) bad += got[i] != want[i];
    }
    report(bad == 0, "128x128",
           "%zu of %zu bytes (two poisons, and guards) differ from the CPU transpose", bad, 2 * (n + guard));
    dfree_all();
}

/* The FP8 classifier's loss rows (LossStoreFp8, with loss_grad_lean's gradient; from shared memory
 * and from memory) and the codes' transpose
 * (k_fp8_transpose), bit for bit against the loss rows in T, then cpu/fp8.h's stochastic rounding
 * at the static scale of the bound |dscale| (fp8_dlogits_scale) with the bits of each value's row
 * (from row0 of a micro-batch) and column (fp8_fake_quantize_dlogits' order): the same row
 * losses and lse, codes in both layouts, scale; and the logits left as they were. Logits of
 * standard deviation `spread`. */
template <typename T> static void test_loss_rows_fp8_fused(int n, int V, int Vp, float spread) {
    Vec logits = rounded<T>(randn((size_t)n * Vp, spread));
    size_t nv = (size_t)n * Vp;
    float ds = 1.0f / 8192.0f * 3.0f; /* not a power of two: the bound's scale leaves headroom */
    unsigned salt = (unsigned)rand_ints(1, 1 << 30)[0] * 4u + 3u;
    int row0 = 5;
    float s = fp8_dlogits_scale(ds);
    int* d_targets = upload_ints(rand_ints(n, V));
    float* d_dscale = upload<float>(Vec(1, ds));
    unsigned* d_salt = (unsigned*)dalloc(sizeof salt);
    CUDA_CHECK(cudaMemcpy(d_salt, &salt, sizeof salt, cudaMemcpyHostToDevice));
    T* d_ref = upload<T>(logits);
    float *ref_losses = poisoned<float>(n), *ref_lse = poisoned<float>(n);
    loss_rows_from_memory<T>(ref_losses, ref_lse, d_ref, d_targets, n, V, Vp, d_dscale);
    Vec dl = download(d_ref, nv), dlq(nv);
    fp8_fake_quantize_dlogits(dlq.data(), dl.data(), n, Vp, row0, salt, FP8_DLOGITS_FMT, s);
    std::vector<unsigned char> want_n(nv), want_t(nv);
    for (int r = 0; r < n; r++)
        for (int j = 0; j < Vp; j++) {
            size_t i = (size_t)r * Vp + j;
            want_n[i] = fp8_from_float(dlq[i] * s, FP8_DLOGITS_FMT); /* exact: dlq holds code values / s */
            want_t[(size_t)j * n + r] = want_n[i];
        }
    Vec want_losses = download(ref_losses, n), want_lse = download(ref_lse, n);
    for (int shared = 0; shared < 2; shared++) {
        Fp8CastOut got = fp8_cast_out(nv);
        T* d_logits = upload<T>(logits);
        float *losses = poisoned<float>(n), *lse = poisoned<float>(n);
        LossStoreFp8 st = {got.n, got.sc, Vp, d_salt, row0};
        bool ran = true;
        if (shared) ran = loss_rows_from_shared<T>(losses, lse, d_logits, d_targets, n, V, Vp, d_dscale, st);
        else loss_rows_from_memory<T>(losses, lse, d_logits, d_targets, n, V, Vp, d_dscale, st);
        fp8_transpose(got.t, got.n, n, Vp);
        char what[64];
        snprintf(what, sizeof what, "fused from %s", shared ? "shared" : "memory");
        if (!ran) {
            report(false, what, "the loss rows from shared memory did not run (do not fit this GPU)");
            continue;
        }
        std::vector<unsigned char> gn(nv), gt(nv);
        Fp8Scale gs;
        CUDA_CHECK(cudaMemcpy(gn.data(), got.n, nv, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(gt.data(), got.t, nv, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(&gs, got.sc, sizeof gs, cudaMemcpyDeviceToHost));
        Vec l = download(losses, n), e = download(lse, n), kept = download(d_logits, nv);
        bool same = gn == want_n && gt == want_t && gs.scale == s && gs.descale == 1.0f / s &&
                    !memcmp(l.data(), want_losses.data(), n * sizeof(float)) &&
                    !memcmp(e.data(), want_lse.data(), n * sizeof(float)) &&
                    !memcmp(kept.data(), logits.data(), nv * sizeof(float));
        report(same, what, same ? "codes (both layouts), scale, losses, lse: the bits of loss rows + the CPU's rounding"
                                : "bits DIFFER from loss rows + the CPU's rounding (or the logits were overwritten)");
    }
    dfree_all();
}

/* The FP8 classifier (cuda/fp8.cuh), chunk by chunk as the engine runs it, for x [N, C] in T and
 * wte [Vp, C] in fp32 (the masters the weights' cast reads): the casts of x
 * (fp8_cast_classifier_input: row-major, and transposed chunk by chunk) exactly against
 * cpu/fp8.h's; each chunk's dlogits codes read back: the static scale, their transpose exactly (the
 * codes themselves: "loss rows fp8 fused"); dx and dwte against the fp32 products of
 * the codes' values (tolerances of the FP8 product checks above: only the order of the fp32 sums
 * differs, and dx's rounding to T); the loss
 * against the CPU classifier on the cast x and wte (tol.loss: the logits are rounded to T);
 * evaluation's row losses identical to training's; padded rows of dwte untouched; two runs the
 * same bits. */
template <typename T> static void test_loss_fp8(int N, int C, int V, int Vp, int chunk) {
    Tol tol = tol_for<T>();
    int chunks = (N + chunk - 1) / chunk;
    Vec x = rounded<T>(randn((size_t)N * C, 1.0f)), wte = randn((size_t)Vp * C, 0.3f);
    std::vector<int> targets = rand_ints(N, V);
    Vec xq(x.size()), wq(wte.size()), probs((size_t)N * Vp);
    float xs = fp8_fake_quantize(xq.data(), x.data(), x.size(), FP8_E4M3);
    fp8_fake_quantize(wq.data(), wte.data(), wte.size(), FP8_E4M3);
    float loss_c = classifier_forward(probs.data(), xq.data(), wq.data(), targets.data(), N, C, V, Vp);
    Vec dx_fp32((size_t)N * C, 0.0f), dwte_fp32(wte.size(), 0.0f); /* unquantised dlogits: sizes the prefill */
    classifier_backward(dx_fp32.data(), dwte_fp32.data(), probs.data(), xq.data(), wq.data(), targets.data(), N, C, V, Vp);
    Vec dwte0 = prefill_like<float>(dwte_fp32);

    T* d_x = upload<T>(x);
    float* d_wte = upload<float>(wte);
    int* d_targets = upload_ints(targets);
    Fp8Scale* sc = (Fp8Scale*)dalloc((2 + chunks) * sizeof(Fp8Scale)); /* x's, wte's, each chunk's dlogits' */
    fp8 *x8 = (fp8*)dalloc((size_t)N * C), *x8t = (fp8*)dalloc((size_t)N * C);
    fp8 *w8 = (fp8*)dalloc(wte.size()), *w8t = (fp8*)dalloc(wte.size());
    fp8 *g8 = (fp8*)dalloc((size_t)chunk * Vp), *g8t = (fp8*)dalloc((size_t)chunk * Vp);
    T *d_logits = poisoned<T>((size_t)chunk * Vp), *d_dx = poisoned<T>((size_t)N * C);
    float *d_dwte = upload<float>(dwte0), *d_losses = poisoned<float>(N), *d_lse = poisoned<float>(N);
    float* d_dscale = upload<float>(Vec(1, 1.0f / N));
    unsigned* d_salt = (unsigned*)dalloc(sizeof(unsigned));
    CUDA_CHECK(cudaMemset(d_salt, 0x5A, sizeof(unsigned)));
    CUDA_CHECK(cudaMemset(sc, 0, 2 * sizeof(Fp8Scale)));
    fp8_reduce_amax(&sc[0], d_x, x.size());
    fp8_cast_classifier_input(x8, x8t, &sc[0], d_x, N, C, chunk);
    fp8_reduce_amax(&sc[1], d_wte, wte.size());
    fp8_cast(w8, w8t, &sc[1], (const float*)d_wte, 1, Vp, C, FP8_E4M3);
    {   /* x's codes: row-major, and chunk r0's [C][n] at r0 * C */
        std::vector<unsigned char> gn((size_t)N * C), gt((size_t)N * C);
        CUDA_CHECK(cudaMemcpy(gn.data(), x8, gn.size(), cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(gt.data(), x8t, gt.size(), cudaMemcpyDeviceToHost));
        size_t bad = 0;
        for (int r = 0; r < N; r++) {
            int r0 = r / chunk * chunk, n = N - r0 < chunk ? N - r0 : chunk;
            for (int c = 0; c < C; c++) {
                unsigned char want = fp8_from_float(x[(size_t)r * C + c] * xs, FP8_E4M3);
                bad += (gn[(size_t)r * C + c] != want) + (gt[(size_t)r0 * C + (size_t)c * n + (r - r0)] != want);
            }
        }
        report(bad == 0, "x codes", "%zu of %d row-major and chunked transposed codes differ from the CPU emulation",
               bad, 2 * N * C);
    }
    auto ops = [&](int r0, int ch) {
        Fp8ClassifierOps c;
        c.x = fp8_mat(x8 + (size_t)r0 * C, FP8_E4M3, &sc[0]);
        c.wte = fp8_mat(w8, FP8_E4M3, &sc[1]);
        c.x_t = x8t + (size_t)r0 * C, c.wte_t = w8t, c.g = g8, c.g_t = g8t, c.g_sc = &sc[2 + ch];
        c.salt = d_salt, c.row0 = r0;
        return c;
    };
    for (float gb : GRAD_BETAS) {
        Vec dx_inc((size_t)N * C, 0.0f), dwte_inc(wte.size(), 0.0f);
        auto gpu = [&](bool emulate) {
            poison(d_dx, (size_t)N * C);
            init_grad(d_dwte, dwte0, gb);
            CUDA_CHECK(cudaMemset(&sc[2], 0, chunks * sizeof(Fp8Scale)));
            for (int r0 = 0, ch = 0; r0 < N; r0 += chunk, ch++) {
                int n = N - r0 < chunk ? N - r0 : chunk;
                loss_fwd_bwd_fp8<T>(d_losses + r0, d_lse + r0, d_dx + (size_t)r0 * C, d_dwte, d_logits, ops(r0, ch),
                                    d_targets + r0, n, C, V, Vp, d_dscale, r0 == 0 ? gb : 1.0f);
                if (!emulate) continue;
                size_t nv = (size_t)n * Vp;
                std::vector<unsigned char> gn(nv), gt(nv);
                Fp8Scale gs;
                CUDA_CHECK(cudaMemcpy(gn.data(), g8, nv, cudaMemcpyDeviceToHost));
                CUDA_CHECK(cudaMemcpy(gt.data(), g8t, nv, cudaMemcpyDeviceToHost));
                CUDA_CHECK(cudaMemcpy(&gs, &sc[2 + ch], sizeof gs, cudaMemcpyDeviceToHost));
                size_t bad = 0;
                for (int r = 0; r < n; r++)
                    for (int v = 0; v < Vp; v++) bad += gt[(size_t)v * n + r] != gn[(size_t)r * Vp + v];
                float s = fp8_dlogits_scale(1.0f / N);
                report(bad == 0 && gs.scale == s && gs.descale == 1.0f / s, "dlogits codes",
                       "%zu of %zu transposed codes differ; scale %g (static %g)", bad, nv, (double)gs.scale,
                       (double)s);
                Vec dlq(nv);
                for (size_t i = 0; i < nv; i++) dlq[i] = fp8_to_float(gn[i], FP8_DLOGITS_FMT) * gs.descale;
                classifier_backward_products(dx_inc.data() + (size_t)r0 * C, dwte_inc.data(), dlq.data(),
                                             xq.data() + (size_t)r0 * C, wq.data(), n, C, V, Vp);
            }
            return std::vector<Vec>{download(d_losses, N), download(d_dx, (size_t)N * C), download(d_dwte, wte.size())};
        };
        std::vector<Vec> r1 = gpu(true), r2 = gpu(false);
        double sum = 0.0;
        for (float l : r1[0]) sum += l;
        check_scalar("loss", sum / N, loss_c, tol.loss);
        check("dx", r1[1], dx_inc, 6e-3);
        check_grad("dwte", r1[2], dwte_inc, dwte0, gb, 2e-3);
        {   /* padded rows: exactly the prefill (gb 1) or zero (gb 0) */
            bool same = true;
            for (size_t i = (size_t)V * C; i < wte.size(); i++) same = same && r1[2][i] == (gb != 0.0f ? dwte0[i] : 0.0f);
            report(same, "dwte_pad", same ? "padded rows: no gradient" : "padded rows CHANGED");
        }
        check_same("determ", r1, r2);
        if (gb != GRAD_BETAS[0]) continue;
        float* d_eval = poisoned<float>(N);
        for (int r0 = 0, ch = 0; r0 < N; r0 += chunk, ch++)
            loss_fwd_fp8<T>(d_eval + r0, d_lse + r0, d_logits, ops(r0, ch), d_targets + r0,
                            N - r0 < chunk ? N - r0 : chunk, C, V, Vp);
        bool same = memcmp(download(d_eval, N).data(), r1[0].data(), N * sizeof(float)) == 0;
        report(same, "eval_loss", same ? "evaluation row losses identical to training's" : "evaluation row losses DIFFER");
    }
    dfree_all();
}

static void run_fp8(void) {
    char sh[96];
    for (int fmt = FP8_E4M3; fmt <= FP8_E5M2; fmt++) {
        set_ctx("fp8", "conversion", fp8_name(fmt));
        test_fp8_conversion(fmt);
        /* packed: {1, 64, 48} (one partial tile), {2, 80, 200} (partial tiles both ways), {1, 256, 1024},
         * {3, 208, 392} (the packed kernel's 64 x 128 tiles: a last tile row of 16 rows
         * and a last tile column of one packet), {1, 16, 8} (one packet of each pass);
         * element by element: {3, 37, 80}, {1, 129, 33}, {1, 96, 36} (rows fit, columns do not) */
        const int shapes[][3] = {{1, 64, 48},  {3, 37, 80},   {1, 129, 33}, {1, 256, 1024},
                                 {2, 80, 200}, {1, 96, 36},   {3, 208, 392}, {1, 16, 8}};
        for (const auto& s : shapes)
            for (int special = 0; special < 3; special++) {
                snprintf(sh, sizeof sh, "%s batch=%d R=%d C=%d%s", fp8_name(fmt), s[0], s[1], s[2],
                         special == 1 ? " NaN" : special == 2 ? " -inf" : "");
                set_ctx("fp8", "quantize bf16", sh);
                test_fp8_quantize<bf16>(s[0], s[1], s[2], fmt, special);
                if (special == 0) {
                    set_ctx("fp8", "quantize fp32", sh);
                    test_fp8_quantize<float>(s[0], s[1], s[2], fmt, 0);
                    set_ctx("fp8", "quantize bf16 out_n only", sh);
                    test_fp8_quantize<bf16>(s[0], s[1], s[2], fmt, 0, 1);
                    set_ctx("fp8", "quantize bf16 out_t only", sh);
                    test_fp8_quantize<bf16>(s[0], s[1], s[2], fmt, 0, 2);
                }
            }
        /* the weights' list: W_QKV (3 blocks), W_O, W_1, W_2 of two layers and a job of partial
         * tiles (of 64 x 128: 208 x 392); then one with a column count that is not a multiple of 8
         * (so every job takes the element-wise kernels) */
        set_ctx("fp8", "quantize jobs fp32", fp8_name(fmt));
        test_fp8_quantize_jobs<float>({{3, 48, 48}, {1, 48, 48}, {1, 48, 208}, {1, 208, 48}, {3, 48, 48}, {1, 48, 48},
                                       {1, 48, 208}, {1, 208, 48}, {1, 208, 392}}, fmt);
        set_ctx("fp8", "quantize jobs fp32 odd", fp8_name(fmt));
        test_fp8_quantize_jobs<float>({{1, 37, 36}, {3, 64, 64}, {1, 129, 200}}, fmt);
    }
    /* packed: 12500 packets, 49 blocks; element by element: 118 blocks */
    set_ctx("fp8", "adamw amax", "n=100000 packed");
    test_adamw_amax(100000);
    set_ctx("fp8", "adamw amax", "n=30011 element-wise");
    test_adamw_amax(30011);
    set_ctx("fp8", "delayed scaling", "R=256 C=96 packed");
    test_fp8_delayed(256, 96);
    set_ctx("fp8", "delayed scaling", "R=37 C=36 element-wise");
    test_fp8_delayed(37, 36);
    /* 36: the element-wise kernel; LN_FP8_MAX_C: the widest row the fused kernel takes; ANDREA-120M's
     * and -12M's; whole (1024) and partial (1000, 520, 200) groups of 16-byte column stores */
    const int ln_shapes[][2] = {{64, 192}, {48, 768}, {32, 36}, {16, LN_FP8_MAX_C}, {8192, 768}, {4096, 192},
                                {96, 1024}, {64, 1000}, {96, 520}, {32, 200}, {64, 1032}};
    for (const auto& ls : ln_shapes) {
        snprintf(sh, sizeof sh, "N=%d C=%d", ls[0], ls[1]);
        set_ctx("fp8", "delayed layernorm fused", sh);
        test_fp8_layernorm_fused(ls[0], ls[1]);
    }
    /* packed; partial tiles (of 64 x 128: 80 x 200, 208 x 392); element-wise */
    const int gelu_shapes[][2] = {{128, 768}, {80, 200}, {208, 392}, {37, 36}};
    for (const auto& gs : gelu_shapes) {
        snprintf(sh, sizeof sh, "R=%d F=%d", gs[0], gs[1]);
        set_ctx("fp8", "delayed gelu fused", sh);
        test_fp8_gelu_fused(gs[0], gs[1]);
        set_ctx("fp8", "delayed dgelu fused", sh);
        test_fp8_dgelu_fused(gs[0], gs[1]);
    }
    set_ctx("fp8", "gelu fast tanh", "h in [-10, 10]; 2^22 as they occur");
    test_gelu_fast_tanh();
    /* the fused LayerNorm backward at every shape test_layernorm checks the register kernel at (its
     * rows N = B·T·4 + 1: chunks of odd row counts, the transposed codes byte by byte), and at
     * ANDREA-120M's and -12M's (chunks of 32 and 16 rows: 16-byte stores) */
    std::vector<std::array<int, 2>> lnb_shapes = {{8192, 768}, {4096, 192}};
    for (const Shape& s : SHAPES) lnb_shapes.push_back({s.B * s.T * 4 + 1, s.C});
    for (int C : {768, 392, 100, 70}) lnb_shapes.push_back({2 * 40 * 4 + 1, C});
    for (const auto& ls : lnb_shapes) {
        snprintf(sh, sizeof sh, "N=%d C=%d", ls[0], ls[1]);
        set_ctx("fp8", "delayed layernorm backward fused", sh);
        test_fp8_layernorm_bwd_fused(ls[0], ls[1]);
    }
    /* the fused attention backward and forward at every attention shape test_attn checks, and at ANDREA-12M's
     * (hs 32) and -120M's (hs 64) head sizes with whole tiles */
    std::vector<Shape> attn_shapes(std::begin(SHAPES), std::end(SHAPES));
    attn_shapes.insert(attn_shapes.end(), std::begin(ATTN_SHAPES), std::end(ATTN_SHAPES));
    attn_shapes.push_back({4, 256, 192, 6, 0, 0, 0, 0});
    attn_shapes.push_back({2, 512, 768, 12, 0, 0, 0, 0});
    for (const Shape& as : attn_shapes) {
        set_ctx("fp8", "delayed attention backward fused", shape_str(as).c_str());
        test_fp8_attn_bwd_fused(as);
    }
    for (const Shape& as : attn_shapes) { /* the fused attention forward at the same shapes */
        set_ctx("fp8", "delayed attention forward fused", shape_str(as).c_str());
        test_fp8_attn_fwd_fused(as);
    }
    /* the last two contract as far as ANDREA-120M's products do (d_ff; B·T for a weight gradient),
     * where an accumulation in fewer bits than fp32 (FP8_FAST_ACCUM) shows */
    const int gshapes[][4] = {{64, 96, 128, 1},  {48, 32, 96, 3},    {256, 512, 64, 1},
                              {16, 48, 16, 1},   {128, 64, 3072, 1}, {64, 64, 8192, 1}};
    for (const auto& g : gshapes) {
        snprintf(sh, sizeof sh, "M=%d N=%d K=%d batch=%d", g[0], g[1], g[2], g[3]);
        set_ctx("fp8", "gemm bf16 out", sh); /* the forward's products (with its residual join), dx's */
        test_fp8_gemm<bf16>(FP8_PASS_FORWARD, g[0], g[1], g[2], g[3], FP8_E4M3, FP8_E4M3, 0.0f);
        test_fp8_gemm<bf16>(FP8_PASS_INPUT_GRAD, g[0], g[1], g[2], g[3], FP8_E5M2, FP8_E4M3, 0.0f);
        g_fp8_fast_input_grads = true; /* as the engine's below FP8_FAST_INPUT_GRADS_BELOW */
        test_fp8_gemm<bf16>(FP8_PASS_INPUT_GRAD, g[0], g[1], g[2], g[3], FP8_E5M2, FP8_E4M3, 0.0f);
        g_fp8_fast_input_grads = false;
        test_fp8_gemm<bf16>(FP8_PASS_FORWARD, g[0], g[1], g[2], g[3], FP8_E4M3, FP8_E4M3, 1.0f);
        set_ctx("fp8", "gemm fp32 out", sh); /* the weight gradients */
        test_fp8_gemm<float>(FP8_PASS_BACKWARD, g[0], g[1], g[2], g[3], FP8_E4M3, FP8_E5M2, 0.0f);
        test_fp8_gemm<float>(FP8_PASS_BACKWARD, g[0], g[1], g[2], g[3], FP8_E4M3, FP8_E5M2, 1.0f);
    }
    /* the FP8 classifier, called directly (the engines run it from d_model 512, fp8_classifier_pays):
     * one chunk; chunks of 64, 64 and 16 rows; a vocabulary of 1024 in two chunks of 128; d_model 512 */
    const int cls_shapes[][5] = {{64, 48, 100, 128, 64}, {144, 48, 100, 128, 64}, {256, 192, 1000, 1024, 128},
                                 {128, 512, 1000, 1024, 64}};
    for (const auto& c : cls_shapes) {
        snprintf(sh, sizeof sh, "N=%d C=%d V=%d/%d chunk=%d %s", c[0], c[1], c[2], c[3], c[4], fp8_name(FP8_DLOGITS_FMT));
        set_ctx("fp8", "classifier bf16", sh);
        test_loss_fp8<bf16>(c[0], c[1], c[2], c[3], c[4]);
    }
    /* the dlogits codes' transpose: one packet each way; partial tiles both ways (of 128 x 128);
     * the padded vocabulary at 1040 rows (8 whole tiles and 16 rows)
     * and at ANDREA-12M's and -120M's logits chunk of 4096 rows */
    const int tshapes[][2] = {{16, 16}, {144, 400}, {208, 48}, {1040, 50304}, {4096, 50304}};
    for (const auto& t : tshapes) {
        snprintf(sh, sizeof sh, "R=%d C=%d", t[0], t[1]);
        set_ctx("fp8", "transpose codes", sh);
        test_fp8_transpose(t[0], t[1]);
    }
    /* the fused loss rows: a small vocabulary; the models' (50257 padded to 50304, from shared memory
     * on an H200); logits spread so wide (sd 60) that most exponentials of the gradient fall below
     * 2^-126, where loss_grad_lean's flush to 0 must give the codes of the subnormals it replaces */
    const int rows_shapes[][4] = {{48, 100, 128, 3}, {32, 50257, 50304, 3}, {16, 50257, 50304, 60}};
    for (const auto& r : rows_shapes) {
        snprintf(sh, sizeof sh, "n=%d V=%d/%d sd %d %s", r[0], r[1], r[2], r[3], fp8_name(FP8_GRAD_FMT));
        set_ctx("fp8", "loss rows fp8 fused bf16", sh);
        test_loss_rows_fp8_fused<bf16>(r[0], r[1], r[2], (float)r[3]);
    }
    fp8_plans_clear();
}

/* Whether the GPU is of compute capability 9.0, the one the sm_90a kernels run on. */
static bool gpu_is_hopper(void) {
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    return p.major == 9 && p.minor == 0;
}

/* The Hopper kernels (the forward k_attn_fwd_wgmma and the dK/dV kernel k_attn_bwd_dkv_wgmma) must
 * be what the flash shapes below check on a compute capability 9.0 GPU: the loaded image must
 * carry them (the Makefile builds sm_90a), and on any other it must not (their bodies there are a
 * trap). One path line per kernel, so a build that silently fell back to mma.sync fails here. */
template <typename T> static void check_wgmma_path(void) {
    bool hopper = gpu_is_hopper();
    auto report_path = [&](const char* kernel, bool on) {
        set_ctx(TypeInfo<T>::name(), "attn", kernel);
        report(on == hopper, "path", on ? "wgmma (sm_90a) at head sizes 32 and 64" : "mma.sync (no sm_90a image loaded)");
    };
    report_path("forward kernel", fa_fwd_wgmma_ok<T, 32>() && fa_fwd_wgmma_ok<T, 64>());
    report_path("dK/dV kernel", fa_dkv_wgmma_ok<T, 32>() && fa_dkv_wgmma_ok<T, 64>());
}

/* The attention pair at every shape (alone with --only attn). */
template <typename T> static void run_attn(void) {
    auto one = [](const Shape& s) {
        set_ctx(TypeInfo<T>::name(), "attn", shape_str(s).c_str());
        test_attn<T>(s, tol_for<T>());
    };
    if constexpr (sizeof(T) == 2) check_wgmma_path<T>();
    for (const Shape& s : SHAPES) one(s);
    for (const Shape& s : ATTN_SHAPES) one(s);
    for (const Shape& s : ATTN_SHAPES) {
        set_ctx(TypeInfo<T>::name(), "attn", (shape_str(s) + " ramped keys").c_str());
        test_attn<T>(s, tol_for<T>(), 4.0f);
    }
}

/* The loss rows from shared memory (microgpt/cuda/loss.cuh's k_loss_rows_shared), which must run
 * here, against those from memory (k_loss_rows) on the same n rows of logits (random, spread as
 * real logits, targets anywhere in the real columns): the same losses, lse and dlogits (padded
 * columns included), bit for bit, in training (dscale) and in evaluation (none). test_loss checks
 * the engine's choice against the CPU layer. */
template <typename T> static void test_loss_rows_shared(int n, int V, int Vp) {
    Vec logits = rounded<T>(randn((size_t)n * Vp, 3.0f));
    int* d_targets = upload_ints(rand_ints(n, V));
    float* d_dscale = upload<float>(Vec(1, 1.0f / n));
    for (const float* dscale : {(const float*)d_dscale, (const float*)NULL}) {
        std::vector<Vec> out[2];
        bool ran = true;
        for (int shared = 0; shared < 2; shared++) {
            T* d_logits = upload<T>(logits);
            float *d_losses = poisoned<float>(n), *d_lse = poisoned<float>(n);
            if (shared) ran = loss_rows_from_shared<T>(d_losses, d_lse, d_logits, d_targets, n, V, Vp, dscale);
            else loss_rows_from_memory<T>(d_losses, d_lse, d_logits, d_targets, n, V, Vp, dscale);
            out[shared] = {download(d_losses, n), download(d_lse, n), download(d_logits, (size_t)n * Vp)};
        }
        const char* what = dscale ? "shared_bits" : "shared_bits eval";
        if (!ran) {
            report(false, what, "the loss rows from shared memory did not run (do not fit this GPU)");
            continue;
        }
        bool same = true;
        for (int i = 0; i < 3; i++)
            same = same && memcmp(out[0][i].data(), out[1][i].data(), out[0][i].size() * sizeof(float)) == 0;
        report(same, what, same ? "from shared memory: the bits of the rows from memory"
                                : "from shared memory: bits DIFFER from the rows from memory");
    }
    dfree_all();
}

/* The fused classifier backward (classifier_grad.cuh) on Hopper, and the loss rows' path on the same
 * shapes (alone with --only classifier: compute-sanitizer's run over classifier_grad.cuh). */
static void run_classifier(void) {
    const char* prec = TypeInfo<bf16>::name();
    Tol tol = tol_for<bf16>();
    /* d_model 64, 128 and 192 (one to three slabs; 256, four, is the loss
     * rows' even with fused products on), vocabularies not a multiple of 64 (the last tile
     * masked) with padded rows (1152: a whole 192-row block of them), Vp not a multiple of 192
     * (1024: dwte's last block half past Vp, at every d_model), 256 rows (dx's second row block
     * two thirds past n), one and two chunks, from one vocabulary tile a share to several rounds
     * of its ring (on 132 multiprocessors; 4096 rows: ANDREA-12M's 22 row blocks, 6 shares of
     * 7 or 8 tiles at V 3000, of exactly 2 at V 750) */
    for (Shape cls : {Shape{2, 128, 192, 3, 0, 1000, 1152, 128}, Shape{2, 128, 128, 2, 0, 1000, 1024, 256},
                      Shape{2, 128, 64, 1, 0, 1000, 1024, 256}, Shape{2, 128, 192, 3, 0, 1000, 1024, 256},
                      Shape{2, 128, 256, 4, 0, 1000, 1024, 256}, Shape{4, 1024, 64, 1, 0, 3000, 3072, 2048},
                      Shape{4, 1024, 64, 1, 0, 750, 768, 4096}, Shape{4, 1024, 128, 2, 0, 3000, 3072, 4096},
                      Shape{4, 1024, 192, 3, 0, 3000, 3072, 4096}}) {
        for (int fuse = 1; fuse >= 0; fuse--) {
            g_gemm_fuse = fuse;
            set_ctx(prec, fuse ? "loss" : "loss unfused", shape_str(cls).c_str());
            bool ran = test_loss<bf16>(cls, tol), expected = fuse && gpu_is_hopper() && cls.C <= 64 * CG_MAX_SLABS;
            report(ran == expected, "path", ran ? "classifier backward: fused (sm_90a)" : "classifier backward: loss rows");
        }
        g_gemm_fuse = true;
    }
}

/* The embedding pair at the shapes of its paths beyond SHAPES' (alone with --only embed:
 * compute-sanitizer's run over embed.cuh). */
template <typename T> static void run_embed(void) {
    const char* prec = TypeInfo<T>::name();
    Tol tol = tol_for<T>();
    /* C of 302, unpacked in every precision (a column a lane: ten slabs of 32, the last 14 wide),
     * and 2400 positions of four tokens: runs of hundreds over many chunks, their ends inside chunks */
    Shape wide = {3, 800, 302, 4, 8, 17, 17, 8};
    set_ctx(prec, "embed", shape_str(wide).c_str());
    test_embed<T>(wide, tol);
    /* one token everywhere, B·T not a multiple of EMBED_CHUNK: one run over every chunk, the last
     * partial (the join adds hundreds of heads, 32 a ballot); then two tokens */
    Shape one = {3, 1531, 72, 4, 8, 5, 5, 8};
    for (int range : {1, 2}) {
        set_ctx(prec, range == 1 ? "embed one token" : "embed two tokens", shape_str(one).c_str());
        test_embed<T>(one, tol, range);
    }
    /* rows of several packed slabs (four of 256 columns in 16 bits, seven of 128 in fp32; the last
     * 32 columns wide either way), ~6 positions a token: runs within a chunk and across its ends
     * side by side */
    Shape mixed = {2, 300, 800, 4, 8, 100, 128, 8};
    set_ctx(prec, "embed mixed runs", shape_str(mixed).c_str());
    test_embed<T>(mixed, tol, mixed.V);
    /* a GPT-2 vocabulary and ANDREA-120M's B·T, tokens from all of it: every key bit sorted,
     * nearly every run one position */
    Shape vocab = {8, 1024, 64, 4, 8, 50304, 50304, 8};
    set_ctx(prec, "embed", shape_str(vocab).c_str());
    test_embed<T>(vocab, tol, vocab.V);
    /* B·T above the one-block sort (EMBED_SORT_THREADS x EMBED_SORT_ITEMS): the device-wide sort */
    Shape many = {3, 2800, 64, 4, 8, 1000, 1024, 8};
    set_ctx(prec, "embed device sort", shape_str(many).c_str());
    test_embed<T>(many, tol);
}

/* Hopper's GELU-backward product (mlp.cuh) in the MLP pair, bf16: 2048 rows (288 tiles), more than
 * two a multiprocessor, so the blocks take several tiles each, and 384 rows (54 tiles), fewer blocks
 * than multiprocessors; both with more k steps than stages, so the ring wraps. Checks which path
 * ran: off Hopper cuBLASLt's, on Hopper the pingpong kernel's. */
static void run_mlp_pingpong(void) {
    Shape many = {2, 1024, 320, 5, 2304, 300, 320, 0}, few = {3, 128, 320, 5, 2304, 300, 320, 0};
    for (const Shape& d : {many, few}) {
        set_ctx("bf16", "mlp", shape_str(d).c_str());
        long before = g_dgelu_pingpong_runs;
        test_mlp<bf16>(d, tol_for<bf16>());
        bool ran = g_dgelu_pingpong_runs > before;
        report(ran == gpu_is_hopper(), "path", ran ? "GELU-backward product: pingpong (sm_90a)" : "GELU-backward product: cuBLASLt");
    }
}

template <typename T> static void run_precision(void) {
    const char* prec = TypeInfo<T>::name();
    Tol tol = tol_for<T>();
    long fused_before[GEMM_N_FUSED];
    memcpy(fused_before, g_gemm_fused_runs, sizeof fused_before);
    for (const Shape& s : SHAPES) {
        std::string sh = shape_str(s);
        set_ctx(prec, "embed", sh.c_str());
        test_embed<T>(s, tol);
        set_ctx(prec, "layernorm", sh.c_str());
        test_layernorm<T>(s, tol);
        set_ctx(prec, "attn_qkv", sh.c_str());
        test_attn_qkv<T>(s, tol);
        for (int fuse = 1; fuse >= 0; fuse--) { /* the fused products, then the unfused path */
            g_gemm_fuse = fuse;
            set_ctx(prec, fuse ? "attn_out" : "attn_out unfused", sh.c_str());
            test_attn_out<T>(s, tol);
            set_ctx(prec, fuse ? "mlp" : "mlp unfused", sh.c_str());
            test_mlp<T>(s, tol);
        }
        g_gemm_fuse = true;
        set_ctx(prec, "gelu", sh.c_str());
        test_gelu<T>((size_t)s.B * s.T * s.F, tol);
        test_gelu<T>((size_t)s.B * s.T * s.F + 3, tol);
        set_ctx(prec, "residual", sh.c_str());
        test_residual<T>(s, tol);
        set_ctx(prec, "loss", sh.c_str());
        test_loss<T>(s, tol);
        test_loss_rows_shared<T>(s.B * s.T, s.V, s.Vp);
        set_ctx(prec, "decode", sh.c_str());
        test_decode<T>(s, tol);
    }
    {
        /* more sequences than a block's DECODE_ROWS, a head wider than the attention block's
         * threads (its one-group sum), T beyond the block (positions loop), and a K of several
         * rounds of a product thread's weight loads (more with 3 rows than alone) */
        Shape many = {11, 300, 16, 1, 24, 40, 40, 0}, wide = {2, 20, 600, 2, 64, 9, 16, 0},
              deep = {4, 8, 1200, 4, 16, 9, 16, 0};
        for (const Shape& d : {many, wide, deep}) {
            set_ctx(prec, "decode", shape_str(d).c_str());
            test_decode<T>(d, tol);
        }
    }
    if constexpr (std::is_same<T, bf16>::value) {
        run_mlp_pingpong();
        run_classifier();
    }
    set_ctx(prec, "cuBLASLt", "all shapes");
    check_fused_taken(fused_before);
    run_attn<T>();
    run_embed<T>();
    /* rows up to LN_SLAB_COLS of several packets a lane (SHAPES' rows are one): the LayerNorm
     * backward's register kernel with 2 to LN_REG_PACKETS packets, some lanes one fewer (392), in
     * packets (768: 3 in 16 bits; 392: 2 in 16 bits, 4 in fp32) and element by element (100: 4 in
     * 16 bits; 70: 3) */
    for (int C : {768, 392, 100, 70}) {
        Shape rows = {2, 40, C, 4, 0, 0, 0, 0};
        set_ctx(prec, "layernorm", shape_str(rows).c_str());
        test_layernorm<T>(rows, tol);
    }
    /* rows wider than LN_SLAB_COLS: the LayerNorm backward's slab kernel, its column slabs in
     * packets (1600: three slabs of 536, 536, 528) and element by element (1001) */
    for (Shape wide : {Shape{1, 7, 1600, 4, 0, 0, 0, 0}, Shape{1, 5, 1001, 7, 0, 0, 0, 0}}) {
        set_ctx(prec, "layernorm", shape_str(wide).c_str());
        test_layernorm<T>(wide, tol);
    }
    if (sizeof(T) == 2) { /* the models' vocabulary in 16 bits (an fp32 row of it does not fit) */
        Shape vocab = {1, 300, 0, 0, 0, 50259, 50304, 0};
        set_ctx(prec, "loss", shape_str(vocab).c_str());
        test_loss_rows_shared<T>(vocab.B * vocab.T, vocab.V, vocab.Vp);
    }
    set_ctx(prec, "adamw", "n=10007");
    test_adamw<T>(10007, tol);
    set_ctx(prec, "adamw", "n=10008");
    test_adamw<T>(10008, tol);
}

int main(int argc, char** argv) {
    uint64_t seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
    const char* prec = "all";
    /* --only attn: the attention pair alone (the flash variants' check); --only classifier: the
     * classifier's loss and backward alone; --only embed: the embedding pair's own shapes; --only
     * mlp: the MLP pair on Hopper's GELU-backward product (short runs for compute-sanitizer) */
    const char* only = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--prec") && i + 1 < argc) prec = argv[++i];
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
            only = argv[++i];
            if (strcmp(only, "attn") && strcmp(only, "classifier") && strcmp(only, "embed") && strcmp(only, "mlp")) {
                fprintf(stderr, "error: --only takes attn, classifier, embed or mlp, not '%s'\n", only);
                return 2;
            }
        }
        else {
            fprintf(stderr,
                    "error: unknown argument '%s' (usage: kernel_check [--seed N] [--prec fp32|bf16|fp16|fp8|all] "
                    "[--only attn|classifier|embed|mlp])\n",
                    argv[i]);
            return 2;
        }
    }
    if (strcmp(prec, "all") && strcmp(prec, "fp32") && strcmp(prec, "bf16") && strcmp(prec, "fp16") &&
        strcmp(prec, "fp8")) {
        fprintf(stderr, "error: --prec must be fp32, bf16, fp16, fp8 or all, not '%s'\n", prec);
        return 2;
    }
    if (only && strcmp(only, "classifier") && !strcmp(prec, "fp8")) {
        fprintf(stderr, "error: --only %s has no fp8 checks (use --prec fp32, bf16, fp16 or all)\n", only);
        return 2;
    }
    if (only && (!strcmp(only, "classifier") || !strcmp(only, "mlp")) && strcmp(prec, "bf16") && strcmp(prec, "all")) {
        fprintf(stderr, "error: --only %s checks bf16 alone (use --prec bf16 or all)\n", only);
        return 2;
    }
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1) {
        fprintf(stderr, "error: no usable CUDA device\n");
        return 1;
    }
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    printf("kernel_check: device %s (cc %d.%d), seed %llu (replay with --seed %llu)%s\n", p.name, p.major, p.minor,
           (unsigned long long)seed, (unsigned long long)seed, pdl_enabled() ? ", programmatic dependent launch" : "");
    g_state = seed;
    void* ws = dalloc(CUBLAS_WORKSPACE_BYTES);
    g_allocs.clear(); /* the workspace lives for the whole run */
    /* a stream of its own, as the engine's: the launches are the engine's, programmatic ones included
     * (a blocking stream, so the legacy stream's copies and kernels here stay in order with it) */
    CUDA_CHECK(cudaStreamCreate(&g_stream));
    cublas_init(ws, CUBLAS_WORKSPACE_BYTES);

    if (only && !strcmp(only, "classifier")) {
        run_classifier();
    } else if (only && !strcmp(only, "mlp")) {
        run_mlp_pingpong();
    } else if (only && !strcmp(only, "embed")) {
        if (!strcmp(prec, "all") || !strcmp(prec, "fp32")) run_embed<float>();
        if (!strcmp(prec, "all") || !strcmp(prec, "bf16")) run_embed<bf16>();
        if (!strcmp(prec, "all") || !strcmp(prec, "fp16")) run_embed<fp16>();
    } else if (only) {
        if (!strcmp(prec, "all") || !strcmp(prec, "fp32")) run_attn<float>();
        if (!strcmp(prec, "all") || !strcmp(prec, "bf16")) run_attn<bf16>();
        if (!strcmp(prec, "all") || !strcmp(prec, "fp16")) run_attn<fp16>();
    } else {
        for (int n : {1, 3, 16411}) {
            char what[32];
            snprintf(what, sizeof what, "n=%d", n);
            set_ctx("u32", "copy_words", what);
            test_copy_words(n);
        }
        set_ctx("fp32", "grad_norm", "n=1000003");
        test_grad_norm(1000003);
        set_ctx("fp32", "grad_norm", "n=1000004");
        test_grad_norm(1000004);
        if (!strcmp(prec, "all") || !strcmp(prec, "fp32")) run_precision<float>();
        if (!strcmp(prec, "all") || !strcmp(prec, "bf16")) run_precision<bf16>();
        if (!strcmp(prec, "all") || !strcmp(prec, "fp16")) run_precision<fp16>();
    }
    if (!only && (!strcmp(prec, "all") || !strcmp(prec, "fp8"))) {
        if (p.major * 10 + p.minor >= 89) run_fp8();
        else if (!strcmp(prec, "fp8")) report(false, "fp8", "needs compute capability 8.9 or newer");
        else printf("kernel_check: no fp8 checks on cc %d.%d (FP8 tensor cores need 8.9)\n", p.major, p.minor);
    }

    cublas_shutdown();
    CUDA_CHECK(cudaStreamDestroy(g_stream));
    CUDA_CHECK(cudaFree(ws));
    printf("kernel_check: %d checks, %d failed (seed %llu)\n", g_checks, g_failed, (unsigned long long)seed);
    return g_failed ? 1 : 0;
}
