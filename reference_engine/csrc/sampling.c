/* Sampling the next token from the last logits, in C: at 100 tokens/s a numpy softmax or
 * argpartition over a 262k vocabulary would cost a large share of each token's time.
 *
 * The steps and their order are llama.cpp's default chain: repetition penalties, top-k, top-p,
 * min-p, temperature, then a draw from the softmax. temp <= 0 is greedy: the argmax after the
 * penalties. The RNG (xoroshiro128**, its two words of state seeded through splitmix64) is ours,
 * so seeded draws are reproducible here but differ from llama.cpp's.
 */
#define _GNU_SOURCE
#define SE_ENGINE_INTERNAL
#include "engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* splitmix64: the next 64-bit output of the sequence seeded with *s (advances *s). */
static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* xoroshiro128** (Blackman and Vigna): two words of state, 64-bit outputs. */
static uint64_t xoroshiro128ss_next(uint64_t s[2]) {
    uint64_t s0 = s[0], s1 = s[1];
    uint64_t r = rotl(s0 * 5, 7) * 9;
    s1 ^= s0;
    s[0] = rotl(s0, 24) ^ s1 ^ (s1 << 16);
    s[1] = rotl(s1, 37);
    return r;
}

/* uniform in [0, 1) with 53 random bits */
static double rng_uniform(uint64_t s[2]) { return (double)(xoroshiro128ss_next(s) >> 11) * 0x1.0p-53; }

/* Seeds the context's xoroshiro128** state from seed (-1: from the clock and the context's address). */
static void rng_seed(se_context *c, int64_t seed) {
    uint64_t x;
    if (seed < 0) { /* -1: a different seed every time */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ (uint64_t)(uintptr_t)c;
    } else {
        x = (uint64_t)seed;
    }
    c->rng[0] = splitmix64(&x);
    c->rng[1] = splitmix64(&x);
    c->rng_seed = seed;
    c->rng_seeded = 1;
}

/* The candidates' order: higher logit first, the lower id first among equal logits. A total
 * order, so that the top k and their order do not depend on which other rows were looked at (a
 * screened head hands the sampler only its candidates, screen.c). */
static int cand_before(const se_cand *a, const se_cand *b) {
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

int se_cand_desc(const void *a, const void *b) {
    const se_cand *x = a, *y = b;
    return cand_before(y, x) - cand_before(x, y);
}

/* Min-heap in that order over h[0..k) (the root comes last): sift element i down. */
static void sift_down(se_cand *h, int32_t k, int32_t i) {
    for (;;) {
        int32_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < k && cand_before(&h[m], &h[l])) m = l;
        if (r < k && cand_before(&h[m], &h[r])) m = r;
        if (m == i) return;
        se_cand t = h[i]; h[i] = h[m]; h[m] = t;
        i = m;
    }
}

void se_cand_push(se_cand *h, int32_t k, int32_t *n, se_cand v) {
    if (*n < k) {
        int32_t i = (*n)++;
        h[i] = v;
        for (; i > 0 && cand_before(&h[(i - 1) / 2], &h[i]); i = (i - 1) / 2) {
            se_cand t = h[i]; h[i] = h[(i - 1) / 2]; h[(i - 1) / 2] = t;
        }
    } else if (cand_before(&v, &h[0])) {
        h[0] = v;
        sift_down(h, k, 0);
    }
}

/* Moves the k largest of cand[0..n) to cand[0..k), sorted by descending logit. */
static void top_k(se_cand *cand, int32_t n, int32_t k) {
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++) se_cand_push(cand, k, &m, cand[i]); /* i >= m: nothing unread is overwritten */
    qsort(cand, (size_t)k, sizeof *cand, se_cand_desc);
}

/* A key whose unsigned order is the candidates' order of logits, highest first: -0 is +0 (they
 * are equal logits), and NaN, which compares equal to nothing, comes last. */
static uint32_t desc_key(float x) {
    if (x != x) return UINT32_MAX;
    if (x == 0) x = 0;
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u & 0x80000000u ? u : ~u & 0x7fffffffu;
}

/* cand[0..n), in id order, into the candidates' order (what qsort with se_cand_desc gives) by a
 * stable radix sort on desc_key, 8 bits a pass, through tmp[0..n): equal logits keep their ids
 * ascending. A whole vocabulary (top-p without top-k) in a few passes over it, where qsort took
 * 23 ms for Gemma-3's 262144 rows (Xeon). */
static void sort_by_logit(se_cand *cand, int32_t n, se_cand *tmp) {
    uint32_t count[4][256] = {{0}};
    for (int32_t i = 0; i < n; i++) {
        const uint32_t k = desc_key(cand[i].logit);
        for (int b = 0; b < 4; b++) count[b][(k >> (8 * b)) & 255]++;
    }
    se_cand *src = cand, *dst = tmp;
    for (int b = 0; b < 4; b++) {
        if (count[b][(desc_key(src[0].logit) >> (8 * b)) & 255] == (uint32_t)n) continue; /* one digit: in order */
        uint32_t at[256], sum = 0;
        for (int d = 0; d < 256; d++) at[d] = sum, sum += count[b][d];
        for (int32_t i = 0; i < n; i++) dst[at[(desc_key(src[i].logit) >> (8 * b)) & 255]++] = src[i];
        se_cand *t = src; src = dst; dst = t;
    }
    if (src != cand) memcpy(cand, src, (size_t)n * sizeof *cand);
}

/* The largest of x[0..16), NaNs left out (-inf when there is nothing else). */
static float max16(const float *x) {
#if defined(__SSE2__)
    __m128 m = _mm_set1_ps(-INFINITY);
    for (int i = 0; i < 16; i += 4) m = _mm_max_ps(_mm_loadu_ps(x + i), m); /* a NaN x gives m */
    m = _mm_max_ps(_mm_shuffle_ps(m, m, 0x4E), m);
    m = _mm_max_ps(_mm_shuffle_ps(m, m, 0xB1), m);
    return _mm_cvtss_f32(m);
#else
    float m = -INFINITY;
    for (int i = 0; i < 16; i++)
        if (x[i] > m) m = x[i];
    return m;
#endif
}

/* The k rows of largest logit (the candidates' order) as a heap in h[0..k): every row offered in
 * id order as top_k does, except that once the heap is full, a run of 16 rows none of which is
 * above its least is passed over whole (no row of it would enter: equal logits with higher ids
 * come after). Reads the logits once, 16 at a time, with no copy. */
static int32_t top_rows(const float *x, int32_t V, int32_t k, se_cand *h) {
    int32_t n = 0, i = 0;
    for (; i < V && n < k; i++) se_cand_push(h, k, &n, (se_cand){ i, x[i] });
    for (; i < V && i % 16; i++) se_cand_push(h, k, &n, (se_cand){ i, x[i] });
    for (; i + 16 <= V; i += 16)
        if (!(max16(x + i) <= h[0].logit)) /* a NaN root lets every row be offered, as top_k does */
            for (int32_t j = i; j < i + 16; j++) se_cand_push(h, k, &n, (se_cand){ j, x[j] });
    for (; i < V; i++) se_cand_push(h, k, &n, (se_cand){ i, x[i] });
    return n;
}

/* For a sampler that keeps only the top k (greedy: k = 1), the candidates that can be in it,
 * with their penalized logits, without a copy of the whole vocabulary: the k + |S| rows of
 * largest raw logit, where S is the tokens whose logit the penalties (the window's) or the ban
 * change, then S with their new logits instead. A token outside S in the top k has fewer than k
 * tokens outside S above it, so it is among those rows. Returns their count (at least k), in
 * no particular order; -1 when S is too large for it to pay. */
static int32_t top_candidates(se_context *c, const se_sampling_params *sp, int32_t window, int32_t k) {
    const int32_t V = c->m->hp.n_vocab;
    const float *x = c->logits;
    const int32_t *hist = c->tokens + (c->n_past - window);
    const int64_t m = (int64_t)k + window + c->n_ban;
    if (m > V / 4) return -1;
    se_cand *cand = c->cand;
    int32_t n = top_rows(x, V, (int32_t)m, cand);
    /* counts marks S: the window's tokens by their occurrences, a banned token by one more */
    for (int32_t i = 0; i < window; i++) c->counts[hist[i]]++;
    for (int32_t i = 0; i < c->n_ban; i++) c->counts[c->ban[i]]++;
    int32_t kept = 0;
    for (int32_t i = 0; i < n; i++)
        if (!c->counts[cand[i].id]) cand[kept++] = cand[i];
    for (int32_t i = 0; i < c->n_ban; i++) { /* banned: -inf, whatever the penalties */
        cand[kept++] = (se_cand){ c->ban[i], -INFINITY };
        c->counts[c->ban[i]] = 0;
    }
    for (int32_t i = 0; i < window; i++) {
        int32_t tok = hist[i];
        if (c->counts[tok] == 0) continue; /* banned, or already done (a repeated token) */
        cand[kept++] = (se_cand){ tok, se_penalized(x[tok], c->counts[tok], sp) };
        c->counts[tok] = 0;
    }
    return kept;
}

int se_cmp_i32(const void *x, const void *y) {
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return (a > b) - (a < b);
}

int se_context_set_banned(se_context *c, const int32_t *ids, int32_t n) {
    if (!c || n < 0 || (n > 0 && !ids)) return SE_ERR_INVALID;
    for (int32_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= c->m->hp.n_vocab) return SE_ERR_BAD_TOKEN;
    int32_t *ban = NULL, m = 0;
    if (n) {
        if (!(ban = malloc((size_t)n * sizeof(int32_t)))) return SE_ERR_NOMEM;
        memcpy(ban, ids, (size_t)n * sizeof(int32_t));
        qsort(ban, (size_t)n, sizeof *ban, se_cmp_i32);
    }
    for (int32_t i = 0; i < n; i++) /* each once */
        if (m == 0 || ban[m - 1] != ban[i]) ban[m++] = ban[i];
    free(c->ban);
    c->ban = ban;
    c->n_ban = m;
    return SE_OK;
}

/* top-k, top-p and min-p, in llama.cpp's order, on the n candidates in c->cand: returns how many
 * are left at its front (sorted in the candidates' order where top-k or top-p ran; screen.c's
 * screened_survivors gives the same from the screened rows) */
static int32_t truncate(se_context *c, const se_sampling_params *sp, int32_t n) {
    se_cand *cand = c->cand;
    const int32_t V = c->m->hp.n_vocab;
    /* top-k (sorted descending afterwards, which top-p needs) */
    int sorted = 0;
    if (sp->top_k > 0 && sp->top_k < V) {
        top_k(cand, n, sp->top_k);
        n = sp->top_k;
        sorted = 1;
    }
    /* top-p: the smallest prefix whose probability reaches p */
    if (sp->top_p < 1.0f) {
        if (!sorted) { /* no top-k, so no screen: cand is the whole vocabulary, in id order */
            if (!c->cand_sorting) c->cand_sorting = malloc((size_t)V * sizeof(se_cand));
            if (c->cand_sorting) sort_by_logit(cand, n, c->cand_sorting);
            else qsort(cand, (size_t)n, sizeof *cand, se_cand_desc); /* no memory for the radix sort */
            sorted = 1;
        }
        float mx = cand[0].logit;
        double sum = 0;
        for (int32_t i = 0; i < n; i++) sum += exp((double)(cand[i].logit - mx));
        double cum = 0;
        int32_t keep = n;
        for (int32_t i = 0; i < n; i++) {
            cum += exp((double)(cand[i].logit - mx)) / sum;
            if (cum >= sp->top_p) { keep = i + 1; break; }
        }
        n = keep;
    }
    /* min-p: keep logits within log(min_p) of the best one */
    if (sp->min_p > 0.0f && sp->min_p <= 1.0f) {
        float mx = cand[0].logit;
        if (!sorted)
            for (int32_t i = 1; i < n; i++) if (cand[i].logit > mx) mx = cand[i].logit;
        float thresh = mx + logf(sp->min_p);
        int32_t m = 0;
        for (int32_t i = 0; i < n; i++)
            if (cand[i].logit >= thresh) cand[m++] = cand[i];
        n = m > 0 ? m : 1; /* cannot be empty: the best one passes */
    }
    return n;
}

int32_t se_sample(se_context *c, const se_sampling_params *sp) {
    if (!c || !sp || c->n_past < 1) return SE_ERR_INVALID;
    int32_t V = c->m->hp.n_vocab;
    if (!c->rng_seeded || sp->seed != c->rng_seed) rng_seed(c, sp->seed);

    int32_t window = sp->repeat_last_n < 0 ? c->cp.n_ctx : sp->repeat_last_n;
    if (window > c->n_past) window = c->n_past;
    int penalize = window > 0 && (sp->repeat_penalty != 1.0f || sp->frequency_penalty != 0.0f ||
                                  sp->presence_penalty != 0.0f);

    /* a head left for the sampler: screened where the sampler needs only the top k, in which
     * case cand holds every row that can be in it, exact and penalized, in id order (or, final,
     * the tokens top-k, top-p and min-p leave) */
    se_cand *cand = c->cand;
    int final = 0;
    int32_t n = c->head_pending ? se_screen_candidates(c, sp, penalize ? window : 0, &final) : -1;
    if (n < 0) {
        se_context_head(c);
        const int32_t k = sp->temp <= 0 ? 1 : sp->top_k > 0 && sp->top_k < V ? sp->top_k : 0;
        if (k) n = top_candidates(c, sp, penalize ? window : 0, k);
    }
    if (n < 0) {
        const float *logits = c->logits;
        for (int32_t i = 0; i < V; i++) {
            cand[i].id = i;
            cand[i].logit = logits[i];
        }
        n = V;
        if (penalize) {
            const int32_t *hist = c->tokens + (c->n_past - window);
            for (int32_t i = 0; i < window; i++) c->counts[hist[i]]++;
            for (int32_t i = 0; i < window; i++) {
                int32_t tok = hist[i];
                if (c->counts[tok] == 0) continue; /* already done (a repeated token) */
                cand[tok].logit = se_penalized(cand[tok].logit, c->counts[tok], sp);
                c->counts[tok] = 0; /* leaves counts all zero again for the next call */
            }
        }
        for (int32_t i = 0; i < c->n_ban; i++) cand[c->ban[i]].logit = -INFINITY;
    }
    if (sp->temp <= 0) { /* the highest logit, the lowest id among equal ones: cand's order may be any */
        int32_t best = 0;
        for (int32_t i = 1; i < n; i++)
            if (cand_before(&cand[i], &cand[best])) best = i;
        return cand[best].id;
    }

    if (!final) n = truncate(c, sp, n);
    /* temperature, then the draw */
    float mx = cand[0].logit;
    for (int32_t i = 1; i < n; i++) if (cand[i].logit > mx) mx = cand[i].logit;
    double sum = 0;
    for (int32_t i = 0; i < n; i++) {
        float p = expf((cand[i].logit - mx) / sp->temp);
        cand[i].logit = p; /* now an unnormalised probability */
        sum += p;
    }
    double u = rng_uniform(c->rng) * sum, cum = 0;
    for (int32_t i = 0; i < n; i++) {
        cum += cand[i].logit;
        if (u < cum) return cand[i].id;
    }
    return cand[n - 1].id; /* rounding left u at the very top */
}
