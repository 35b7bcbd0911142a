// llamacpp-logits: llama.cpp's logits after every position of a token list, teacher-forced
// in one batch, as little-endian f32 rows (n_tokens x n_vocab) on standard output. Built and
// run by scripts/logits-vs-llamacpp.sh against the llama.cpp that scripts/bench-llamacpp.sh
// builds; not part of CI.
//
// Usage: llamacpp-logits MODEL.gguf THREADS TOKEN [TOKEN ...] > logits.f32
#include <stdio.h>
#include <stdlib.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char *text, void *data) {
    (void)data;
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf THREADS TOKEN [TOKEN ...]\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    int n = argc - 3;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n + 16;
    cp.n_batch = n;
    cp.n_ubatch = n;
    cp.n_threads = cp.n_threads_batch = atoi(argv[2]);
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot make a context\n");
        return 1;
    }
    struct llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = (llama_token)atoi(argv[3 + i]);
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "llama_decode failed\n");
        return 1;
    }
    int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (int i = 0; i < n; i++) {
        const float *row = llama_get_logits_ith(ctx, i);
        if (!row || fwrite(row, sizeof(float), (size_t)vocab, stdout) != (size_t)vocab) {
            fprintf(stderr, "no logits for position %d\n", i);
            return 1;
        }
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
