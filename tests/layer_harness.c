/* Runs one CPU layer from microgpt/cpu/ on inputs from files, for tests/test_cpu_layers.py.
 *
 *   layer_harness LAYER DIR DIMS...
 *
 * Inputs are raw little-endian files DIR/NAME.bin (float32, or int32 for tokens/targets); outputs
 * are written the same way. Gradient outputs start from the DIR/NAME.bin files of the same name, so
 * the test can check that backward functions accumulate (+=) instead of overwriting.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../microgpt/cpu/embed.h"
#include "../microgpt/cpu/layernorm.h"
#include "../microgpt/cpu/matmul.h"
#include "../microgpt/cpu/attention.h"
#include "../microgpt/cpu/gelu.h"
#include "../microgpt/cpu/residual.h"
#include "../microgpt/cpu/classifier.h"
#include "../microgpt/cpu/adamw.h"

static const char* g_dir;

static void die(const char* msg, const char* arg) {
    fprintf(stderr, "error: %s%s\n", msg, arg);
    exit(2);
}

static void* load(const char* name, size_t count, size_t elem) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.bin", g_dir, name);
    FILE* f = fopen(path, "rb");
    if (!f) die("cannot open ", path);
    void* buf = malloc(count * elem + 1);
    if (fread(buf, elem, count, f) != count || fgetc(f) != EOF) die("wrong size: ", path);
    fclose(f);
    return buf;
}
static float* lf(const char* name, size_t n) { return (float*)load(name, n, sizeof(float)); }
static int* li(const char* name, size_t n) { return (int*)load(name, n, sizeof(int)); }

static void save(const char* name, const float* data, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.bin", g_dir, name);
    FILE* f = fopen(path, "wb");
    if (!f || fwrite(data, sizeof(float), n, f) != n || fclose(f) != 0) die("cannot write ", path);
}

int main(int argc, char** argv) {
    if (argc < 3) die("usage: layer_harness LAYER DIR DIMS...", "");
    const char* layer = argv[1];
    g_dir = argv[2];
    int a[8] = {0};
    for (int i = 3; i < argc && i < 11; i++) a[i - 3] = atoi(argv[i]);

    if (!strcmp(layer, "embed")) {             /* B T C Vp */
        int B = a[0], T = a[1], C = a[2], Vp = a[3];
        size_t n = (size_t)B * T * C;
        int* tok = li("tokens", B * T);
        float *wte = lf("wte", (size_t)Vp * C), *wpe = lf("wpe", (size_t)T * C), *dout = lf("dout", n);
        float *dwte = lf("dwte", (size_t)Vp * C), *dwpe = lf("dwpe", (size_t)T * C);
        float* out = (float*)malloc(n * sizeof(float));
        embed_forward(out, tok, wte, wpe, B, T, C);
        embed_backward(dwte, dwpe, dout, tok, B, T, C);
        save("out", out, n); save("dwte", dwte, (size_t)Vp * C); save("dwpe", dwpe, (size_t)T * C);
    } else if (!strcmp(layer, "layernorm")) {  /* N C */
        int N = a[0], C = a[1];
        size_t n = (size_t)N * C;
        float *x = lf("x", n), *gamma = lf("gamma", C), *beta = lf("beta", C), *dout = lf("dout", n);
        float *dx = lf("dx", n), *dgamma = lf("dgamma", C), *dbeta = lf("dbeta", C);
        float* out = (float*)malloc(n * sizeof(float));
        float* mean = (float*)malloc(N * sizeof(float));
        float* rstd = (float*)malloc(N * sizeof(float));
        layernorm_forward(out, mean, rstd, x, gamma, beta, N, C);
        layernorm_backward(dx, dgamma, dbeta, dout, x, gamma, mean, rstd, N, C);
        save("out", out, n); save("mean", mean, N); save("rstd", rstd, N);
        save("dx", dx, n); save("dgamma", dgamma, C); save("dbeta", dbeta, C);
    } else if (!strcmp(layer, "matmul")) {     /* N in out */
        int N = a[0], in = a[1], od = a[2];
        float *x = lf("x", (size_t)N * in), *w = lf("w", (size_t)in * od), *dout = lf("dout", (size_t)N * od);
        float *dx = lf("dx", (size_t)N * in), *dw = lf("dw", (size_t)in * od);
        float* out = (float*)malloc((size_t)N * od * sizeof(float));
        matmul_forward(out, x, w, N, in, od);
        matmul_backward(dx, dw, dout, x, w, N, in, od);
        save("out", out, (size_t)N * od); save("dx", dx, (size_t)N * in); save("dw", dw, (size_t)in * od);
    } else if (!strcmp(layer, "attention")) {  /* B T C H */
        int B = a[0], T = a[1], C = a[2], H = a[3];
        size_t n = (size_t)B * T * C, na = (size_t)B * H * T * T;
        float *q = lf("q", n), *k = lf("k", n), *v = lf("v", n), *dout = lf("dout", n);
        float *dq = lf("dq", n), *dk = lf("dk", n), *dv = lf("dv", n);
        float* out = (float*)malloc(n * sizeof(float));
        float* att = (float*)malloc(na * sizeof(float));
        attention_forward(out, att, q, k, v, B, T, C, H);
        attention_backward(dq, dk, dv, dout, att, q, k, v, B, T, C, H);
        save("out", out, n); save("att", att, na); save("dq", dq, n); save("dk", dk, n); save("dv", dv, n);
    } else if (!strcmp(layer, "gelu")) {       /* n */
        int n = a[0];
        float *x = lf("x", n), *dout = lf("dout", n), *dx = lf("dx", n);
        float* out = (float*)malloc(n * sizeof(float));
        gelu_forward(out, x, n);
        gelu_backward(dx, x, dout, n);
        save("out", out, n); save("dx", dx, n);
    } else if (!strcmp(layer, "residual")) {   /* n */
        int n = a[0];
        float *x = lf("a", n), *y = lf("b", n), *dout = lf("dout", n), *da = lf("da", n), *db = lf("db", n);
        float* out = (float*)malloc(n * sizeof(float));
        residual_forward(out, x, y, n);
        residual_backward(da, db, dout, n);
        save("out", out, n); save("da", da, n); save("db", db, n);
    } else if (!strcmp(layer, "classifier")) { /* N C V Vp */
        int N = a[0], C = a[1], V = a[2], Vp = a[3];
        float *x = lf("x", (size_t)N * C), *wte = lf("wte", (size_t)Vp * C);
        int* targets = li("targets", N);
        float *dx = lf("dx", (size_t)N * C), *dwte = lf("dwte", (size_t)Vp * C);
        float* probs = (float*)malloc((size_t)N * Vp * sizeof(float));
        float loss = classifier_forward(probs, x, wte, targets, N, C, V, Vp);
        save("loss", &loss, 1); save("probs", probs, (size_t)N * Vp); /* the backward overwrites them */
        classifier_backward(dx, dwte, probs, x, wte, targets, N, C, V, Vp);
        save("dx", dx, (size_t)N * C); save("dwte", dwte, (size_t)Vp * C);
    } else if (!strcmp(layer, "adamw")) {      /* n t; hyper-parameters in hyper.bin */
        int n = a[0], t = a[1];
        float* h = lf("hyper", 5); /* lr beta1 beta2 eps wd */
        float *p = lf("p", n), *g = lf("g", n), *m = lf("m", n), *v = lf("v", n);
        adamw_update(p, g, m, v, n, h[0], h[1], h[2], h[3], h[4], t);
        save("p", p, n); save("m", m, n); save("v", v, n);
    } else {
        die("unknown layer ", layer);
    }
    return 0;
}
