// ggml-cpu's own flash_attn_ext on given Q/K/V (fp32 files), K and V quantized by ggml itself: the oracle
// bench/oracles/llamacpp/fa_oracle.py compares kvarn.llamacpp_cpu.compute.attention with (issue 13). Uses only the ggml API
// of the llama.cpp build bench/oracles/llamacpp/perplexity.sh makes; built by that script on first use.
// usage: fa D n_q n_kv H H_kv ktype vtype scale q.bin k.bin v.bin mask.bin out.bin
//   q [H][n_q][D], k/v [H_kv][n_kv][D] fp32; mask [n_q][n_kv] fp32 (0 or -inf); out [n_q][H][D] fp32
#include "ggml.h"
#include "ggml-cpu.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
static float * rd(const char * p, size_t n) { FILE * f = fopen(p, "rb"); float * b = malloc(n * 4);
    if (!f || fread(b, 4, n, f) != n) { fprintf(stderr, "read %s\n", p); exit(1); } fclose(f); return b; }
static enum ggml_type ty(const char * s) {
    if (!strcmp(s, "f16")) return GGML_TYPE_F16; if (!strcmp(s, "bf16")) return GGML_TYPE_BF16;
    if (!strcmp(s, "q8_0")) return GGML_TYPE_Q8_0; if (!strcmp(s, "q4_0")) return GGML_TYPE_Q4_0;
    if (!strcmp(s, "q4_1")) return GGML_TYPE_Q4_1; if (!strcmp(s, "q5_0")) return GGML_TYPE_Q5_0;
    if (!strcmp(s, "q5_1")) return GGML_TYPE_Q5_1; fprintf(stderr, "type %s\n", s); exit(1); }
static void fill(struct ggml_tensor * t, const float * x, int64_t nrows, int64_t n) {
    if (t->type == GGML_TYPE_F16) { for (int64_t i = 0; i < nrows * n; i++) ((ggml_fp16_t *) t->data)[i] = ggml_fp32_to_fp16(x[i]); }
    else if (t->type == GGML_TYPE_BF16) { for (int64_t i = 0; i < nrows * n; i++) ((ggml_bf16_t *) t->data)[i] = ggml_fp32_to_bf16(x[i]); }
    else ggml_quantize_chunk(t->type, x, t->data, 0, nrows, n, NULL);
}
int main(int argc, char ** argv) {
    if (argc != 14) { fprintf(stderr, "usage\n"); return 1; }
    int D = atoi(argv[1]), nq = atoi(argv[2]), nkv = atoi(argv[3]), H = atoi(argv[4]), Hkv = atoi(argv[5]);
    enum ggml_type kt = ty(argv[6]), vt = ty(argv[7]); float scale = atof(argv[8]);
    float * q = rd(argv[9], (size_t) H * nq * D), * k = rd(argv[10], (size_t) Hkv * nkv * D), * v = rd(argv[11], (size_t) Hkv * nkv * D);
    float * m = rd(argv[12], (size_t) nq * nkv);
    struct ggml_init_params ip = { (size_t) 2 << 30, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * Q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, nq, H, 1);
    struct ggml_tensor * K = ggml_new_tensor_4d(ctx, kt, D, nkv, Hkv, 1);
    struct ggml_tensor * V = ggml_new_tensor_4d(ctx, vt, D, nkv, Hkv, 1);
    struct ggml_tensor * M = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, nkv, nq, 1, 1);
    memcpy(Q->data, q, (size_t) H * nq * D * 4);
    fill(K, k, (int64_t) Hkv * nkv, D); fill(V, v, (int64_t) Hkv * nkv, D);
    for (size_t i = 0; i < (size_t) nq * nkv; i++) ((ggml_fp16_t *) M->data)[i] = ggml_fp32_to_fp16(m[i]);
    struct ggml_tensor * O = ggml_flash_attn_ext(ctx, Q, K, V, M, scale, 0.0f, 0.0f);
    ggml_prec_set_acc(O, GGML_PREC_F32);  // as llama-graph does; the CPU one-chunk path ignores it
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, O);
    ggml_graph_compute_with_ctx(ctx, gf, 1);
    FILE * f = fopen(argv[13], "wb"); fwrite(O->data, 4, ggml_nelements(O), f); fclose(f);
    return 0;
}
