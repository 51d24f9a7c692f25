/* fp8.h: the FP8 formats of precision fp8 (docs/DESIGN.md §18) in plain C, the one definition of
 * what the GPU engine's casts compute, so the CPU engine can emulate them bit for bit.
 *
 *   E4M3  1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinity; largest finite 448;
 *         NaN 0x7F/0xFF; subnormals m * 2^-9.         Weights and activations.
 *   E5M2  1 sign, 5 exponent (bias 15), 2 mantissa bits; IEEE-like; largest finite 57344;
 *         subnormals m * 2^-16.                         Activation gradients.
 *
 * fp8_from_float rounds to nearest, ties to even, and saturates every finite or infinite value
 * beyond the largest finite one to it (the contract of cuda_fp8.h's __nv_cvt_float_to_fp8 with
 * __NV_SATFINITE, on sm_89+ the instruction cvt.rn.satfinite); NaN becomes 0x7F.
 * tests/kernel_check.cu compares it with the intrinsic on all 2^32 fp32 inputs.
 *
 * Scaling is per tensor and current: a tensor is cast as fp8(x * s) with s the largest power of two
 * for which amax(|x|) * s stays within the format's largest finite value. A power of two makes
 * x * s and the dequantisation q / s exact (in fp32, barring subnormals, which are rounded the same
 * on both engines), so the only rounding is the cast itself.
 *
 * The header compiles as C99 and as C++; under nvcc every function is also a device function (the
 * kernel check runs the same code on the GPU). */
#ifndef MICROGPT_CPU_FP8_H
#define MICROGPT_CPU_FP8_H

#include <math.h>
#include <string.h>

#ifdef __CUDACC__
#define FP8_HD __host__ __device__
#else
#define FP8_HD
#endif

enum { FP8_E4M3 = 0, FP8_E5M2 = 1 };

#define FP8_E4M3_MAX 448.0f
#define FP8_E5M2_MAX 57344.0f
/* The format of the activation gradients in the FP8 products, in both engines (docs/DESIGN.md §18);
 * -DFP8_GRAD_FMT=FP8_E4M3 builds the alternative the choice was measured against. */
#ifndef FP8_GRAD_FMT
#define FP8_GRAD_FMT FP8_E4M3
#endif
/* Whether precision fp8 runs the tied classifier's three products (logits = lnf @ wte^T,
 * d(lnf) = dlogits @ wte, d(wte) = dlogits^T @ lnf) in FP8 too (docs/DESIGN.md §18): wte and LNf's
 * output E4M3 at their current scales, dlogits FP8_GRAD_FMT at the static scale fp8_dlogits_scale;
 * else the classifier stays in the activation type (bf16 on the GPU, fp32 on the CPU). Its extra
 * passes (wte's cast, dlogits' transpose) cost ~N·Vp, the products' saving ~N·Vp·d_model: measured
 * on an H200 they break even near d_model 500 (ANDREA-12M, 192: +0.30 ms a step; ANDREA-120M, 768:
 * -0.53 ms). A function of the shape alone, one rule for both engines (the CPU engine stays the
 * GPU's reference) and for config_validate. */
#ifndef FP8_CLASSIFIER_MIN_D_MODEL /* a compile-time switch for measurements */
#define FP8_CLASSIFIER_MIN_D_MODEL 512
#endif
static inline int fp8_classifier_pays(int d_model) { return d_model >= FP8_CLASSIFIER_MIN_D_MODEL; }
#define FP8_SCALE_EXP_LIMIT 126 /* scales 2^-126 .. 2^126: the scale and its inverse stay normal fp32 */

/* Mantissa bits, exponent bias and largest finite code (positive) of a format. */
static inline FP8_HD int fp8_mant_bits(int fmt) { return fmt == FP8_E4M3 ? 3 : 2; }
static inline FP8_HD int fp8_bias(int fmt) { return fmt == FP8_E4M3 ? 7 : 15; }
static inline FP8_HD int fp8_max_code(int fmt) { return fmt == FP8_E4M3 ? 0x7E : 0x7B; }

static inline FP8_HD unsigned fp8_float_bits(float x) {
    unsigned u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* x rounded to nearest, ties to even, saturating; see the top of the file. */
static inline FP8_HD unsigned char fp8_from_float(float x, int fmt) {
    unsigned bits = fp8_float_bits(x), abs_bits = bits & 0x7FFFFFFFu;
    unsigned sign = (bits >> 24) & 0x80u;
    int mb = fp8_mant_bits(fmt), bias = fp8_bias(fmt), max_code = fp8_max_code(fmt);
    int code;
    if (abs_bits > 0x7F800000u) return 0x7F; /* NaN */
    if (abs_bits == 0x7F800000u) return (unsigned char)(sign | (unsigned)max_code);
    if (ldexpf(fabsf(x), bias - 1) < 1.0f) {
        /* below the smallest normal 2^(1-bias): a multiple of the smallest subnormal 2^(1-bias-mb);
         * |x| / that unit is exact (a power-of-two scaling up), then rounded to an integer */
        float q = ldexpf(fabsf(x), bias - 1 + mb), fl = floorf(q), rest = q - fl;
        code = (int)fl;
        if (rest > 0.5f || (rest == 0.5f && (code & 1))) code++; /* code 1 << mb: the smallest normal */
    } else {
        int e = (int)((abs_bits >> 23) & 0xFF) - 127, drop = 23 - mb;
        unsigned m = abs_bits & 0x7FFFFFu, rest = m & ((1u << drop) - 1u), half = 1u << (drop - 1);
        code = ((e + bias) << mb) | (int)(m >> drop);
        if (rest > half || (rest == half && (code & 1))) code++; /* a carry moves into the exponent */
        if (code > max_code) code = max_code;
    }
    return (unsigned char)(sign | (unsigned)code);
}

/* The value of an fp8 code (exact in fp32). */
static inline FP8_HD float fp8_to_float(unsigned char c, int fmt) {
    int mb = fp8_mant_bits(fmt), bias = fp8_bias(fmt);
    int e = (c & 0x7F) >> mb, m = c & ((1 << mb) - 1), max_e = fmt == FP8_E4M3 ? 15 : 31;
    float v;
    if (fmt == FP8_E4M3 && (c & 0x7F) == 0x7F) return NAN;
    if (fmt == FP8_E5M2 && e == max_e) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexpf((float)m, 1 - bias - mb);
    else v = ldexpf((float)((1 << mb) + m), e - bias - mb);
    return (c & 0x80) ? -v : v;
}

/* The cast scale for a tensor whose largest magnitude is amax: the largest power of two s with
 * amax * s <= the format's largest finite value, within 2^±FP8_SCALE_EXP_LIMIT; 1 when amax is 0
 * or not finite (nothing to scale; a NaN stays NaN through the cast). */
static inline FP8_HD float fp8_scale_for_amax(float amax, int fmt) {
    int ex, k, max_e = fmt == FP8_E4M3 ? 9 : 16; /* largest finite = 0.875 * 2^max_e */
    float m;
    if (!(amax > 0.0f) || !(amax <= 3.402823466e38f)) return 1.0f;
    m = frexpf(amax, &ex); /* amax = m * 2^ex, m in [0.5, 1) */
    k = max_e - ex - (m > 0.875f ? 1 : 0);
    if (k > FP8_SCALE_EXP_LIMIT) k = FP8_SCALE_EXP_LIMIT;
    if (k < -FP8_SCALE_EXP_LIMIT) k = -FP8_SCALE_EXP_LIMIT;
    return ldexpf(1.0f, k);
}

/* The format of the FP8 classifier's dlogits: FP8_GRAD_FMT unless built with another. At the static
 * scale below the largest |dlogit| lands at the top of the format and a non-target token's
 * p/N well under it: E4M3's 2^-9 below its top is a probability near 2e-5, about a token's share of
 * a 50k vocabulary, so the many small ones are a few bits or less (rounded stochastically for that,
 * fp8_round_stochastic); E5M2 reaches 2^-16 below its top with a mantissa bit fewer
 * (docs/BENCHMARKS.md #106). */
#ifndef FP8_DLOGITS_FMT
#define FP8_DLOGITS_FMT FP8_GRAD_FMT
#endif
/* The FP8 classifier's scale of dlogits = (softmax - onehot) * dscale: every |softmax - onehot| is at
 * most 1, so no dlogit exceeds |dscale| (1/N), and the scale of that bound is known before the
 * logits are: it never saturates (but for an exponential rounded above 1) and equals the current
 * scale unless no |dlogit| reaches 7/8 of the bound (N a power of two; between 1/2 and 1 of it
 * otherwise), i.e. every row puts more than 7/8 of its probability on its target; then it is one
 * binade coarser. No history, nothing to checkpoint. */
static inline FP8_HD float fp8_dlogits_scale(float dscale) { return fp8_scale_for_amax(fabsf(dscale), FP8_DLOGITS_FMT); }

/* Stochastic rounding of the FP8 classifier's dlogits (docs/DESIGN.md §18). Rounded to nearest,
 * the many dlogits p/N of unlikely tokens end as zero or a few bits, always the same way, and the
 * input gradient dx = dlogits @ wte carries that bias into the whole network: 2000 steps of
 * ANDREA-120M in a bf16 build that rounds only dlogits to E4M3 and back ended 2.5 % above bf16
 * rounded to nearest (in dx alone 2.7 %, in dwte alone -0.5 %) and 0.1 % rounded stochastically;
 * the FP8 classifier with them rounded stochastically 0.6 % (docs/BENCHMARKS.md #109). Rounded
 * stochastically, a value x between two neighbouring codes lo < hi becomes hi with probability
 * (x - lo) / (hi - lo), so every code is x on average and the small ones are no longer lost.
 *
 * The random bits are a hash of a salt and the value's place, so both engines draw the same ones
 * and a resumed run the same as an unbroken one: the salt is a hash of the micro-batch's targets
 * (fp8_dlogits_salt: nothing to checkpoint, new with every batch of other targets); a row's key
 * mixes the salt with the row's index in the micro-batch; a packet of FP8_SR_PACKET neighbouring
 * columns takes one hash of the key and its index; its k-th value the hash plus k eighths of 2^32
 * (its threshold offset by k/8: each uniform, the eight stratified). */
#define FP8_SR_PACKET 8
/* A bijective avalanche of 32 bits. Not host/rng.h's rng_mix: that one is 64-bit and host-only, and
 * the loss rows take one of these a packet, where 64-bit multiplies cost several 32-bit ones. */
static inline FP8_HD unsigned fp8_mix32(unsigned x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}
static inline FP8_HD unsigned fp8_sr_row_key(unsigned salt, int row) {
    return fp8_mix32(salt ^ ((unsigned)row * 0x85EBCA6Bu));
}
/* The random bits of value k of the packet of columns FP8_SR_PACKET * packet .. of the row with key row_key. */
static inline FP8_HD unsigned fp8_sr_packet_bits(unsigned row_key, int packet) {
    return fp8_mix32(row_key + (unsigned)packet * 0x9E3779B9u);
}
static inline FP8_HD unsigned fp8_sr_value_bits(unsigned packet_bits, int k) {
    return packet_bits + ((unsigned)k << 29);
}

/* x rounded stochastically to a value of format fmt's grid with the random bits r, as an fp32
 * value that fp8_from_float then converts exactly. Above the format's smallest normal 2^(1-bias)
 * the grid drops the low 23 - mb bits of x's fp32 pattern: adding r's top 23 - mb bits there
 * and clearing them rounds up with the probability of the dropped fraction (a carry moves into the
 * exponent: the next binade's first value). Below it the grid is the smallest normal's (its
 * subnormal codes): x + 2^(1-bias) lies in that binade, rounded there once to fp32 (at
 * 2^(1-bias-23): a fraction of a code to within 2^-20 in E4M3), then rounded the same way and the
 * offset taken back off exactly. Beyond the largest finite value fp8_from_float saturates the
 * result; infinities and NaN are returned as they are (a NaN's payload would carry into the sign). */
static inline FP8_HD float fp8_round_stochastic(float x, unsigned r, int fmt) {
    int drop = 23 - fp8_mant_bits(fmt);
    unsigned sign = fp8_float_bits(x) & 0x80000000u, mask = (1u << drop) - 1u, w;
    float a = fabsf(x), min_normal = fmt == FP8_E4M3 ? 0x1p-6f : 0x1p-14f;
    float off = a < min_normal ? min_normal : 0.0f, y;
    if (!(a < INFINITY)) return x;
    w = fp8_float_bits(a + off);
    w = (w + (r >> (32 - drop))) & ~mask;
    memcpy(&y, &w, sizeof y);
    y -= off;
    w = fp8_float_bits(y) | sign;
    memcpy(&y, &w, sizeof y);
    return y;
}

/* The salt of a micro-batch's dlogits: a hash of its n targets (order-sensitive). */
static inline unsigned fp8_dlogits_salt(const int* targets, int n) {
    unsigned h = 0x6A09E667u;
    for (int i = 0; i < n; i++) h += fp8_mix32((unsigned)targets[i] ^ ((unsigned)i * 0x9E3779B9u));
    return fp8_mix32(h ^ (unsigned)n);
}

/* Largest |x| of n values as the GPU reduces it: the maximum of the fp32 bit patterns of |x|, so
 * a NaN (whose pattern is above infinity's) makes the result NaN. Order-free, hence deterministic. */
static inline float fp8_amax(const float* x, size_t n) {
    unsigned best = 0;
    float r;
    for (size_t i = 0; i < n; i++) {
        unsigned b = fp8_float_bits(x[i]) & 0x7FFFFFFFu;
        if (b > best) best = b;
    }
    memcpy(&r, &best, sizeof r);
    return r;
}

/* out = the values the fp8 product sees of x [n] cast at scale s (a power of two), then dequantised
 * (code value / s). out may be x. */
static inline void fp8_fake_quantize_at(float* out, const float* x, size_t n, int fmt, float s) {
    float inv = 1.0f / s;
    long i, len = (long)n;
    #pragma omp parallel for schedule(static)
    for (i = 0; i < len; i++) out[i] = fp8_to_float(fp8_from_float(x[i] * s, fmt), fmt) * inv;
}

/* fp8_fake_quantize_at of the dlogits [n, Vp] of a micro-batch whose rows start at row0, rounded
 * stochastically with the salt's bits (fp8_round_stochastic), as the GPU's loss rows write them. */
static inline void fp8_fake_quantize_dlogits(float* out, const float* x, int n, int Vp, int row0, unsigned salt,
                                             int fmt, float s) {
    float inv = 1.0f / s;
    int r;
    #pragma omp parallel for schedule(static)
    for (r = 0; r < n; r++) {
        unsigned key = fp8_sr_row_key(salt, row0 + r), bits = 0;
        for (int j = 0; j < Vp; j++) {
            size_t i = (size_t)r * Vp + j;
            if (j % FP8_SR_PACKET == 0) bits = fp8_sr_packet_bits(key, j / FP8_SR_PACKET);
            float y = fp8_round_stochastic(x[i] * s, fp8_sr_value_bits(bits, j % FP8_SR_PACKET), fmt);
            out[i] = fp8_to_float(fp8_from_float(y, fmt), fmt) * inv;
        }
    }
}

/* The same at the tensor's current scale. Returns the scale. */
static inline float fp8_fake_quantize(float* out, const float* x, size_t n, int fmt) {
    float s = fp8_scale_for_amax(fp8_amax(x, n), fmt);
    fp8_fake_quantize_at(out, x, n, fmt, s);
    return s;
}

/* Delayed scaling (fp8 training's layer activations and gradients below, docs/DESIGN.md §18): a tensor's scale
 * comes from the amaxes of its last FP8_HISTORY_LEN training forwards instead of its own, so a
 * producer can write fp8 codes before it knows its amax. The history keeps scale exponents (log2 of
 * fp8_scale_for_amax, oldest first), not amaxes: that rule is monotone, so the smallest exponent is
 * the rule applied to the largest amax, and small integers keep the checkpoint sidecar short.
 * An all-zero tensor records FP8_HISTORY_NONE, which constrains nothing beside other entries.
 *
 * The tensors with delayed scales, per layer, in the engines' and the sidecar's order: the
 * LayerNorm outputs (the QKV and MLP-up inputs), the GELU output (MLP down's) and the attention
 * output att (W_O's input), which a training forward records (the first FP8_DELAYED_FORWARD), so
 * that the LayerNorm, the GELU and the flash attention forward can write their codes; then the
 * gradients, in FP8_GRAD_FMT, which the backward records: the MLP hidden gradient dh (MLP up's
 * output gradient), so that the GELU backward can write its codes; the residual gradients that are
 * W_2's output gradient (at the layer's output) and W_O's (after the attention), so that the
 * LayerNorm backwards that produce them can; and QKV's output gradient dqkv (dq, dk, dv as one
 * tensor), so that the flash attention backward can (docs/DESIGN.md §18). */
enum {
    DELAYED_LN1,
    DELAYED_LN2,
    DELAYED_GELU,
    DELAYED_ATT,
    FP8_DELAYED_FORWARD,
    DELAYED_DGELU = FP8_DELAYED_FORWARD,
    DELAYED_DRES_W2,
    DELAYED_DRES_WO,
    DELAYED_DQKV,
    FP8_DELAYED_PER_LAYER
};
#define FP8_HISTORY_LEN 16
#define FP8_HISTORY_NONE 127
typedef struct {
    signed char exp[FP8_HISTORY_LEN]; /* oldest first; count of them valid */
    int count;
} Fp8History;

/* The format of delayed tensor `which`: the gradients' FP8_GRAD_FMT, the activations' E4M3. */
static inline FP8_HD int fp8_delayed_fmt(int which) { return which >= FP8_DELAYED_FORWARD ? FP8_GRAD_FMT : FP8_E4M3; }

/* The exponent an amax records: log2 of its current scale; FP8_HISTORY_NONE for 0. */
static inline FP8_HD int fp8_history_exponent(float amax, int fmt) {
    int e;
    if (amax == 0.0f) return FP8_HISTORY_NONE;
    frexpf(fp8_scale_for_amax(amax, fmt), &e);
    return e - 1;
}

/* The delayed scale: 2^(smallest exponent of the history); 1, the scale of a zero amax, when every
 * entry is an all-zero tensor's; 0 when the history is empty (a run's first forward: the caller
 * falls back to current scaling, which the host can tell from its count of training forwards). */
static inline FP8_HD float fp8_history_scale(const Fp8History* h) {
    int i, k = FP8_HISTORY_NONE;
    if (h->count == 0) return 0.0f;
    for (i = 0; i < h->count; i++)
        if (h->exp[i] < k) k = h->exp[i];
    return k == FP8_HISTORY_NONE ? 1.0f : ldexpf(1.0f, k);
}

/* Appends the exponent of this forward's amax, dropping the oldest entry of a full history. */
static inline FP8_HD void fp8_history_push(Fp8History* h, float amax, int fmt) {
    int i;
    if (h->count == FP8_HISTORY_LEN) {
        for (i = 1; i < FP8_HISTORY_LEN; i++) h->exp[i - 1] = h->exp[i];
        h->count--;
    }
    h->exp[h->count++] = (signed char)fp8_history_exponent(amax, fmt);
}

#endif
