// llama.cpp's own intermediate tensors of chunk 1 of a llama-perplexity KLD run, through the
// scheduler's eval callback: what bench/oracles/llamacpp/sink.py compares kvarn with (issue 13).
// Runs the chunk as kl_divergence() does (tokens from the --kl-divergence-base file, BOS at
// position 0, n_batch 2048, n_ubatch 512, flash attention on, no weight repacking, outputs
// for the second half), stopping after the first N_TOKENS. Every node named NAME-LAYER
// (llama.cpp's cb() names: Qcur, Kcur, Vcur, kqv_out, ...) is appended, fp32, contiguous in
// ggml order (ne0 fastest), to OUTDIR/NAME-LAYER.OP.f32, one file per op because llama.cpp
// gives one name to several nodes (Kcur: MUL_MAT, RESHAPE, ROPE). Uses only llama.h / ggml.h
// of the llama.cpp build bench/oracles/llamacpp/perplexity.sh makes; built by bench/oracles/llamacpp/sink.py on first use.
// usage: dump MODEL BASE.KLD CTK CTV THREADS N_TOKENS OUTDIR LAYERS NAMES   (lists comma-separated)
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXW 4096
static char wanted[MAXW][64];
static int n_wanted;
static const char * outdir;

static int is_wanted(const char * name) {
    for (int i = 0; i < n_wanted; i++) if (!strcmp(wanted[i], name)) return 1;
    return 0;
}

static bool cb(struct ggml_tensor * t, bool ask, void * user) {
    (void) user;
    if (ask) return is_wanted(t->name);
    if (!is_wanted(t->name)) return true;
    if (t->type != GGML_TYPE_F32) { fprintf(stderr, "%s is %s, not dumped\n", t->name, ggml_type_name(t->type)); return true; }
    char * raw = malloc(ggml_nbytes(t));
    float * out = malloc(ggml_nelements(t) * sizeof(float));
    ggml_backend_tensor_get(t, raw, 0, ggml_nbytes(t));
    int64_t n = 0;
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++) for (int64_t i2 = 0; i2 < t->ne[2]; i2++)
    for (int64_t i1 = 0; i1 < t->ne[1]; i1++) for (int64_t i0 = 0; i0 < t->ne[0]; i0++)
        memcpy(out + n++, raw + i0*t->nb[0] + i1*t->nb[1] + i2*t->nb[2] + i3*t->nb[3], sizeof(float));
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.%s.f32", outdir, t->name, ggml_op_desc(t));
    FILE * f = fopen(path, "ab");
    if (!f || fwrite(out, sizeof(float), n, f) != (size_t) n) { fprintf(stderr, "write %s failed\n", path); exit(1); }
    fclose(f);
    free(raw); free(out);
    return true;
}

static enum ggml_type parse_type(const char * s) {
    for (int i = 0; i < GGML_TYPE_COUNT; i++) {
        const char * n = ggml_type_name((enum ggml_type) i);
        if (n && !strcmp(n, s)) return (enum ggml_type) i;
    }
    fprintf(stderr, "unknown cache type %s\n", s);
    exit(2);
}

int main(int argc, char ** argv) {
    if (argc != 10) { fprintf(stderr, "usage: dump MODEL BASE.KLD CTK CTV THREADS N_TOKENS OUTDIR LAYERS NAMES\n"); return 2; }
    outdir = argv[7];
    char layers[4096], names[4096];
    snprintf(layers, sizeof layers, "%s", argv[8]);
    char * sl;
    for (char * l = strtok_r(layers, ",", &sl); l; l = strtok_r(NULL, ",", &sl)) {
        snprintf(names, sizeof names, "%s", argv[9]);
        char * sn;
        for (char * n = strtok_r(names, ",", &sn); n; n = strtok_r(NULL, ",", &sn)) {
            if (n_wanted == MAXW) { fprintf(stderr, "too many tensors\n"); return 2; }
            snprintf(wanted[n_wanted++], 64, "%s-%s", n, l);
        }
    }

    FILE * f = fopen(argv[2], "rb");
    char magic[8];
    uint32_t n_ctx; int32_t n_vocab, n_chunk;
    if (!f || fread(magic, 1, 8, f) != 8 || strncmp(magic, "_logits_", 8) || fread(&n_ctx, 4, 1, f) != 1 ||
        fread(&n_vocab, 4, 1, f) != 1 || fread(&n_chunk, 4, 1, f) != 1) {
        fprintf(stderr, "%s is not a llama-perplexity --kl-divergence-base file\n", argv[2]);
        return 2;
    }
    llama_token * tokens = malloc(n_ctx * sizeof(llama_token));
    if (fread(tokens, sizeof(llama_token), n_ctx, f) != n_ctx) { fprintf(stderr, "short token list in %s\n", argv[2]); return 2; }
    fclose(f);
    int n_tokens = atoi(argv[6]);
    if (n_tokens <= 0 || n_tokens > (int) n_ctx) n_tokens = n_ctx;

    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = false;  // llama-perplexity -nr
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx; cp.n_batch = 2048; cp.n_ubatch = 512; cp.n_seq_max = 1; cp.swa_full = false;
    cp.n_threads = cp.n_threads_batch = atoi(argv[5]);
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cp.type_k = parse_type(argv[3]); cp.type_v = parse_type(argv[4]);
    cp.cb_eval = cb; cp.cb_eval_user_data = NULL;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create the context\n"); return 1; }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    if (llama_vocab_get_add_bos(vocab)) tokens[0] = llama_vocab_bos(vocab);
    const int n_batch = 2048, first = n_ctx / 2;
    struct llama_batch batch = llama_batch_init(n_batch, 0, 1);
    for (int start = 0; start < n_tokens; start += n_batch) {
        batch.n_tokens = 0;
        for (int p = start; p < start + n_batch && p < n_tokens; p++) {
            int i = batch.n_tokens++;
            batch.token[i] = tokens[p]; batch.pos[i] = p;
            batch.n_seq_id[i] = 1; batch.seq_id[i][0] = 0; batch.logits[i] = p >= first;
        }
        if (llama_decode(ctx, batch)) { fprintf(stderr, "llama_decode failed at position %d\n", start); return 1; }
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    free(tokens);
    return 0;
}
