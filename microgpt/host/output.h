/* output.h: the two output channels of an engine.
 * stdout carries one JSON object per line for machines (the proxy parses it), flushed after every
 * line so a reader never sees half a record; stderr carries messages for people.
 * Every bad input ends in exactly one "error: ..." line on stderr and exit code 2 (die_input).
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_OUTPUT_H
#define MICROGPT_HOST_OUTPUT_H

#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXIT_BAD_INPUT 2 /* unknown/malformed flag, bad shard, bad checkpoint, ... */
#define EXIT_FAILURE_IO 1 /* the machine failed us (disk full, out of memory) */
#define EXIT_DIVERGED 3 /* the loss, gradient norm or state went non-finite; nothing of it was saved */

/* One "error: ..." line on stderr, then exit. Used for every fatal condition. */
static void die_code(int code, const char* fmt, ...) {
    va_list ap;
    fflush(stdout);
    fputs("error: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
    exit(code);
}
#define die_input(...) die_code(EXIT_BAD_INPUT, __VA_ARGS__)
#define die_io(...) die_code(EXIT_FAILURE_IO, __VA_ARGS__)

/* A human-readable line on stderr. */
static void info(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
}

static void warn(const char* fmt, ...) {
    va_list ap;
    fputs("warning: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
}

/* malloc that dies with a clear message instead of returning NULL. */
static void* xmalloc(size_t bytes, const char* what) {
    void* p = malloc(bytes ? bytes : 1);
    if (!p) die_io("out of host memory allocating %zu bytes for %s", bytes, what);
    return p;
}

static void* xcalloc(size_t count, size_t size, const char* what) {
    void* p = calloc(count ? count : 1, size ? size : 1);
    if (!p) die_io("out of host memory allocating %zu bytes for %s", count * size, what);
    return p;
}

/* JSON number text. %.9g round-trips a float bit-exactly; non-finite values are not JSON numbers,
 * so they are written as null (a diverged loss must not make the line unparseable). */
static const char* json_num(char* buf, size_t cap, double x) {
    if (isfinite(x)) snprintf(buf, cap, "%.9g", x);
    else snprintf(buf, cap, "null");
    return buf;
}

/* JSON string body escaping for the few strings we print (names, paths). */
static void json_put_string(FILE* f, const char* s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c == '\n') fputs("\\n", f);
        else if (c == '\t') fputs("\\t", f);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

/* Every JSON line goes through these two so the flush can't be forgotten. */
static void jline_end(void) {
    fputs("}\n", stdout);
    fflush(stdout);
}

/* --generate keeps stdout for its own protocol (docs/DESIGN.md §5a): no events there. */
static int g_quiet_events = 0;

/* {"event":"memory","groups":{...},"total_bytes":N}: engines call this from engine_setup. */
static void emit_memory(const char* const* group_names, const size_t* group_bytes, int n_groups) {
    size_t total = 0;
    int i;
    if (g_quiet_events) return;
    fputs("{\"event\":\"memory\",\"groups\":{", stdout);
    for (i = 0; i < n_groups; i++) {
        if (i) fputc(',', stdout);
        json_put_string(stdout, group_names[i]);
        fprintf(stdout, ":%zu", group_bytes[i]);
        total += group_bytes[i];
    }
    fprintf(stdout, "},\"total_bytes\":%zu", total);
    jline_end();
}

/* {"event":"device_memory","step":s,"bytes":N}: the GPU engine's loop reports first and last step. */
static void emit_device_memory(int step, size_t bytes) {
    fprintf(stdout, "{\"event\":\"device_memory\",\"step\":%d,\"bytes\":%zu", step, bytes);
    jline_end();
}

static void emit_checkpoint(int step, const char* path, const char* reason) {
    fprintf(stdout, "{\"event\":\"checkpoint\",\"step\":%d,\"path\":", step);
    json_put_string(stdout, path);
    fprintf(stdout, ",\"reason\":\"%s\"", reason);
    jline_end();
}

static void emit_exit(int step, const char* reason) {
    fprintf(stdout, "{\"event\":\"exit\",\"step\":%d,\"reason\":\"%s\"", step, reason);
    jline_end();
}

static void emit_polish(int step) {
    fprintf(stdout, "{\"event\":\"polish\",\"step\":%d", step);
    jline_end();
}

static void emit_val(int step, double val_loss) {
    char b[32];
    fprintf(stdout, "{\"step\":%d,\"val_loss\":%s", step, json_num(b, sizeof b, val_loss));
    jline_end();
}

static void emit_int_array(const int* xs, int n) {
    int i;
    fputc('[', stdout);
    for (i = 0; i < n; i++) fprintf(stdout, i ? ",%d" : "%d", xs[i]);
    fputc(']', stdout);
}

static void emit_sample(int step, int prompt, const int* prompt_tokens, int n_prompt, const int* tokens, int n) {
    fprintf(stdout, "{\"event\":\"sample\",\"step\":%d,\"prompt\":%d,\"prompt_tokens\":", step, prompt);
    emit_int_array(prompt_tokens, n_prompt);
    fputs(",\"tokens\":", stdout);
    emit_int_array(tokens, n);
    jline_end();
}

/* The per-step training record. skipped/loss_scale only appear for loss-scaled (fp16) runs. */
static void emit_step(int step, double loss, double lr, double grad_norm, double ms, double tokens_per_s,
                      long long tokens, const char* phase, int skipped, double loss_scale, int show_scale) {
    char b1[32], b2[32], b3[32], b4[32], b5[32];
    fprintf(stdout, "{\"step\":%d,\"loss\":%s,\"lr\":%s,\"grad_norm\":%s,\"ms\":%s,\"tokens_per_s\":%s,"
                    "\"tokens\":%lld,\"phase\":\"%s\"",
            step, json_num(b1, sizeof b1, loss), json_num(b2, sizeof b2, lr), json_num(b3, sizeof b3, grad_norm),
            json_num(b4, sizeof b4, ms), json_num(b5, sizeof b5, tokens_per_s), tokens, phase);
    if (skipped) fputs(",\"skipped\":true", stdout);
    if (show_scale) fprintf(stdout, ",\"loss_scale\":%s", json_num(b1, sizeof b1, loss_scale));
    jline_end();
}

#endif
