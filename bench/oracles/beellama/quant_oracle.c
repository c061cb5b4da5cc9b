// quant_oracle: run BeeLlama's own CPU KV-cache quantizers on float32 rows from a file.
//
// Our harness (not BeeLlama code). It is compiled against an already-built BeeLlama
// (headers from $BEELLAMA_SRC, libggml-base / libggml-cpu / libggml from $BEELLAMA_BUILD/bin)
// by bench/oracles/beellama/quant_oracle.py and calls only ggml's public API:
//
//   quant_oracle blocks <ggml type name> <n_per_row> <in.f32> <out.bin>
//       every row of n_per_row floats through ggml_get_type_traits_cpu(type)->from_float,
//       the function ggml's CPU SET_ROWS uses to write a quantized KV cache row.
//   quant_oracle kvarn <bits> <k|v> <head_dim> <n_heads> <iters> <in.f32> <out.bin>
//       in.f32: [n_tokens][n_heads][head_dim] float32 (n_tokens a multiple of 128).
//       One GGML_OP_KVARN_STORE node (ggml_kvarn_store, the op BeeLlama's KVarN cache
//       builds for every layer) run by the CPU backend with the cache's own op params:
//       head-wide Hadamard over head_dim/128 slices, fp16 stage, one record per
//       (group, head, slice) written when the group's last token arrives. SWA ring mode
//       (op param 4) is used so that group 0 is quantized too (a full-attention layer keeps
//       group 0 as its exact sink and never quantizes it); the per-tile arithmetic is the
//       same function in both modes.
//       out.bin: [n_groups][n_heads * slices][payload | scale[128] | zero[128] | other[128]].
#include "ggml.h"
#include "ggml-cpu.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void die(const char * msg, const char * what) {
    fprintf(stderr, "quant_oracle: %s%s%s\n", msg, what ? ": " : "", what ? what : "");
    exit(2);
}

static float * read_f32(const char * path, size_t * n) {
    FILE * f = fopen(path, "rb");
    if (!f) die("cannot open input", path);
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    if (sz < 0 || sz % 4) die("input size is not a whole number of float32", path);
    float * x = malloc(sz ? (size_t) sz : 1);
    if (fread(x, 1, (size_t) sz, f) != (size_t) sz) die("short read", path);
    fclose(f);
    *n = (size_t) sz / 4;
    return x;
}

static void write_all(const char * path, const void * data, size_t n) {
    FILE * f = fopen(path, "wb");
    if (!f) die("cannot open output", path);
    if (fwrite(data, 1, n, f) != n) die("short write", path);
    fclose(f);
}

static enum ggml_type type_by_name(const char * name) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * tn = ggml_type_name((enum ggml_type) t);
        if (tn && strcmp(tn, name) == 0) return (enum ggml_type) t;
    }
    die("unknown ggml type", name);
    return GGML_TYPE_COUNT;
}

static int run_blocks(int argc, char ** argv) {
    if (argc != 6) die("usage: blocks <type> <n_per_row> <in.f32> <out.bin>", NULL);
    const enum ggml_type type = type_by_name(argv[2]);
    const int64_t n_per_row = atoll(argv[3]);
    const struct ggml_type_traits_cpu * cpu = ggml_get_type_traits_cpu(type);
    if (!cpu || !cpu->from_float) die("type has no CPU from_float", argv[2]);
    if (n_per_row <= 0 || n_per_row % ggml_blck_size(type)) die("n_per_row is not a multiple of the block size", argv[3]);
    size_t n;
    float * x = read_f32(argv[4], &n);
    if (n % (size_t) n_per_row) die("input is not a whole number of rows", argv[4]);
    const size_t rows = n / (size_t) n_per_row, row_bytes = ggml_row_size(type, n_per_row);
    uint8_t * y = calloc(rows * row_bytes + 1, 1);
    for (size_t r = 0; r < rows; ++r) cpu->from_float(x + r * n_per_row, y + r * row_bytes, n_per_row);
    write_all(argv[5], y, rows * row_bytes);
    free(x); free(y);
    return 0;
}

static int run_kvarn(int argc, char ** argv) {
    if (argc != 9) die("usage: kvarn <bits> <k|v> <head_dim> <n_heads> <iters> <in.f32> <out.bin>", NULL);
    const int bits = atoi(argv[2]);
    const int value = argv[3][0] == 'v';
    const int head_dim = atoi(argv[4]), n_heads = atoi(argv[5]), iters = atoi(argv[6]);
    if (head_dim != 128 && head_dim != 256 && head_dim != 512) die("head_dim must be 128, 256 or 512", argv[4]);
    const int slices = head_dim / 128, n_rows = n_heads * slices;
    size_t n;
    float * x = read_f32(argv[7], &n);
    if (n % ((size_t) head_dim * n_heads)) die("input is not [n_tokens][n_heads][head_dim]", argv[7]);
    const int64_t n_tokens = (int64_t) (n / ((size_t) head_dim * n_heads));
    if (n_tokens % 128) die("n_tokens must be a multiple of 128", argv[7]);
    const int64_t n_groups = n_tokens / 128;
    const int stage_groups = 2;
    const int64_t payload = (128 * 128 * (int64_t) bits + 7) / 8, rec = payload + 3 * 128 * 2;

    struct ggml_init_params ip = {
        .mem_size = (size_t) (n * 4 + 128 * n_rows * 128 * stage_groups * 2 + rec * n_rows * n_groups + n_tokens * 8) + (64u << 20),
        .mem_buffer = NULL, .no_alloc = false,
    };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * cur = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 128, n_rows, n_tokens);
    struct ggml_tensor * idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens);
    struct ggml_tensor * stage = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, 128, n_rows, 128 * stage_groups);
    struct ggml_tensor * records = ggml_new_tensor_3d(ctx, GGML_TYPE_I8, rec, n_rows, n_groups);
    memcpy(cur->data, x, n * 4);  // [tokens][heads][head_dim] == [tokens][heads*slices][128]
    for (int64_t t = 0; t < n_tokens; ++t) ((int64_t *) idx->data)[t] = t;
    memset(stage->data, 0, ggml_nbytes(stage));
    memset(records->data, 0, ggml_nbytes(records));

    struct ggml_tensor * out = ggml_kvarn_store(ctx, cur, idx, stage, records, bits, iters, value, stage_groups);
    out->op_params[3] = (int32_t) n_tokens;  // tokens-per-stream hint, as the cache sets it
    out->op_params[4] = 1;                   // SWA ring: group 0 is quantized too
    out->op_params[5] = slices;              // head-wide Hadamard over `slices` 128-slices
    out->op_params[8] = 1;                   // tail groups (unused with eager records)
    out->op_params[9] = 1;                   // eager records: quantize at a group's last token
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    if (ggml_graph_compute_with_ctx(ctx, gf, 1) != GGML_STATUS_SUCCESS) die("graph compute failed", NULL);
    write_all(argv[8], records->data, ggml_nbytes(records));
    ggml_free(ctx);
    free(x);
    return 0;
}

int main(int argc, char ** argv) {
    ggml_cpu_init();
    if (argc >= 2 && strcmp(argv[1], "blocks") == 0) return run_blocks(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "kvarn") == 0) return run_kvarn(argc, argv);
    die("usage: quant_oracle blocks|kvarn ...", NULL);
    return 2;
}
