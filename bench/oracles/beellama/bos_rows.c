// BeeLlama's (llama.cpp's) post-RoPE K and V rows of one position, as its graph computes them before
// the cache rotates and rounds them: the `Kcur-L` / `Vcur-L` nodes, read with the scheduler's eval
// callback on the first ubatch of a text; and that position's MLP nodes (NODES). Used by bos_rows.py (issue 21, round 5); built by it with
//   cc -O2 bos_rows.c -I$BEELLAMA_SRC/include -I$BEELLAMA_SRC/ggml/include -L$BEELLAMA_BUILD/bin -lllama -lggml -lggml-base
// Usage: bos_rows MODEL.gguf TEXT N_TOKENS POSITION OUT.txt CACHE_TYPE TAIL
//   CACHE_TYPE: f16 | bf16 | q4_0 (K and V, rotated as llama.cpp rotates a quantized cache), TAIL: as
//   --kv-tail-tokens (0: none). The rows of layer L > 0 depend on what the layers before read back
//   for the position itself, so the cache must be the run's.
// Writes one line per node: "<name> <n values> v0 v1 ..." (%.9g: every fp32 value exactly).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "llama.h"

static FILE * out;
static int position;

// gemma3's names (src/models/gemma3.cpp, llama-graph.cpp build_ffn): post-RoPE K and V, and BOS's
// path through the MLP (its input, gate and up projections, GELU·up before the down projection
// rounds it, the MLP's output, the layer's output)
static const char * NODES[] = {"Kcur-", "Vcur-", "ffn_norm-", "ffn_gate-", "ffn_up-", "ffn_geglu-", "ffn_out-", "l_out-", NULL};

static int wanted(const char * name) {  // exactly "<node>-<layer>" (not a view of it)
    for (int i = 0; NODES[i]; ++i) {
        const size_t l = strlen(NODES[i]);
        if (strncmp(name, NODES[i], l) == 0 && name[l] != '\0' && strspn(name + l, "0123456789") == strlen(name + l)) {
            return 1;
        }
    }
    return 0;
}

static void write_row(const char * name, const float * row, size_t n) {
    fprintf(out, "%s %zu", name, n);
    for (size_t i = 0; i < n; ++i) {
        fprintf(out, " %.9g", row[i]);
    }
    fprintf(out, "\n");
}

static bool cb(struct ggml_tensor * t, bool ask, void * user) {
    (void) user;
    if (ask) {
        return wanted(t->name);
    }
    if (!wanted(t->name) || t->type != GGML_TYPE_F32 || t->ne[3] != 1) {
        return true;
    }
    if (t->ne[2] == 1 && t->ne[1] > position) {  // [n, n_tokens]: one row per token
        float * row = malloc(t->ne[0] * sizeof(float));
        ggml_backend_tensor_get(t, row, (size_t) position * t->nb[1], t->ne[0] * sizeof(float));
        write_row(t->name, row, t->ne[0]);
        free(row);
    } else if (t->ne[2] > position) {  // Kcur/Vcur: [head_dim, n_head_kv, n_tokens]
        const size_t n = (size_t) t->ne[0] * t->ne[1];
        float * row = malloc(n * sizeof(float));
        for (int64_t h = 0; h < t->ne[1]; ++h) {
            ggml_backend_tensor_get(t, row + h * t->ne[0], h * t->nb[1] + (size_t) position * t->nb[2],
                                    t->ne[0] * sizeof(float));
        }
        write_row(t->name, row, n);
        free(row);
    }
    return true;
}

int main(int argc, char ** argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s MODEL.gguf TEXT N_TOKENS POSITION OUT.txt CACHE_TYPE TAIL\n", argv[0]);
        return 2;
    }
    enum ggml_type type;
    if (strcmp(argv[6], "f16") == 0) {
        type = GGML_TYPE_F16;
    } else if (strcmp(argv[6], "bf16") == 0) {
        type = GGML_TYPE_BF16;
    } else if (strcmp(argv[6], "q4_0") == 0) {
        type = GGML_TYPE_Q4_0;
    } else {
        fprintf(stderr, "CACHE_TYPE %s: accepted f16, bf16, q4_0\n", argv[6]);
        return 2;
    }
    const int n_tokens = atoi(argv[3]);
    position = atoi(argv[4]);
    if (n_tokens < 1 || position < 0 || position >= n_tokens) {
        fprintf(stderr, "N_TOKENS %s must be >= 1 and POSITION %s in 0..N_TOKENS-1\n", argv[3], argv[4]);
        return 2;
    }
    FILE * f = fopen(argv[2], "rb");
    if (!f) {
        fprintf(stderr, "cannot read %s\n", argv[2]);
        return 1;
    }
    const size_t cap = 64 * (size_t) n_tokens + 4096;  // bytes enough for n_tokens tokens
    char * text = calloc(cap + 1, 1);
    const size_t len = fread(text, 1, cap, f);
    fclose(f);
    out = fopen(argv[5], "w");
    if (!out) {
        fprintf(stderr, "cannot write %s\n", argv[5]);
        return 1;
    }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        return 1;
    }
    llama_token * tok = malloc(sizeof(llama_token) * (len + 2));
    const int n = llama_tokenize(llama_model_get_vocab(model), text, (int) len, tok, (int) len + 2, true, false);
    if (n < n_tokens) {
        fprintf(stderr, "the text has %d tokens, fewer than %d\n", n, n_tokens);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_tokens;
    cp.n_batch = cp.n_ubatch = n_tokens;
    cp.n_threads = cp.n_threads_batch = 1;
    cp.cb_eval = cb;
    cp.cb_eval_user_data = NULL;
    cp.type_k = cp.type_v = type;
    struct llama_kv_tail_request * tail = NULL;
    if (strcmp(argv[7], "0") != 0) {  // as llama-perplexity's --kv-tail-tokens (common_init_result)
        tail = llama_kv_tail_request_init(argv[7], GGML_TYPE_COUNT);
        if (llama_kv_tail_request_last_error(tail)[0] != '\0') {
            fprintf(stderr, "TAIL %s: %s\n", argv[7], llama_kv_tail_request_last_error(tail));
            return 2;
        }
        cp.kv_tail_tokens = 0;
        cp.kv_tail_request = tail;
    }
    struct llama_context * ctx = llama_init_from_model(model, cp);
    // logits for every token, as llama-perplexity asks: the last layer then computes every row
    // (with one output, llama.cpp keeps only the last token's rows there)
    struct llama_batch batch = llama_batch_init(n_tokens, 0, 1);
    for (int i = 0; i < n_tokens; ++i) {
        batch.token[i] = tok[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n_tokens;
    if (!ctx || llama_decode(ctx, batch)) {
        fprintf(stderr, "decode failed\n");
        return 1;
    }
    fprintf(stderr, "token[0] = %d, %d tokens decoded\n", tok[0], n_tokens);
    fclose(out);
    llama_batch_free(batch);
    llama_kv_tail_request_free(tail);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
