// kvarn-kld: llama-perplexity's KL-divergence protocol, run by a llama.cpp build, with per-token
// records and streamed logits (kvarn.llamacpp_engine.runner drives it; docs/notes/program-engine.md).
//
// It is compiled against the build it measures (its headers, libcommon and libllama:
// kvarn.llamacpp_engine.build.harness), so the model, the context, the cache types, the tail, the
// threads and every other option are the build's own: the arguments after ours are parsed by
// the build's own llama-perplexity argument parser (common_params_parse, LLAMA_EXAMPLE_PERPLEXITY)
// and the model and context are made by its common_init_from_params, as in llama-perplexity.
// What differs from tools/perplexity/perplexity.cpp:
//   * each batch's output logits are scored as soon as the batch is decoded (host memory
//     O(n_batch x vocab), the context's own output buffer, instead of O(n_ctx x vocab));
//   * every scored token's numbers are written to --kvarn-records (TSV);
//   * one sequence per batch (n_batch <= n_ctx: kvarn.llamacpp_engine.runner sets -b), as the study ran.
// The arithmetic of a row is llama-perplexity's: the base row's uint16 encoding (its
// log_softmax writer) and the KLD/NLL/dp/same-top of its kl_divergence reader, in the same
// float/double types, so a record summed as llama.cpp sums it prints what llama-perplexity prints.
//
//   kvarn-kld --kvarn-mode base --kvarn-records base.tsv  -m M.gguf -f wiki.test.raw -c N --chunks C \
//             --kl-divergence-base base.kld [llama-perplexity options]
//   kvarn-kld --kvarn-mode cell --kvarn-records cell.tsv  -m M.gguf -c N --kl-divergence-base base.kld \
//             --kl-divergence -ctk q4_0 -ctv q4_0 [llama-perplexity options]

#include "arg.h"
#include "common.h"
#include "llama.h"
#if __has_include("fit.h")  // newer builds: common_memory_breakdown_print lives here
#include "fit.h"
#define KVARN_MEMORY_BREAKDOWN 1
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {

// llama-perplexity's KLD base file: this header ("_logits_", then n_ctx, n_vocab and n_chunk as 4-byte
// integers), the tokens of every chunk, then per chunk the scored positions' uint16 log-prob rows.
constexpr size_t BASE_HEADER_BYTES = 8 + 3 * sizeof(uint32_t);

struct record {
    double kld = 0;       // KLD(base || Q) over the base entries above -16 nats
    float nll = 0;        // -log p_Q(next token)
    float nll_base = 0;   // -log p_base(next token), decoded from the base row
    float dp = 0;         // p_Q - p_base of the next token
    int same_top = 0;     // argmax of Q == argmax of base
};

int nearest_int(float fval) {  // ggml's round-to-nearest of a float in [0, 2^22)
    float val = fval + 12582912.f;
    int i;
    std::memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

// The base row of one scored position (llama-perplexity's uint16 writer): [scale f32, floor f32,
// codes u16 x n_vocab, pad]. Returns the NLL of `tok`.
double encode_row(int n_vocab, const float * logits, uint16_t * row, int tok) {
    float max_logit = logits[0], min_logit = logits[0];
    for (int i = 1; i < n_vocab; ++i) {
        max_logit = std::max(max_logit, logits[i]);
        min_logit = std::min(min_logit, logits[i]);
    }
    min_logit = std::max(min_logit, max_logit - 16);
    double sum_exp = 0.0;
    for (int i = 0; i < n_vocab; ++i) {
        sum_exp += expf(logits[i] - max_logit);
    }
    const float log_sum_exp = log(sum_exp);
    const float floor_lp = min_logit - max_logit - log_sum_exp;
    const float scale = (max_logit - min_logit) / 65535.f;
    float head[2] = {scale, floor_lp};
    std::memcpy(row, head, sizeof(head));
    uint16_t * codes = row + 4;
    if (scale) {
        const float inv = 1 / scale;
        for (int i = 0; i < n_vocab; ++i) {
            codes[i] = logits[i] > min_logit ? nearest_int(inv * (logits[i] - min_logit)) : 0;
        }
    } else {
        std::memset(codes, 0, n_vocab * sizeof(uint16_t));
    }
    return max_logit + log_sum_exp - logits[tok];
}

// One scored position against its base row (llama-perplexity's kl_divergence arithmetic).
record score_row(int n_vocab, const float * logits, const uint16_t * row, int tok) {
    record r;
    float max_logit = logits[0];
    int imax = 0;
    for (int i = 1; i < n_vocab; ++i) {
        if (logits[i] > max_logit) {
            max_logit = logits[i];
            imax = i;
        }
    }
    double sum_exp = 0.0;
    for (int i = 0; i < n_vocab; ++i) {
        sum_exp += expf(logits[i] - max_logit);
    }
    const float log_sum_exp = log(sum_exp);
    float head[2];
    std::memcpy(head, row, sizeof(head));
    const float scale = head[0], floor_lp = head[1];
    const uint16_t * codes = row + 4;
    r.nll = max_logit + log_sum_exp - logits[tok];
    r.nll_base = -(scale * codes[tok] + floor_lp);
    max_logit += log_sum_exp;
    double sum = 0;
    int imax_base = -1;
    float lp_base_max = 0;
    for (int i = 0; i < n_vocab; ++i) {
        const float lp_base = scale * codes[i] + floor_lp;
        if (i == 0 || lp_base > lp_base_max) {
            lp_base_max = lp_base;
            imax_base = i;
        }
        if (lp_base > -16.f) {
            const float p_base = expf(lp_base);
            sum += p_base * (lp_base - logits[i] + max_logit);
        }
    }
    r.kld = sum;
    r.same_top = imax == imax_base;
    r.dp = expf(-r.nll) - expf(-r.nll_base);
    return r;
}

// f(i) for i in [0, n) on `n_threads` threads (each row is computed by one thread: the result
// does not depend on the thread count).
template <class F> void parallel_rows(int n, int n_threads, F f) {
    n_threads = std::max(1, std::min(n_threads, n));
    std::vector<std::thread> pool;
    for (int t = 0; t < n_threads; ++t) {
        pool.emplace_back([=, &f] {
            for (int i = t; i < n; i += n_threads) f(i);
        });
    }
    for (auto & th : pool) th.join();
}

template <class R> llama_model * init_model(R & r) {
    if constexpr (requires { r->model(); }) return r->model(); else return r.model.get();
}
template <class R> llama_context * init_context(R & r) {
    if constexpr (requires { r->context(); }) return r->context(); else return r.context.get();
}

int fail(const char * msg, const std::string & what = "") {
    fprintf(stderr, "kvarn-kld: error: %s%s\n", msg, what.c_str());
    return 1;
}

}  // namespace

int main(int argc, char ** argv) {
    std::string mode, records_path;
    std::vector<char *> rest = {argv[0]};
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if ((a == "--kvarn-mode" || a == "--kvarn-records") && i + 1 < argc) {
            (a == "--kvarn-mode" ? mode : records_path) = argv[++i];
        } else {
            rest.push_back(argv[i]);
        }
    }
    if (mode != "base" && mode != "cell") return fail("--kvarn-mode must be base or cell, got ", "'" + mode + "'");
    if (records_path.empty()) return fail("--kvarn-records FILE is required");

    common_params params;
    params.n_ctx = 512;
    params.escape = false;
    common_init();
    if (!common_params_parse((int) rest.size(), rest.data(), params, LLAMA_EXAMPLE_PERPLEXITY)) return 1;
    if (params.logits_file.empty()) return fail("--kl-divergence-base FILE is required");
    if ((mode == "cell") != params.kl_divergence) return fail("--kl-divergence goes with --kvarn-mode cell, and only there");
    const int n_ctx = params.n_ctx;
    if (n_ctx < 4 || n_ctx % 2) return fail("-c must be an even number >= 4, got ", std::to_string(n_ctx));
    if (params.n_batch > n_ctx) params.n_batch = n_ctx;  // one sequence per batch
    params.n_parallel = 1;

    llama_backend_init();
    llama_numa_init(params.numa);
    auto init = common_init_from_params(params);
    llama_model * model = init_model(init);
    llama_context * ctx = init_context(init);
    if (model == nullptr || ctx == nullptr) return fail("the build could not load the model or make its context");
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const bool add_bos = llama_vocab_get_add_bos(vocab);
    const int n_batch = std::min<int>(params.n_batch, llama_n_batch(ctx));
    const int n_threads = std::max(1, (int) params.cpuparams.n_threads);
    const int first = n_ctx / 2, n_scored = n_ctx - 1 - first;
    const size_t nv = 2 * ((n_vocab + 1) / 2) + 4;
    fprintf(stderr, "kvarn-kld: %s, n_ctx %d, n_batch %d, n_ubatch %u, vocab %d, threads %d\n", mode.c_str(), n_ctx,
            n_batch, llama_n_ubatch(ctx), n_vocab, n_threads);

    // The tokens and the chunk count: from the text (base) or from the base file (cell).
    std::vector<llama_token> tokens;
    int n_chunk = 0;
    std::fstream base;
    if (mode == "base") {
        tokens = common_tokenize(ctx, params.prompt, true);
        if ((int) tokens.size() < 2 * n_ctx) return fail("the text tokenizes to fewer than 2 x n_ctx tokens");
        const int n_max = tokens.size() / n_ctx;
        n_chunk = params.n_chunks < 0 ? n_max : std::min(params.n_chunks, n_max);
        base.open(params.logits_file, std::ios::out | std::ios::binary | std::ios::trunc);
        if (!base) return fail("cannot write ", params.logits_file);
        const uint32_t n_ctx_u = n_ctx;
        base.write("_logits_", 8);
        base.write((const char *) &n_ctx_u, sizeof(n_ctx_u));
        base.write((const char *) &n_vocab, sizeof(n_vocab));
        base.write((const char *) &n_chunk, sizeof(n_chunk));
        base.write((const char *) tokens.data(), size_t(n_chunk) * n_ctx * sizeof(llama_token));
    } else {
        base.open(params.logits_file, std::ios::in | std::ios::binary);
        if (!base) return fail("cannot read ", params.logits_file);
        char magic[8];
        uint32_t f_ctx = 0;
        int f_vocab = 0;
        base.read(magic, 8).read((char *) &f_ctx, 4).read((char *) &f_vocab, 4).read((char *) &n_chunk, 4);
        if (!base || std::memcmp(magic, "_logits_", 8) != 0) return fail("not a KLD base file: ", params.logits_file);
        if ((int) f_ctx != n_ctx) return fail("the base file's n_ctx differs from -c: ", std::to_string(f_ctx));
        if (f_vocab != n_vocab) return fail("the base file's vocabulary differs from the model's: ", std::to_string(f_vocab));
        tokens.resize(size_t(n_chunk) * n_ctx);
        base.read((char *) tokens.data(), tokens.size() * sizeof(llama_token));
        if (!base) return fail("truncated base file: ", params.logits_file);
        if (params.n_chunks > 0) n_chunk = std::min(n_chunk, params.n_chunks);
    }

    FILE * out = fopen(records_path.c_str(), "w");
    if (out == nullptr) return fail("cannot write ", records_path);
    fprintf(out, mode == "base" ? "chunk\tpos\tnll\n" : "chunk\tpos\tkld\tnll\tnll_base\tdp\tsame_top\n");

    llama_batch batch = llama_batch_init(n_batch, 0, 1);
    std::vector<uint16_t> rows;  // the base rows of one batch's outputs
    std::vector<record> recs;
    std::vector<double> nlls;
    double decode_s_total = 0;
    for (int c = 0; c < n_chunk; ++c) {
        const llama_token * chunk = tokens.data() + size_t(c) * n_ctx;
        llama_memory_clear(llama_get_memory(ctx), true);
        double decode_s = 0;
        for (int b0 = 0; b0 < n_ctx; b0 += n_batch) {
            const int n = std::min(n_batch, n_ctx - b0);
            batch.n_tokens = n;
            int n_out = 0;
            for (int k = 0; k < n; ++k) {
                const int pos = b0 + k;
                batch.token[k] = (pos == 0 && add_bos) ? llama_vocab_bos(vocab) : chunk[pos];
                batch.pos[k] = pos;
                batch.n_seq_id[k] = 1;
                batch.seq_id[k][0] = 0;
                batch.logits[k] = pos >= first;
                n_out += pos >= first;
            }
            const auto t0 = std::chrono::steady_clock::now();
            if (llama_decode(ctx, batch) != 0) return fail("llama_decode failed in chunk ", std::to_string(c));
            llama_synchronize(ctx);
            decode_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            // scored outputs of this batch: positions p in [max(b0, first), b0 + n), rows p - first,
            // excluding the last position of the chunk (nothing to predict)
            const int p0 = std::max(b0, first), p1 = std::min(b0 + n, n_ctx - 1);
            if (p1 <= p0) continue;
            const int m = p1 - p0;
            std::vector<const float *> logits(m);  // by batch index: llama.cpp maps it to its output row
            for (int i = 0; i < m; ++i) {
                logits[i] = llama_get_logits_ith(ctx, p0 - b0 + i);
                if (logits[i] == nullptr) return fail("no logits at position ", std::to_string(p0 + i));
            }
            rows.resize(size_t(m) * nv);
            if (mode == "base") {
                nlls.assign(m, 0.0);
                parallel_rows(m, n_threads, [&](int i) {
                    nlls[i] = encode_row(n_vocab, logits[i], rows.data() + i * nv, chunk[p0 + i + 1]);
                });
                base.write((const char *) rows.data(), rows.size() * sizeof(uint16_t));
                for (int i = 0; i < m; ++i) fprintf(out, "%d\t%d\t%.9g\n", c, p0 + i, nlls[i]);
            } else {
                const size_t at = BASE_HEADER_BYTES + tokens.size() * sizeof(llama_token)
                                  + (size_t(c) * n_scored + (p0 - first)) * nv * sizeof(uint16_t);
                base.seekg(at).read((char *) rows.data(), rows.size() * sizeof(uint16_t));
                if (!base) return fail("truncated base file at chunk ", std::to_string(c));
                recs.assign(m, record());
                parallel_rows(m, n_threads, [&](int i) {
                    recs[i] = score_row(n_vocab, logits[i], rows.data() + i * nv, chunk[p0 + i + 1]);
                });
                for (int i = 0; i < m; ++i) {
                    const record & r = recs[i];
                    fprintf(out, "%d\t%d\t%.17g\t%.9g\t%.9g\t%.9g\t%d\n", c, p0 + i, r.kld, r.nll, r.nll_base, r.dp,
                            r.same_top);
                }
            }
        }
        decode_s_total += decode_s;
        fprintf(stderr, "kvarn-kld: chunk %d/%d decoded in %.3f s (%.2f tokens/s)\n", c + 1, n_chunk, decode_s,
                n_ctx / decode_s);
    }
    llama_batch_free(batch);
    if (fclose(out) != 0) return fail("cannot finish ", records_path);
    if (mode == "base") {
        base.flush();
        if (!base) return fail("cannot finish ", params.logits_file);
    }
    fprintf(stderr, "kvarn-kld: decode total %.3f s over %d chunks\n", decode_s_total, n_chunk);
    llama_perf_context_print(ctx);
#ifdef KVARN_MEMORY_BREAKDOWN
    common_memory_breakdown_print(ctx);
#endif
    llama_backend_free();
    return 0;
}
