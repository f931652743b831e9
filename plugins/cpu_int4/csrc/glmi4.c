/* glmi4: the native half of the cpu_int4 backend (group-wise INT4 GLM inference on the CPU).
 *
 * One call runs a whole forward step (embedding, every layer, final norm, output layer) so Python
 * never sits in the per-layer loop. Decode on a CPU is memory-bound, so the matrix kernels exist to
 * stream packed weights at the machine's bandwidth:
 *
 *   - weights are repacked at conversion time into tiles of 16 output rows: for each quantization
 *     group, the 16 scales (and, asymmetric, 16 minimums) sit inline before the group's nibbles,
 *     and each 32-wide block of nibbles is 8 chunks of 32 bytes: chunk c holds inputs 4c..4c+3 of
 *     all 16 rows, byte 4r+e = q[r][4c+e] | q[r+8][4c+e] << 4, so one broadcast of 4 activation
 *     bytes feeds all 16 rows (low nibbles: rows 0-7, high nibbles: rows 8-15);
 *   - activations are quantized to int8 per block of 32 (scale = absmax/127), so a block's dot
 *     product is integer arithmetic: u4 x s8 -> s16 (vpmaddubsw) -> s32 (vpmaddwd), or one
 *     vpdpbusd with AVX-512 VNNI, whose 16 int32 lanes are exactly the tile's 16 rows;
 *   - the sign of the 4-bit code is handled once per group: w = d*q + m with q in 0..15 and
 *     m = -8d (symmetric) or a stored minimum (asymmetric), so sum(w*x) = d*sum(q*x) + m*sum(x).
 *
 * Variants are chosen at run time: plain C (the correctness reference), AVX2+FMA+F16C, AVX-VNNI (the AVX2
 * kernels with VEX vpdpbusd; the same bits as AVX2) and AVX-512 VNNI. The fast variants are compiled with function-level target attributes, never
 * -march, so one binary serves every x86-64 CPU. Threads are a small pthread pool (no OpenMP):
 * workers spin briefly between the many short parallel regions of a step, then sleep.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(_M_X64)
#define GLMI4_X86 1
#include <immintrin.h>
#define T_AVX2 __attribute__((target("avx2,fma,f16c")))
#define T_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#ifdef GLMI4_EMULATE_AVXVNNI
/* Tests only: the AVX-VNNI tier built with vpdpbusd done by AVX2 instructions (exact), so CPUs without it can
 * check the tier's kernels; a library built so says "avxvnni-emulated" and is never the one loaded to run. */
#define T_VX T_AVX2
#else
#define T_VX __attribute__((target("avx2,fma,f16c,avxvnni")))
#endif
#define INLINE static inline __attribute__((always_inline))
#else
#define GLMI4_X86 0
#endif

#define GLMI4_ABI 12
#define QK 32          /* activation block: one int8 scale per 32 inputs */
#define TILE 16        /* output rows per packed tile */
#define ROUND_TILE(n) (((n) + TILE - 1) / TILE * TILE)
#define PREFETCH 4096   /* decode streams weights: prefetch this far ahead into L1 (measured: +40% on one core) */
#define PREFETCH_L2 12288   /* ... and this far ahead into L2 (see prefetch_ahead) */
#define NTMAX 4        /* tokens sharing one unpacked weight block in the fast kernels */
#define ATT_BLK 32     /* cached positions converted to f32 at a time by the AVX2/AVX-512 attention */
#define SC_HEADS(grp) (((grp) + 7) & ~7)   /* per-thread score rows: the AVX-512 attention pads heads to 8 */
#define ROWBUF(hd, grp) ((size_t)(hd) * (2 + SC_HEADS(grp) + ATT_BLK))

/* In order of preference: the best supported one is the default. */
enum { ISA_REF = 0, ISA_AVX2 = 1, ISA_AVXVNNI = 2, ISA_VNNI = 3, ISA_COUNT = 4 };
#ifdef GLMI4_EMULATE_AVXVNNI
static const char *ISA_NAMES[ISA_COUNT] = {"plain", "avx2", "avxvnni-emulated", "avx512vnni"};
#else
static const char *ISA_NAMES[ISA_COUNT] = {"plain", "avx2", "avxvnni", "avx512vnni"};
#endif

/* ------------------------------------------------------------------ public structs (ctypes mirrors) */

typedef struct {
    const uint8_t *data;      /* tiles, see the header comment */
    int32_t n, k;             /* logical rows (outputs), columns (inputs) */
    int32_t n_pad, k_pad;     /* n rounded up to 16, k rounded up to the group size */
    int32_t bits;             /* 4 or 8 (8: symmetric int8, 32 scale bytes + 512-byte blocks) */
    int32_t group, asym, scale_bf16;
} glmi4_mat;

typedef struct {               /* row-major quantized embedding table */
    const uint8_t *scales;    /* [n][k_pad/group] f16/bf16 */
    const uint8_t *mins;      /* [n][k_pad/group] or NULL */
    const uint8_t *q;         /* bits 4: [n][k_pad/2] (element 2i low nibble), bits 8: [n][k_pad] int8 */
    int32_t n, k, k_pad, bits, group, asym, scale_bf16;
} glmi4_emb;

typedef struct {
    const float *input_norm, *qkv_bias, *post_norm;
    /* glm4 (GLM-4-0414): RMSNorm of the attention output and of the MLP output before each residual add;
     * NULL for the other GLMs, whose sublayer outputs are added as they are */
    const float *post_self_attn_norm, *post_mlp_norm;
    glmi4_mat qkv, attn_out, ffn_up, ffn_down;
    /* glm4_moe: per-head RMSNorm of q and k before the rotary (use_qk_norm); NULL when off */
    const float *q_norm, *k_norm;
    /* An MoE layer (sparse): the router [experts][hidden] and its correction bias [experts] in fp32, each routed
     * expert's gate|up [2F][hidden] and down [hidden][F] (arrays of n_experts), the shared expert (data NULL:
     * none). ffn_up/ffn_down are unused there. */
    int32_t sparse;
    const float *router, *router_bias;
    const glmi4_mat *exp_up, *exp_down;
    glmi4_mat shared_up, shared_down;
    /* Latent attention (glm4_moe_lite; qkv unused): q_a [q_lora][hidden] and its norm, q_b [heads*(nope+rope)]
     * [q_lora] (or, without q LoRA, q_a.data NULL and q_b [heads*(nope+rope)][hidden]); kv_a [kv_lora+rope]
     * [hidden] and the norm of its first kv_lora outputs; kv_b split for the absorption: kv_uk, per head the
     * key part transposed [kv_lora][nope], kv_uv, per head the value part [v_dim][kv_lora]; each stacked over the
     * heads, a head's rows padded with zero rows to whole tiles. */
    const float *q_a_bias, *q_a_norm, *kv_a_bias, *kv_a_norm, *attn_out_bias;
    glmi4_mat q_a, q_b, kv_a, kv_uk, kv_uv;
} glmi4_layer;

/* A multi-token-prediction (NextN) layer: at position i it takes the embedding of the next token (zero at
 * position 0) and the target's final normed hidden state there, eh_proj(concat(enorm(e), hnorm(h))) [hidden]
 * [2 hidden] -> one decoder layer of the model's kind (its own KV cache: layer n_layers of each slot's ring) ->
 * its own final norm -> the model's output layer. */
typedef struct glmi4_nextn {
    const float *enorm, *hnorm, *final_norm;
    glmi4_mat eh_proj;
    glmi4_layer layer;
} glmi4_nextn;

typedef struct {
    int32_t hidden, n_layers, n_heads, n_kv, head_dim, ffn, vocab, capacity;
    int32_t kv_f16, max_batch, nthreads, isa;
    int32_t n_slots;                    /* independent sequences, each with its own KV ring of `capacity` */
    int32_t rot_dim;                    /* dims of each head that rotate (ChatGLM/GLM-4: head_dim/2, GLM-Edge: all) */
    float norm_eps;
    const float *rope_cos, *rope_sin;   /* [capacity][rot_dim/2], fp32 as the reference computes them */
    const float *inv_freq;              /* [rot_dim/2], for shifting cached keys */
    glmi4_emb embed;
    const float *final_norm;
    glmi4_mat head;
    const glmi4_layer *layers;
    int32_t rope_neox;                  /* rotate pairs (i, i + rot/2) (NeoX order) instead of (2i, 2i+1) */
    /* MoE (any layer sparse): routing as transformers' route(): sigmoid scores, the correction bias only for
     * choosing among the topk_groups best of n_groups groups, top_k experts, renormalised when norm_topk, times
     * routed_scaling; moe_ffn each expert's width, shared_ffn the shared expert's (0: none) */
    int32_t n_experts, top_k, n_groups, topk_groups, norm_topk, moe_ffn, shared_ffn;
    float routed_scaling;
    /* latent attention (mla != 0): head_dim = nope + rot_dim, the cache holds kv_lora + rot_dim per token */
    int32_t mla, q_lora, kv_lora, nope, v_dim;
    float latent_eps;                   /* the q_a and kv_a norms' epsilon (transformers: 1e-6, not norm_eps) */
    const struct glmi4_nextn *nextn;    /* the checkpoint's NextN (MTP) layer, or NULL: not loaded */
} glmi4_spec;

/* ------------------------------------------------------------------ small helpers */

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if GLMI4_X86
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline float h2f(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu, f;
    if (e == 0) {
        if (m == 0) {
            f = s;
        } else {                            /* subnormal half: normalize */
            e = 113;
            while (!(m & 0x400u)) { m <<= 1; e--; }
            f = s | (e << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) {
        f = s | 0x7f800000u | (m << 13);
    } else {
        f = s | ((e + 112) << 23) | (m << 13);
    }
    float out;
    memcpy(&out, &f, 4);
    return out;
}

/* float -> half, round to nearest even (F. Giesen's float_to_half_fast3_rtne); matches F16C. */
static inline uint16_t f2h(float fl) {
    const uint32_t infty = 255u << 23, f16max = (127u + 16u) << 23, magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    uint32_t x;
    memcpy(&x, &fl, 4);
    uint32_t sign = x & 0x80000000u;
    x ^= sign;
    uint16_t o;
    if (x >= f16max) {
        o = x > infty ? 0x7e00 : 0x7c00;
    } else if (x < (113u << 23)) {
        float f, fm;
        memcpy(&f, &x, 4);
        memcpy(&fm, &magic, 4);
        f += fm;
        uint32_t r;
        memcpy(&r, &f, 4);
        o = (uint16_t)(r - magic);
    } else {
        uint32_t odd = (x >> 13) & 1u;
        x += ((uint32_t)(15 - 127) << 23) + 0xfffu;
        x += odd;
        o = (uint16_t)(x >> 13);
    }
    return o | (uint16_t)(sign >> 16);
}

static inline float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float scale_at(const uint8_t *p, int i, int bf16) {
    uint16_t v;
    memcpy(&v, p + 2 * i, 2);
    return bf16 ? bf2f(v) : h2f(v);
}

static inline int imin(int a, int b) { return a < b ? a : b; }

static size_t group_bytes(const glmi4_mat *W) {
    if (W->bits == 8) return 32 + (size_t)(W->group / QK) * 512;
    return (W->asym ? 64 : 32) + (size_t)(W->group / QK) * 256;
}

static size_t tile_bytes(const glmi4_mat *W) { return (size_t)(W->k_pad / W->group) * group_bytes(W); }

/* Decode streams the weights: each group fetches its bytes PREFETCH ahead (+26% decode against none). A group
 * of one block fetches its blocks' lines (adding the header's line measured 1.5-2% slower: mostly a line
 * already asked for); a larger group the whole group, header included (fetching only its blocks left the
 * scales' line to a demand miss per group: group 128 decoded 3.5% slower). hdr: the header's size.
 * Each line is asked for twice: into L2 PREFETCH_L2 ahead, then into L1 PREFETCH ahead, where it is by then
 * an L2 hit. An L1 prefetch holds one of the core's few L1 miss buffers until its line comes; from L2 that is
 * short, so the cores keep more lines on their way from memory (1b decode at group 32, paired A/Bs: AVX2
 * +10.5%, AVX-512 +9.4%; the L2 prefetch alone was 9% slower than the L1 one alone). */
static inline void prefetch_ahead(const uint8_t *p, size_t gb, size_t hdr, int blocks) {
    const size_t skip = blocks == 1 ? hdr : 0;
    for (size_t l = skip; l < gb; l += 64) {
        __builtin_prefetch(p + PREFETCH_L2 + l, 0, 2);
        __builtin_prefetch(p + PREFETCH + l, 0, 3);
    }
}

static void *xalloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? (bytes + 63) / 64 * 64 : 64)) return NULL;
    return p;
}

/* ------------------------------------------------------------------ CPU features and self-report */

static int isa_supported(int isa) {
    if (isa == ISA_REF) return 1;
#if GLMI4_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == ISA_AVX2) return avx2;
    if (isa == ISA_AVXVNNI) {
#ifdef GLMI4_EMULATE_AVXVNNI
        return avx2;
#else
        /* CPUID.(EAX=7,ECX=1):EAX bit 4, with the OS saving the ymm state (checked for avx2 above) */
        unsigned a = 0, b = 0, c = 0, d = 0;
        __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
        return avx2 && ((a >> 4) & 1);
#endif
    }
    if (isa == ISA_VNNI)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
    return 0;
}

static _Atomic uint64_t g_calls[ISA_COUNT];   /* matrix kernel calls per variant: tests prove dispatch */

#ifndef GLMI4_SRC_SHA
#define GLMI4_SRC_SHA ""
#endif
int glmi4_abi_version(void) { return GLMI4_ABI; }
/* sha256 of this file, passed in by the build, so a loader can tell a stale library from a current one */
const char *glmi4_source_sha(void) { return GLMI4_SRC_SHA; }
int glmi4_isa_supported(int isa) { return isa >= 0 && isa < ISA_COUNT && isa_supported(isa); }
const char *glmi4_isa_name(int isa) { return isa >= 0 && isa < ISA_COUNT ? ISA_NAMES[isa] : "?"; }
uint64_t glmi4_kernel_calls(int isa) { return isa >= 0 && isa < ISA_COUNT ? atomic_load(&g_calls[isa]) : 0; }
int glmi4_best_isa(void) {
    for (int i = ISA_COUNT - 1; i > 0; i--)
        if (isa_supported(i)) return i;
    return ISA_REF;
}

/* ------------------------------------------------------------------ thread pool */

typedef void (*task_fn)(void *arg, int tid, int nth);

typedef struct pool pool;
typedef struct { pool *p; int tid; } worker_arg;

/* A region (pool_run) is open to the workers until the caller has done what it could of it: the caller then
 * closes it and waits only for the workers that entered. A worker the OS has not scheduled (a loaded
 * machine: other jobs on the cores) is not waited for, so it never holds up a region it took no part in.
 * So every task takes its work from a shared counter: any subset of the threads, the caller alone
 * included, completes it. gate: the region's number (high 32 bits), CLOSED, and how many workers entered. */
#define GATE_CLOSED (1ull << 31)
#define GATE_COUNT (GATE_CLOSED - 1)

struct pool {
    int nth;
    pthread_t *th;
    worker_arg *args;
    _Atomic uint64_t gate;
    _Atomic int done, nsleep, stop;
    uint32_t region;          /* the caller's count of regions (the gate's high half) */
    task_fn fn;
    void *arg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

#define SPIN_NS 2000000ull   /* spin 2 ms for the next region before sleeping */
#define SMALL_WORK (1u << 18)  /* multiply-adds below which a region runs on the calling thread */
#define ROWS_SMALL (1u << 15)  /* row elements below which run_rows makes and quantizes them on the calling thread */

static inline uint32_t gate_region(uint64_t v) { return (uint32_t)(v >> 32); }

static void *worker_main(void *a) {
    pool *p = ((worker_arg *)a)->p;
    const int tid = ((worker_arg *)a)->tid;
    uint32_t seen = 0;
    for (;;) {
        uint64_t v, t0 = 0;
        unsigned it = 0;
        while (gate_region(v = atomic_load(&p->gate)) == seen) {
            cpu_relax();
            if ((++it & 255u) != 0) continue;
            sched_yield();          /* an oversubscribed machine: let whoever shares this core run */
            uint64_t t = now_ns();
            if (!t0) {
                t0 = t;
            } else if (t - t0 > SPIN_NS) {
                pthread_mutex_lock(&p->mu);
                atomic_fetch_add(&p->nsleep, 1);
                while (gate_region(v = atomic_load(&p->gate)) == seen) pthread_cond_wait(&p->cv, &p->mu);
                atomic_fetch_sub(&p->nsleep, 1);
                pthread_mutex_unlock(&p->mu);
                break;
            }
        }
        seen = gate_region(v);
        if (atomic_load(&p->stop)) return NULL;
        /* enter region `seen` unless it is closed (or a newer one opened: the next turn takes that) */
        while (gate_region(v) == seen && !(v & GATE_CLOSED)) {
            if (atomic_compare_exchange_weak(&p->gate, &v, v + 1)) {
                p->fn(p->arg, tid, p->nth);     /* fn, arg: written before the gate opened */
                atomic_fetch_add(&p->done, 1);
                break;
            }
        }
    }
}

static void pool_run(pool *p, task_fn fn, void *arg) {
    if (!p || p->nth == 1) {
        fn(arg, 0, 1);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    atomic_store(&p->done, 0);
    atomic_store(&p->gate, (uint64_t)++p->region << 32);
    if (atomic_load(&p->nsleep) > 0) {   /* seq_cst pairs with the worker's nsleep++ then gate check */
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    fn(arg, 0, p->nth);
    const int entered = (int)(atomic_fetch_or(&p->gate, GATE_CLOSED) & GATE_COUNT);
    for (unsigned it = 1; atomic_load(&p->done) < entered; it++) {
        cpu_relax();
        if ((it & 255u) == 0) sched_yield();    /* a worker may be waiting for this very core */
    }
}

static void pool_free(pool *p) {
    if (!p) return;
    if (p->th) {
        atomic_store(&p->stop, 1);
        atomic_store(&p->gate, (uint64_t)++p->region << 32);
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        for (int i = 1; i < p->nth; i++) pthread_join(p->th[i], NULL);
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->th);
    free(p->args);
    free(p);
}

static pool *pool_new(int nth) {
    pool *p = calloc(1, sizeof(pool));
    if (!p) return NULL;
    p->nth = nth < 1 ? 1 : nth;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (p->nth == 1) return p;
    p->th = calloc((size_t)p->nth, sizeof(pthread_t));
    p->args = calloc((size_t)p->nth, sizeof(worker_arg));
    if (!p->th || !p->args) { pool_free(p); return NULL; }
    for (int i = 1; i < p->nth; i++) {
        p->args[i].p = p;
        p->args[i].tid = i;
        if (pthread_create(&p->th[i], NULL, worker_main, &p->args[i])) {
            p->nth = i;       /* join the ones that started */
            pool_free(p);
            return NULL;
        }
    }
    return p;
}

/* ------------------------------------------------------------------ activation quantization */

/* Shared tail: per-block scale and the per-group sums xs[g] = sum_b dx[b] * sum(q in b). */
static void quant_finish(const int8_t *q, const float *dx, int Kp, int G, float *xs) {
    int nb = Kp / QK, per = G / QK;
    for (int g = 0; g < Kp / G; g++) {
        float s = 0.f;
        for (int b = g * per; b < (g + 1) * per && b < nb; b++) {
            int is = 0;
            for (int i = 0; i < QK; i++) is += q[b * QK + i];
            s += dx[b] * (float)is;
        }
        xs[g] = s;
    }
}

static void quant_act_ref(const float *x, int K, int Kp, int G, int8_t *q, float *dx, float *xs) {
    for (int b = 0; b < Kp / QK; b++) {
        float v[QK], amax = 0.f;
        for (int i = 0; i < QK; i++) {
            int k = b * QK + i;
            v[i] = k < K ? x[k] : 0.f;
            amax = fmaxf(amax, fabsf(v[i]));
        }
        float id = amax > 0.f ? 127.f / amax : 0.f;
        dx[b] = amax / 127.f;
        for (int i = 0; i < QK; i++) q[b * QK + i] = (int8_t)nearbyintf(v[i] * id);
    }
    quant_finish(q, dx, Kp, G, xs);
}

/* ------------------------------------------------------------------ matrix kernels */

/* 16 tokens' activations laid out for one pass over a g32 tile (the 16-token AVX-512 kernels: decode of many
 * sequences). x: per (block, chunk) the 4 bytes of each of the 16 tokens, so one pointer with constant offsets
 * feeds every vpdpbusd (with 16 per-token pointers and 16 accumulators the 8-token kernels' layout spills);
 * dx and c = off * xs per (block, token), off as in block_end. Built once per product, before the threads. */
typedef struct { int8_t *x; float *dx, *c; } act16;

typedef struct gemm_job {
    const glmi4_mat *W;
    int M;                    /* tokens */
    const int8_t *xq;         /* [M][ldq] */
    const float *dx, *xs;     /* [M][ldq/32], [M][ldq/32] (group sums; first k_pad/group used) */
    int ldq;
    float *out;               /* [M][ldo], columns 0..W->n-1 */
    int ldo;
    const float *bias;        /* [W->n] or NULL */
    int accum;                /* out += result */
    int ntiles, first;        /* this product's tiles, and where they start in its run_gemms batch */
    void (*fn)(const struct gemm_job *, int, int);
    act16 *a16;               /* the first 16 * n16 tokens laid out for the 16-token kernels, or NULL */
    int n16;
    int8_t *xa;               /* |xq| for the AVX2 int8 kernel's 4-token blocks (uses_abs), or NULL */
} gemm_job;

/* Unpacking a tile once pays off from about 32 tokens on; below, splitting the nibbles in registers for 8
 * tokens at a time costs less (measured in cache, 1 thread: g32 153 vs 145 GMAC/s at 16 tokens, 176 vs
 * 153 at 128). */
#define UNPACK_M 32
/* The AVX2 kernels' 4-token blocks: below 16 tokens the nibbles split in registers (decode of 4 sequences
 * 1.53x, of 8 1.09x the unpacked tile's speed; of 16 0.94x; paired A/Bs on the 1b). */
#define UNPACK_M_AVX2 16

/* Which products go 16 tokens at a time (AVX-512 VNNI, group 32, symmetric): int4 below UNPACK_M tokens,
 * int8 (the output layer) from 16 tokens on. */
static int uses_act16(int isa, const glmi4_mat *W, int M) {
    return isa == ISA_VNNI && W->group == QK && !W->asym && M >= 16 && (W->bits == 8 || M < UNPACK_M);
}

/* The AVX2 int8 kernel (the output layer) multiplies |x| by sign(x)*w; from 4 tokens on |x| is read from xa,
 * built once per product, rather than taken in every chunk of every tile (one op of nine). The AVX-VNNI tier
 * keeps vpabsb: reading xa there measured slower (16 tokens 42.5 -> 46.5 ms on a Xeon). */
static int uses_abs(int isa, const glmi4_mat *W, int M) {
    return isa == ISA_AVX2 && W->bits == 8 && M >= 4;
}

static void abs_build(gemm_job *j) {
    const size_t n = (size_t)j->M * j->ldq;
    j->xa = xalloc(n);
    for (size_t i = 0; j->xa && i < n; i++) j->xa[i] = (int8_t)(j->xq[i] < 0 ? -j->xq[i] : j->xq[i]);
}

static void act16_free(gemm_job *j) {
    for (int k = 0; j->a16 && k < j->n16; k++) { free(j->a16[k].x); free(j->a16[k].dx); free(j->a16[k].c); }
    free(j->a16);
    j->a16 = NULL;
    j->n16 = 0;
}

/* Lay out the first 16 * (M / 16) tokens; on a failed allocation none, and the 8/4/1-token kernels take all
 * (the same bits). */
static void act16_build(gemm_job *j) {
    const int nb = j->W->k_pad / QK, nbx = j->ldq / QK;
    const float off = j->W->bits == 8 ? 128.f : 8.f;
    j->n16 = j->M / 16;
    j->a16 = calloc((size_t)j->n16, sizeof(act16));
    for (int k = 0; j->a16 && k < j->n16; k++) {
        act16 *a = &j->a16[k];
        *a = (act16){xalloc((size_t)nb * 512), xalloc((size_t)nb * 64), xalloc((size_t)nb * 64)};
        if (!a->x || !a->dx || !a->c) break;
        for (int b = 0; b < nb; b++)
            for (int t = 0; t < 16; t++) {
                const int row = 16 * k + t;
                const int8_t *src = j->xq + (size_t)row * j->ldq + (size_t)b * QK;
                for (int c = 0; c < 8; c++) memcpy(a->x + ((size_t)(b * 8 + c) * 16 + t) * 4, src + 4 * c, 4);
                a->dx[b * 16 + t] = j->dx[(size_t)row * nbx + b];
                a->c[b * 16 + t] = off * j->xs[(size_t)row * nbx + b];
            }
        if (k + 1 == j->n16) return;
    }
    act16_free(j);
}

static inline void store_tile(const gemm_job *j, int tile, int m, int nt, const float *acc) {
    int n0 = tile * TILE, nr = imin(TILE, j->W->n - n0);
    for (int t = 0; t < nt; t++) {
        float *o = j->out + (size_t)(m + t) * j->ldo + n0;
        const float *a = acc + t * TILE;
        for (int r = 0; r < nr; r++) {
            float v = a[r] + (j->bias ? j->bias[n0 + r] : 0.f);
            o[r] = j->accum ? o[r] + v : v;
        }
    }
}

static void gemm4_ref(const gemm_job *j, int t0, int t1) {
    const glmi4_mat *W = j->W;
    const int ng = W->k_pad / W->group, GB = W->group / QK, hdr = W->asym ? 64 : 32;
    const size_t gb = group_bytes(W), tb = tile_bytes(W);
    const int nbx = j->ldq / QK;
    for (int tile = t0; tile < t1; tile++) {
        for (int m = 0; m < j->M; m++) {
            const int8_t *xq = j->xq + (size_t)m * j->ldq;
            const float *dx = j->dx + (size_t)m * nbx, *xs = j->xs + (size_t)m * nbx;
            float acc[TILE] = {0};
            for (int g = 0; g < ng; g++) {
                const uint8_t *p = W->data + (size_t)tile * tb + (size_t)g * gb;
                float gacc[TILE] = {0};
                for (int s = 0; s < GB; s++) {
                    const uint8_t *q = p + hdr + s * 256;
                    const int8_t *x = xq + (size_t)(g * GB + s) * QK;
                    int32_t isum[TILE] = {0};
                    for (int c = 0; c < 8; c++)
                        for (int r = 0; r < TILE / 2; r++)
                            for (int e = 0; e < 4; e++) {
                                const uint8_t byte = q[32 * c + 4 * r + e];
                                isum[r] += (byte & 15) * x[4 * c + e];
                                isum[r + 8] += (byte >> 4) * x[4 * c + e];
                            }
                    for (int r = 0; r < TILE; r++) gacc[r] += (float)isum[r] * dx[g * GB + s];
                }
                for (int r = 0; r < TILE; r++) {
                    float d = scale_at(p, r, W->scale_bf16);
                    if (W->asym)
                        acc[r] += d * gacc[r] + scale_at(p + 32, r, W->scale_bf16) * xs[g];
                    else
                        acc[r] += d * (gacc[r] - 8.f * xs[g]);
                }
            }
            store_tile(j, tile, m, 1, acc);
        }
    }
}

static void gemm8_ref(const gemm_job *j, int t0, int t1) {
    const glmi4_mat *W = j->W;
    const int ng = W->k_pad / W->group, GB = W->group / QK;
    const size_t gb = group_bytes(W), tb = tile_bytes(W);
    const int nbx = j->ldq / QK;
    for (int tile = t0; tile < t1; tile++) {
        for (int m = 0; m < j->M; m++) {
            const int8_t *xq = j->xq + (size_t)m * j->ldq;
            const float *dx = j->dx + (size_t)m * nbx;
            float acc[TILE] = {0};
            for (int g = 0; g < ng; g++) {
                const uint8_t *p = W->data + (size_t)tile * tb + (size_t)g * gb;
                float gacc[TILE] = {0};
                for (int s = 0; s < GB; s++) {
                    const int8_t *q = (const int8_t *)(p + 32 + s * 512);
                    const int8_t *x = xq + (size_t)(g * GB + s) * QK;
                    int32_t isum[TILE] = {0};
                    for (int c = 0; c < 8; c++)
                        for (int r = 0; r < TILE; r++)
                            for (int e = 0; e < 4; e++) isum[r] += q[64 * c + 4 * r + e] * x[4 * c + e];
                    for (int r = 0; r < TILE; r++) gacc[r] += (float)isum[r] * dx[g * GB + s];
                }
                for (int r = 0; r < TILE; r++) acc[r] += scale_at(p, r, W->scale_bf16) * gacc[r];
            }
            store_tile(j, tile, m, 1, acc);
        }
    }
}

#if GLMI4_X86
/* ---------------- AVX2 */

T_AVX2 INLINE __m256 ld8_scales(const uint8_t *p, int bf16) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

T_AVX2 INLINE int32_t ld32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* One 16-row tile against NT tokens (1, 2 or 4). acc[t][0]: rows 0-7 of token t, acc[t][1]: rows 8-15. Per
 * chunk: one load, three ops to split the nibbles (from UNPACK_M_AVX2 tokens on done once per tile by
 * unpack_tile_avx2, into unp), then per token one broadcast and two vpmaddubsw. |q*x| <= 15*127, so eight pair sums stay below 32767 and the int16
 * accumulation over a 32-block is exact. */
/* The step of madd4_split for one token (the 2-token loop calls it twice on the same halves). */
T_AVX2 INLINE void madd1_split(__m256i i16[2], __m256i lo, __m256i hi, const int8_t *x) {
    __m256i bx, p0, p1;
    __asm__("vpbroadcastd %[x], %[bx]\n\t"
            "vpmaddubsw %[bx], %[lo], %[p0]\n\t"
            "vpmaddubsw %[bx], %[hi], %[p1]\n\t"
            "vpaddw %[p0], %[a0], %[a0]\n\t"
            "vpaddw %[p1], %[a1], %[a1]"
            : [a0] "+x"(i16[0]), [a1] "+x"(i16[1]), [bx] "=&x"(bx), [p0] "=&x"(p0), [p1] "=&x"(p1)
            : [lo] "x"(lo), [hi] "x"(hi), [x] "m"(*(const int32_t *)x));
}

/* i16[t][h] += vpmaddubsw(nibble-bytes half h of one 8-input chunk, 4 bytes of token t broadcast), for the
 * 4 tokens of a register block: the inner step of both 4-token AVX2 kernels (the halves split in registers, or
 * loaded from an unpacked tile). Written in asm so the eight accumulators stay in registers: from intrinsics,
 * compilers hoist the broadcasts and store products or accumulators to the stack. */
T_AVX2 INLINE void madd4_split(__m256i i16[4][2], __m256i lo, __m256i hi, const int8_t *x0, const int8_t *x1,
                               const int8_t *x2, const int8_t *x3) {
    __m256i bx, p0, p1;
    __asm__("vpbroadcastd %[x0], %[bx]\n\t"
            "vpmaddubsw %[bx], %[lo], %[p0]\n\t"
            "vpmaddubsw %[bx], %[hi], %[p1]\n\t"
            "vpaddw %[p0], %[a0], %[a0]\n\t"
            "vpaddw %[p1], %[a1], %[a1]\n\t"
            "vpbroadcastd %[x1], %[bx]\n\t"
            "vpmaddubsw %[bx], %[lo], %[p0]\n\t"
            "vpmaddubsw %[bx], %[hi], %[p1]\n\t"
            "vpaddw %[p0], %[a2], %[a2]\n\t"
            "vpaddw %[p1], %[a3], %[a3]\n\t"
            "vpbroadcastd %[x2], %[bx]\n\t"
            "vpmaddubsw %[bx], %[lo], %[p0]\n\t"
            "vpmaddubsw %[bx], %[hi], %[p1]\n\t"
            "vpaddw %[p0], %[a4], %[a4]\n\t"
            "vpaddw %[p1], %[a5], %[a5]\n\t"
            "vpbroadcastd %[x3], %[bx]\n\t"
            "vpmaddubsw %[bx], %[lo], %[p0]\n\t"
            "vpmaddubsw %[bx], %[hi], %[p1]\n\t"
            "vpaddw %[p0], %[a6], %[a6]\n\t"
            "vpaddw %[p1], %[a7], %[a7]"
            : [a0] "+x"(i16[0][0]), [a1] "+x"(i16[0][1]), [a2] "+x"(i16[1][0]), [a3] "+x"(i16[1][1]),
              [a4] "+x"(i16[2][0]), [a5] "+x"(i16[2][1]), [a6] "+x"(i16[3][0]), [a7] "+x"(i16[3][1]),
              [bx] "=&x"(bx), [p0] "=&x"(p0), [p1] "=&x"(p1)
            : [lo] "x"(lo), [hi] "x"(hi),
              [x0] "m"(*(const int32_t *)x0), [x1] "m"(*(const int32_t *)x1),
              [x2] "m"(*(const int32_t *)x2), [x3] "m"(*(const int32_t *)x3));
}

/* The same from an unpacked tile (lo 32 bytes, then hi 32). */
T_AVX2 INLINE void madd4_chunk(__m256i i16[4][2], const uint8_t *u, const int8_t *x0, const int8_t *x1,
                               const int8_t *x2, const int8_t *x3) {
    madd4_split(i16, _mm256_load_si256((const __m256i *)u), _mm256_load_si256((const __m256i *)(u + 32)),
                x0, x1, x2, x3);
}

/* Tokens m..m+NT-1: their int8 activations, block scales and group sums. */
T_AVX2 INLINE void token_rows(const gemm_job *j, int m, int NT, const int8_t **xq, const float **dx, const float **xs) {
    const int nbx = j->ldq / QK;
    for (int t = 0; t < NT; t++) {
        xq[t] = j->xq + (size_t)(m + t) * j->ldq;
        dx[t] = j->dx + (size_t)(m + t) * nbx;
        xs[t] = j->xs + (size_t)(m + t) * nbx;
    }
}

/* The end of a group of several blocks (or asymmetric): w = d*q + m, m = -8d or the stored minimum, so
 * acc += d * gacc + m * xs (xs: the tokens' activation sums over the group). p: the group's header. */
T_AVX2 INLINE void group_end_avx2(const int NT, const uint8_t *p, int bf, int asym, const float *const *xs, int g,
                                  __m256 gacc[][2], __m256 acc[][2]) {
    const __m256 d0 = ld8_scales(p, bf), d1 = ld8_scales(p + 16, bf);
    if (asym) {
        const __m256 m0 = ld8_scales(p + 32, bf), m1 = ld8_scales(p + 48, bf);
        for (int t = 0; t < NT; t++) {
            const __m256 xg = _mm256_set1_ps(xs[t][g]);
            acc[t][0] = _mm256_fmadd_ps(m0, xg, _mm256_fmadd_ps(d0, gacc[t][0], acc[t][0]));
            acc[t][1] = _mm256_fmadd_ps(m1, xg, _mm256_fmadd_ps(d1, gacc[t][1], acc[t][1]));
        }
    } else {
        const __m256 eight = _mm256_set1_ps(8.f);
        for (int t = 0; t < NT; t++) {
            const __m256 xg = _mm256_set1_ps(xs[t][g]);
            acc[t][0] = _mm256_fmadd_ps(d0, _mm256_fnmadd_ps(eight, xg, gacc[t][0]), acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(d1, _mm256_fnmadd_ps(eight, xg, gacc[t][1]), acc[t][1]);
        }
    }
}

T_AVX2 INLINE void q4_tile_avx2(const gemm_job *j, const uint8_t *p, const uint8_t *unp, int m, const int NT,
                                float *outbuf) {
    const glmi4_mat *W = j->W;
    const int ng = W->k_pad / W->group, GB = W->group / QK, hdr = W->asym ? 64 : 32, bf = W->scale_bf16;
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int8_t *xq[NTMAX];
    const float *dx[NTMAX], *xs[NTMAX];
    token_rows(j, m, NT, xq, dx, xs);
    __m256 acc[NTMAX][2];
    for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m256 gacc[NTMAX][2];
        for (int t = 0; t < NT; t++) gacc[t][0] = gacc[t][1] = _mm256_setzero_ps();
        /* the first pass over a tile streams it, for any NT (unpack_tile_avx2 streamed an unpacked one): decode of
         * 2 sequences +45%, of 4 +13% against prefetching for NT = 1 only (paired A/Bs on the 1b) */
        if (m == 0 && !unp) prefetch_ahead(p, group_bytes(W), (size_t)hdr, GB);
        const uint8_t *q = p + hdr;
        for (int s = 0; s < GB; s++, q += 256) {
            const int b = g * GB + s;
            __m256i i16[NTMAX][2];
            for (int t = 0; t < NT; t++) i16[t][0] = i16[t][1] = _mm256_setzero_si256();
            if (NT == 4 && unp) {
                /* The prefill hot loop, in assembly so that the 8 accumulators stay in registers: compilers
                 * hoist the broadcasts and spill two accumulators, and the store-to-load round trip on
                 * the loop-carried chain halves the speed. 13 ymm: 8 acc, 2 nibble halves, 3 temps. */
                const int8_t *x0 = xq[0] + b * QK, *x1 = xq[1] + b * QK, *x2 = xq[2] + b * QK, *x3 = xq[3] + b * QK;
                /* unp: this tile's nibbles split once into bytes (lo 32, hi 32 per chunk) and shared by every
                 * group of 4 tokens, which saves the three splitting ops per chunk */
                const uint8_t *u = unp + (size_t)b * 512;
                for (int c = 0; c < 8; c++) {
                    madd4_chunk(i16, u + 64 * c, x0 + 4 * c, x1 + 4 * c, x2 + 4 * c, x3 + 4 * c);
                }
            } else if (NT == 1) {
                /* decode: the same, one token; keeps the instruction count per byte low so the loads
                 * of both threads can keep the memory bus busy */
                const int8_t *x0 = xq[0] + b * QK;
                for (int c = 0; c < 8; c++) {
                    __m256i lo, hi, bx, p0, p1;
                    __asm__("vmovdqu %[w], %[lo]\n\t"
                            "vpsrlw $4, %[lo], %[hi]\n\t"
                            "vpand %[m4], %[lo], %[lo]\n\t"
                            "vpand %[m4], %[hi], %[hi]\n\t"
                            "vpbroadcastd %[x0], %[bx]\n\t"
                            "vpmaddubsw %[bx], %[lo], %[p0]\n\t"
                            "vpmaddubsw %[bx], %[hi], %[p1]\n\t"
                            "vpaddw %[p0], %[a0], %[a0]\n\t"
                            "vpaddw %[p1], %[a1], %[a1]"
                            : [a0] "+x"(i16[0][0]), [a1] "+x"(i16[0][1]),
                              [lo] "=&x"(lo), [hi] "=&x"(hi), [bx] "=&x"(bx), [p0] "=&x"(p0), [p1] "=&x"(p1)
                            : [w] "m"(*(const __m256i *)(q + 32 * c)), [m4] "x"(m4),
                              [x0] "m"(*(const int32_t *)(x0 + 4 * c)));
                }
            } else if (NT == 2) {
                /* a step's experts given two tokens (most of a 16-sequence MoE step's expert work): the split
                 * nibbles shared by both tokens */
                const int8_t *x0 = xq[0] + b * QK, *x1 = xq[1] + b * QK;
                for (int c = 0; c < 8; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
                    const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    madd1_split(i16[0], lo, hi, x0 + 4 * c);
                    madd1_split(i16[1], lo, hi, x1 + 4 * c);
                }
            } else {        /* NT == 4, the tile not unpacked (4..UNPACK_M_AVX2 - 1 tokens) */
                const int8_t *x0 = xq[0] + b * QK, *x1 = xq[1] + b * QK, *x2 = xq[2] + b * QK, *x3 = xq[3] + b * QK;
                for (int c = 0; c < 8; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
                    madd4_split(i16, _mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                x0 + 4 * c, x1 + 4 * c, x2 + 4 * c, x3 + 4 * c);
                }
            }
            if (GB == 1 && !W->asym) {   /* group 32, symmetric: fold the block straight into acc */
                const __m256 d0 = ld8_scales(p, bf), d1 = ld8_scales(p + 16, bf);
                for (int t = 0; t < NT; t++) {
                    const __m256 db = _mm256_set1_ps(dx[t][b]), c8 = _mm256_set1_ps(-8.f * xs[t][g]);
                    acc[t][0] = _mm256_fmadd_ps(d0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(i16[t][0], ones)),
                                                                    db, c8), acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(d1, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(i16[t][1], ones)),
                                                                    db, c8), acc[t][1]);
                }
                continue;
            }
            for (int t = 0; t < NT; t++) {
                const __m256 db = _mm256_set1_ps(dx[t][b]);
                gacc[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(i16[t][0], ones)), db, gacc[t][0]);
                gacc[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(i16[t][1], ones)), db, gacc[t][1]);
            }
        }
        if (GB == 1 && !W->asym) {
            p = q;
            continue;
        }
        group_end_avx2(NT, p, bf, W->asym, xs, g, gacc, acc);
        p = q;
    }
    for (int t = 0; t < NT; t++) {
        _mm256_storeu_ps(outbuf + t * TILE, acc[t][0]);
        _mm256_storeu_ps(outbuf + t * TILE + 8, acc[t][1]);
    }
}

/* store_tile for a full tile, 8 lanes at a time (prefill writes M x n results per matrix) */
T_AVX2 INLINE void store_tile_avx2(const gemm_job *j, int tile, int m, int nt, const float *acc) {
    const int n0 = tile * TILE;
    if (n0 + TILE > j->W->n) { store_tile(j, tile, m, nt, acc); return; }
    const __m256 b0 = j->bias ? _mm256_loadu_ps(j->bias + n0) : _mm256_setzero_ps();
    const __m256 b1 = j->bias ? _mm256_loadu_ps(j->bias + n0 + 8) : _mm256_setzero_ps();
    for (int t = 0; t < nt; t++) {
        float *o = j->out + (size_t)(m + t) * j->ldo + n0;
        __m256 v0 = _mm256_add_ps(_mm256_loadu_ps(acc + t * TILE), b0);
        __m256 v1 = _mm256_add_ps(_mm256_loadu_ps(acc + t * TILE + 8), b1);
        if (j->accum) {
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(o));
            v1 = _mm256_add_ps(v1, _mm256_loadu_ps(o + 8));
        }
        _mm256_storeu_ps(o, v0);
        _mm256_storeu_ps(o + 8, v1);
    }
}

/* Prefill at group 32, symmetric: one weight scale per 32-block, so the float work per block and token is
 * the whole overhead over the integer dot products. Here the tile's scales come pre-converted to f32 (fs,
 * 16 per block, from unpack_tile_avx2) and each token's -8*xs per block pre-multiplied (c8), leaving four
 * ops per 8 outputs: vpmaddwd, vcvtdq2ps and two FMAs, with the scales as memory operands. */
T_AVX2 INLINE void q4_tile4_g32_avx2(const gemm_job *j, const uint8_t *unp, const float *fs, const float *c8, int m,
                                     float *outbuf) {
    const int nb = j->W->k_pad / QK, nbx = j->ldq / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *x0 = j->xq + (size_t)m * j->ldq, *x1 = x0 + j->ldq, *x2 = x1 + j->ldq, *x3 = x2 + j->ldq;
    const float *dx = j->dx + (size_t)m * nbx, *cc = c8 + (size_t)m * nbx;
    __m256 acc[4][2];
    for (int t = 0; t < 4; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, x0 += QK, x1 += QK, x2 += QK, x3 += QK) {
        __m256i i16[4][2];
        const uint8_t *u = unp + (size_t)b * 512;
        {   /* chunk 0 writes the accumulators: no zeroing, and one vpaddw fewer per accumulator */
            __m256i lo, hi, bx;
            __asm__("vmovdqa %[ulo], %[lo]\n\t"
                    "vmovdqa %[uhi], %[hi]\n\t"
                    "vpbroadcastd %[x0], %[bx]\n\t"
                    "vpmaddubsw %[bx], %[lo], %[a0]\n\t"
                    "vpmaddubsw %[bx], %[hi], %[a1]\n\t"
                    "vpbroadcastd %[x1], %[bx]\n\t"
                    "vpmaddubsw %[bx], %[lo], %[a2]\n\t"
                    "vpmaddubsw %[bx], %[hi], %[a3]\n\t"
                    "vpbroadcastd %[x2], %[bx]\n\t"
                    "vpmaddubsw %[bx], %[lo], %[a4]\n\t"
                    "vpmaddubsw %[bx], %[hi], %[a5]\n\t"
                    "vpbroadcastd %[x3], %[bx]\n\t"
                    "vpmaddubsw %[bx], %[lo], %[a6]\n\t"
                    "vpmaddubsw %[bx], %[hi], %[a7]"
                    : [a0] "=&x"(i16[0][0]), [a1] "=&x"(i16[0][1]), [a2] "=&x"(i16[1][0]), [a3] "=&x"(i16[1][1]),
                      [a4] "=&x"(i16[2][0]), [a5] "=&x"(i16[2][1]), [a6] "=&x"(i16[3][0]), [a7] "=&x"(i16[3][1]),
                      [lo] "=&x"(lo), [hi] "=&x"(hi), [bx] "=&x"(bx)
                    : [ulo] "m"(*(const __m256i *)u), [uhi] "m"(*(const __m256i *)(u + 32)),
                      [x0] "m"(*(const int32_t *)x0), [x1] "m"(*(const int32_t *)x1),
                      [x2] "m"(*(const int32_t *)x2), [x3] "m"(*(const int32_t *)x3));
        }
        for (int c = 1; c < 8; c++) {
            madd4_chunk(i16, u + 64 * c, x0 + 4 * c, x1 + 4 * c, x2 + 4 * c, x3 + 4 * c);
        }
        const float *d = fs + (size_t)b * TILE;
        for (int t = 0; t < 4; t++) {
            const __m256 db = _mm256_broadcast_ss(dx + (size_t)t * nbx + b), cb = _mm256_broadcast_ss(cc + (size_t)t * nbx + b);
            acc[t][0] = _mm256_fmadd_ps(_mm256_loadu_ps(d), _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(i16[t][0], ones)), db, cb), acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(_mm256_loadu_ps(d + 8), _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(i16[t][1], ones)), db, cb), acc[t][1]);
        }
    }
    for (int t = 0; t < 4; t++) {
        _mm256_storeu_ps(outbuf + t * TILE, acc[t][0]);
        _mm256_storeu_ps(outbuf + t * TILE + 8, acc[t][1]);
    }
}

/* Split one tile's nibbles into bytes: per 32-block, per chunk, 32 low-nibble then 32 high-nibble bytes. */
T_AVX2 static void unpack_tile_avx2(const glmi4_mat *W, const uint8_t *p, uint8_t *unp) {
    const int ng = W->k_pad / W->group, GB = W->group / QK, hdr = W->asym ? 64 : 32;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int g = 0; g < ng; g++) {
        prefetch_ahead(p, group_bytes(W), (size_t)hdr, GB);
        const uint8_t *q = p + hdr;
        for (int c = 0; c < 8 * GB; c++, unp += 64) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            _mm256_store_si256((__m256i *)unp, _mm256_and_si256(v, m4));
            _mm256_store_si256((__m256i *)(unp + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        }
        p = q + (size_t)GB * 256;
    }
}

T_AVX2 static void gemm4_avx2(const gemm_job *j, int t0, int t1) {
    const glmi4_mat *W = j->W;
    const size_t tb = tile_bytes(W);
    const int nb = W->k_pad / QK, nbx = j->ldq / QK, g32 = W->group == QK && !W->asym;
    float buf[NTMAX * TILE];
    uint8_t *unp = j->M >= UNPACK_M_AVX2 ? xalloc((size_t)nb * 512) : NULL;
    float *fs = NULL, *c8 = NULL;    /* group 32 prefill: the tile's f32 scales, the tokens' -8*xs */
    if (unp && g32) {
        fs = xalloc((size_t)nb * TILE * sizeof(float));
        c8 = xalloc((size_t)j->M * nbx * sizeof(float));
        if (!fs || !c8) { free(fs); free(c8); fs = c8 = NULL; }
        for (int m = 0; c8 && m < j->M; m++)
            for (int b = 0; b < nb; b++) c8[(size_t)m * nbx + b] = -8.f * j->xs[(size_t)m * nbx + b];
    }
    for (int tile = t0; tile < t1; tile++) {
        const uint8_t *p = W->data + (size_t)tile * tb;
        int m = 0;
        if (unp) {
            unpack_tile_avx2(W, p, unp);
            if (fs) {
                const size_t gb = group_bytes(W);
                for (int b = 0; b < nb; b++) {
                    _mm256_storeu_ps(fs + (size_t)b * TILE, ld8_scales(p + b * gb, W->scale_bf16));
                    _mm256_storeu_ps(fs + (size_t)b * TILE + 8, ld8_scales(p + b * gb + 16, W->scale_bf16));
                }
                for (; m + 4 <= j->M; m += 4) { q4_tile4_g32_avx2(j, unp, fs, c8, m, buf); store_tile_avx2(j, tile, m, 4, buf); }
            }
        }
        for (; m + 4 <= j->M; m += 4) { q4_tile_avx2(j, p, unp, m, 4, buf); store_tile_avx2(j, tile, m, 4, buf); }
        for (; m + 2 <= j->M; m += 2) { q4_tile_avx2(j, p, NULL, m, 2, buf); store_tile(j, tile, m, 2, buf); }
        for (; m < j->M; m++) { q4_tile_avx2(j, p, NULL, m, 1, buf); store_tile(j, tile, m, 1, buf); }
    }
    free(unp);
    free(fs);
    free(c8);
}

/* int8 x int8 (output layer): the integer units want one unsigned operand, so multiply |x| by sign(x)*w; MAC(acc,
 * |x|, sign(x)*w) adds the 4-byte dot products into the int32 lanes (vpmaddubsw + vpmaddwd on AVX2, vpdpbusd on
 * AVX-VNNI: the same sums, so the same bits). XA4: blocks of 4 tokens take mac8x4_avx2's step, |x| from xa. */
#define Q8_TILE(NAME, TARGET, MAC, XA4)                                                                            \
TARGET INLINE void NAME(const gemm_job *j, const uint8_t *p, int m, const int NT, float *outbuf) {                    \
    const glmi4_mat *W = j->W;                                                                                        \
    const int ng = W->k_pad / W->group, GB = W->group / QK, bf = W->scale_bf16, nbx = j->ldq / QK;                    \
    __m256 acc[NTMAX][2];                                                                                             \
    for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();                                         \
    for (int g = 0; g < ng; g++) {                                                                                    \
        const __m256 d0 = ld8_scales(p, bf), d1 = ld8_scales(p + 16, bf);                                             \
        __m256 gacc[NTMAX][2];                                                                                        \
        for (int t = 0; t < NT; t++) gacc[t][0] = gacc[t][1] = _mm256_setzero_ps();                                   \
        if (m == 0) prefetch_ahead(p, group_bytes(W), 32, GB);                                                        \
        const uint8_t *q = p + 32;                                                                                    \
        for (int s = 0; s < GB; s++, q += 512) {                                                                      \
            const int b = g * GB + s;                                                                                 \
            __m256i i32[NTMAX][2];                                                                                    \
            for (int t = 0; t < NT; t++) i32[t][0] = i32[t][1] = _mm256_setzero_si256();                              \
            for (int c = 0; c < 8; c++) {                                                                             \
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(q + 64 * c));                                 \
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(q + 64 * c + 32));                            \
                const size_t xo = (size_t)m * j->ldq + b * QK + 4 * c;                                               \
                const int8_t *xc = j->xq + xo;                                                                        \
                if (XA4 && NT == 4 && j->xa) mac8x4_avx2(i32, w0, w1, xc, j->xa + xo, j->ldq);                       \
                else for (int t = 0; t < NT; t++) {                                                                   \
                    const __m256i bx = _mm256_set1_epi32(ld32(xc + (size_t)t * j->ldq));                              \
                    const __m256i ax = _mm256_abs_epi8(bx);                                                           \
                    i32[t][0] = MAC(i32[t][0], ax, _mm256_sign_epi8(w0, bx));                                         \
                    i32[t][1] = MAC(i32[t][1], ax, _mm256_sign_epi8(w1, bx));                                         \
                }                                                                                                     \
            }                                                                                                         \
            for (int t = 0; t < NT; t++) {                                                                            \
                const __m256 db = _mm256_set1_ps(j->dx[(size_t)(m + t) * nbx + b]);                                   \
                gacc[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[t][0]), db, gacc[t][0]);                          \
                gacc[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[t][1]), db, gacc[t][1]);                          \
            }                                                                                                         \
        }                                                                                                             \
        for (int t = 0; t < NT; t++) {                                                                                \
            acc[t][0] = _mm256_fmadd_ps(d0, gacc[t][0], acc[t][0]);                                                   \
            acc[t][1] = _mm256_fmadd_ps(d1, gacc[t][1], acc[t][1]);                                                   \
        }                                                                                                             \
        p = q;                                                                                                        \
    }                                                                                                                 \
    for (int t = 0; t < NT; t++) {                                                                                    \
        _mm256_storeu_ps(outbuf + t * TILE, acc[t][0]);                                                               \
        _mm256_storeu_ps(outbuf + t * TILE + 8, acc[t][1]);                                                           \
    }                                                                                                                 \
}

/* The output layer's tiles in blocks of 4 tokens, then 1 (NT constant in each inlined copy of TILE_FN). */
#define Q8_GEMM(NAME, TILE_FN, TARGET)                                                                        \
TARGET static void NAME(const gemm_job *j, int t0, int t1) {                                                  \
    const size_t tb = tile_bytes(j->W);                                                                       \
    float buf[NTMAX * TILE];                                                                                  \
    for (int tile = t0; tile < t1; tile++) {                                                                  \
        const uint8_t *p = j->W->data + (size_t)tile * tb;                                                    \
        int m = 0;                                                                                            \
        for (; m + 4 <= j->M; m += 4) { TILE_FN(j, p, m, 4, buf); store_tile(j, tile, m, 4, buf); }           \
        for (; m < j->M; m++) { TILE_FN(j, p, m, 1, buf); store_tile(j, tile, m, 1, buf); }                   \
    }                                                                                                         \
}

T_AVX2 INLINE __m256i mac_avx2(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* One chunk (4 bytes of 16 rows: halves w0, w1) against 4 tokens (x and xa = |x|: the first token's 4 bytes,
 * ld apart): the output layer's inner step, eight ops a token, with the 8 accumulators in registers. From
 * intrinsics the compiler keeps two of them on the stack, and the store-to-load round trips on their chains
 * cost more than the ops (151552x2048 at 16 tokens, 2 threads, Xeon's AVX2 tier: 55-61 -> 51-52 ms with xa). */
#define MAC8_TOKEN(A0, A1, X, XA)                  \
    "vpbroadcastd " X ", %[bx]\n\t"                \
    "vpbroadcastd " XA ", %[ax]\n\t"               \
    "vpsignb %[bx], %[w0], %[p0]\n\t"              \
    "vpsignb %[bx], %[w1], %[p1]\n\t"              \
    "vpmaddubsw %[p0], %[ax], %[p0]\n\t"           \
    "vpmaddubsw %[p1], %[ax], %[p1]\n\t"           \
    "vpmaddwd %[ones], %[p0], %[p0]\n\t"           \
    "vpmaddwd %[ones], %[p1], %[p1]\n\t"           \
    "vpaddd %[p0], " A0 ", " A0 "\n\t"             \
    "vpaddd %[p1], " A1 ", " A1 "\n\t"
T_AVX2 INLINE void mac8x2_avx2(__m256i a[2][2], __m256i w0, __m256i w1, __m256i ones, const int8_t *x,
                               const int8_t *xa, int ld) {
    __m256i bx, ax, p0, p1;
    __asm__(MAC8_TOKEN("%[a0]", "%[a1]", "%[x0]", "%[y0]") MAC8_TOKEN("%[a2]", "%[a3]", "%[x1]", "%[y1]")
            : [a0] "+x"(a[0][0]), [a1] "+x"(a[0][1]), [a2] "+x"(a[1][0]), [a3] "+x"(a[1][1]),
              [bx] "=&x"(bx), [ax] "=&x"(ax), [p0] "=&x"(p0), [p1] "=&x"(p1)
            : [w0] "x"(w0), [w1] "x"(w1), [ones] "x"(ones),
              [x0] "m"(*(const int32_t *)x), [x1] "m"(*(const int32_t *)(x + ld)),
              [y0] "m"(*(const int32_t *)xa), [y1] "m"(*(const int32_t *)(xa + ld)));
}
#undef MAC8_TOKEN
T_AVX2 INLINE void mac8x4_avx2(__m256i i32[4][2], __m256i w0, __m256i w1, const int8_t *x, const int8_t *xa, int ld) {
    const __m256i ones = _mm256_set1_epi16(1);
    mac8x2_avx2(i32, w0, w1, ones, x, xa, ld);
    mac8x2_avx2(i32 + 2, w0, w1, ones, x + 2 * (size_t)ld, xa + 2 * (size_t)ld, ld);
}
Q8_TILE(q8_tile_avx2, T_AVX2, mac_avx2, 1)
Q8_GEMM(gemm8_avx2, q8_tile_avx2, T_AVX2)

T_AVX2 static void quant_act_avx2(const float *x, int K, int Kp, int G, int8_t *q, float *dx, float *xs) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const int per = G / QK;
    float gsum = 0.f;
    for (int b = 0; b < Kp / QK; b++) {
        float tmp[QK];
        const float *v = x + b * QK;
        if ((b + 1) * QK > K) {      /* partial block: zero padding */
            for (int i = 0; i < QK; i++) tmp[i] = b * QK + i < K ? x[b * QK + i] : 0.f;
            v = tmp;
        }
        __m256 a0 = _mm256_loadu_ps(v), a1 = _mm256_loadu_ps(v + 8), a2 = _mm256_loadu_ps(v + 16),
               a3 = _mm256_loadu_ps(v + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(a0, absmask), _mm256_and_ps(a1, absmask)),
                                  _mm256_max_ps(_mm256_and_ps(a2, absmask), _mm256_and_ps(a3, absmask)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        dx[b] = amax / 127.f;
        const __m256 vid = _mm256_set1_ps(id);
        const int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a0, vid), R));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a1, vid), R));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a2, vid), R));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a3, vid), R));
        __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
        __m256i p = _mm256_packs_epi16(p01, p23);
        /* packs interleave 128-bit lanes: restore element order */
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QK), p);
        /* the group sum, as quant_finish forms it (same order, exact integer block sums) */
        __m256i is8 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), p), _mm256_set1_epi16(1));
        __m128i is4 = _mm_add_epi32(_mm256_castsi256_si128(is8), _mm256_extracti128_si256(is8, 1));
        is4 = _mm_add_epi32(is4, _mm_shuffle_epi32(is4, 0x4E));
        is4 = _mm_add_epi32(is4, _mm_shuffle_epi32(is4, 0xB1));
        gsum += dx[b] * (float)_mm_cvtsi128_si32(is4);
        if ((b + 1) % per == 0) { xs[b / per] = gsum; gsum = 0.f; }
    }
}

/* ---------------- AVX-VNNI (VEX vpdpbusd on ymm: Alder Lake and later, Zen 5): the AVX2 kernels' layout and
 * float work, with each 4-byte dot product accumulated straight into int32 (one vpdpbusd where AVX2 needs
 * vpmaddubsw + vpaddw, and no vpmaddwd at the block's end). The integer sums are exact in both, and the float
 * operations the same in the same order, so this tier gives the AVX2 tier's bits, whatever the batch. */

T_VX INLINE __m256i dpbusd_vx(__m256i acc, __m256i u, __m256i s) {
#ifdef GLMI4_EMULATE_AVXVNNI
    const __m256i m = _mm256_set1_epi16(0x00FF);
    const __m256i ue = _mm256_and_si256(u, m), uo = _mm256_srli_epi16(u, 8);
    const __m256i se = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), so = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ue, se), _mm256_madd_epi16(uo, so)));
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}

/* NT tokens (1, 2 or 4) against one int4 tile; nibbles split in registers, or read from unp (the tile split by
 * unpack_tile_avx2, from UNPACK_M_AVX2 tokens on). */
T_VX INLINE void q4_tile_vx(const gemm_job *j, const uint8_t *p, const uint8_t *unp, int m, const int NT,
                            float *outbuf) {
    const glmi4_mat *W = j->W;
    const int ng = W->k_pad / W->group, GB = W->group / QK, hdr = W->asym ? 64 : 32, bf = W->scale_bf16;
    const int s32 = GB == 1 && !W->asym;
    const size_t gb = group_bytes(W);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int8_t *xq[NTMAX];
    const float *dx[NTMAX], *xs[NTMAX];
    token_rows(j, m, NT, xq, dx, xs);
    __m256 acc[NTMAX][2];
    for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g++, p += gb) {
        if (m == 0 && !unp) prefetch_ahead(p, gb, (size_t)hdr, GB);
        const __m256 d0 = ld8_scales(p, bf), d1 = ld8_scales(p + 16, bf);
        __m256 gacc[NTMAX][2];
        for (int t = 0; t < NT; t++) gacc[t][0] = gacc[t][1] = _mm256_setzero_ps();
        for (int s = 0; s < GB; s++) {
            const int b = g * GB + s;
            const uint8_t *q = p + hdr + (size_t)s * 256, *u = unp ? unp + (size_t)b * 512 : NULL;
            __m256i i32[NTMAX][2];
            for (int t = 0; t < NT; t++) i32[t][0] = i32[t][1] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                __m256i lo, hi;
                if (u) {
                    lo = _mm256_load_si256((const __m256i *)(u + 64 * c));
                    hi = _mm256_load_si256((const __m256i *)(u + 64 * c + 32));
                } else {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
                    lo = _mm256_and_si256(v, m4);
                    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                }
                for (int t = 0; t < NT; t++) {
                    const __m256i bx = _mm256_set1_epi32(ld32(xq[t] + b * QK + 4 * c));
                    i32[t][0] = dpbusd_vx(i32[t][0], lo, bx);
                    i32[t][1] = dpbusd_vx(i32[t][1], hi, bx);
                }
            }
            for (int t = 0; t < NT; t++) {   /* as q4_tile_avx2 / q4_tile4_g32_avx2 */
                const __m256 db = _mm256_set1_ps(dx[t][b]);
                const __m256 v0 = _mm256_cvtepi32_ps(i32[t][0]), v1 = _mm256_cvtepi32_ps(i32[t][1]);
                if (s32) {
                    const __m256 c8 = _mm256_set1_ps(-8.f * xs[t][g]);
                    acc[t][0] = _mm256_fmadd_ps(d0, _mm256_fmadd_ps(v0, db, c8), acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(d1, _mm256_fmadd_ps(v1, db, c8), acc[t][1]);
                } else {
                    gacc[t][0] = _mm256_fmadd_ps(v0, db, gacc[t][0]);
                    gacc[t][1] = _mm256_fmadd_ps(v1, db, gacc[t][1]);
                }
            }
        }
        if (!s32) group_end_avx2(NT, p, bf, W->asym, xs, g, gacc, acc);
    }
    for (int t = 0; t < NT; t++) {
        _mm256_storeu_ps(outbuf + t * TILE, acc[t][0]);
        _mm256_storeu_ps(outbuf + t * TILE + 8, acc[t][1]);
    }
}

#define Q4VX(NT)                                                                                                \
    T_VX __attribute__((noinline)) static void q4vx_##NT(const gemm_job *j, const uint8_t *p, const uint8_t *unp, \
                                                         int m, float *out) {                                   \
        q4_tile_vx(j, p, unp, m, NT, out);                                                                      \
    }
Q4VX(1) Q4VX(2) Q4VX(4)

T_VX static void gemm4_vx(const gemm_job *j, int t0, int t1) {
    const size_t tb = tile_bytes(j->W);
    float buf[NTMAX * TILE];
    uint8_t *unp = j->M >= UNPACK_M_AVX2 ? xalloc((size_t)(j->W->k_pad / QK) * 512) : NULL;
    for (int tile = t0; tile < t1; tile++) {
        const uint8_t *p = j->W->data + (size_t)tile * tb;
        int m = 0;
        if (unp) unpack_tile_avx2(j->W, p, unp);
        for (; m + 4 <= j->M; m += 4) { q4vx_4(j, p, unp, m, buf); store_tile_avx2(j, tile, m, 4, buf); }
        for (; m + 2 <= j->M; m += 2) { q4vx_2(j, p, NULL, m, buf); store_tile(j, tile, m, 2, buf); }
        for (; m < j->M; m++) { q4vx_1(j, p, NULL, m, buf); store_tile(j, tile, m, 1, buf); }
    }
    free(unp);
}

Q8_TILE(q8_tile_vx, T_VX, dpbusd_vx, 0)
Q8_GEMM(gemm8_vx, q8_tile_vx, T_VX)

/* ---------------- AVX-512 VNNI: one zmm register holds the 16 rows of a tile.
 * Before it is used, native.py compares it with the plain C kernels on random matrices and falls back, with a
 * warning, if they differ; tests/test_cpu_int4.py runs the full kernel checks on any CPU that has it. */

T_VNNI INLINE __m512 ld16_scales(const uint8_t *p, int bf16) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

T_VNNI INLINE int32_t ld32v(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* pf: the next tile, fetched into L2 group by group while this one computes from its unpacked copy or for 16
 * tokens (compute-bound; without it the core waits for memory and computes in turn), or NULL. Every other
 * first pass over a tile (pf set, or one token) streams it with prefetch_ahead instead: decode of 4 and 8
 * sequences +4-6% against the next-tile prefetch (paired A/Bs on the 1b). */
T_VNNI INLINE void prefetch_group(const uint8_t *pf, size_t gb) {
    for (size_t l = 0; pf && l < gb; l += 64) _mm_prefetch((const char *)pf + l, _MM_HINT_T1);
}

/* The float work of one 32-block for NT tokens. S32 (one block per group, symmetric: the scale d is the
 * block's) folds the block straight into acc: acc += d * (dx * isum - c), c = 8 * xs (int4) or
 * 128 * xs (int8, see q8_tile_vnni); otherwise gacc += dx * isum and the group ends in group_end. The
 * same operations in the same order for every NT, so a token's result never depends on its batch. */
T_VNNI INLINE void block_end(const int NT, const int S32, const __m512i *isum, const float *dx, const float *xs,
                             int nbx, int b, __m512 d, float off, __m512 *acc, __m512 *gacc) {
    for (int t = 0; t < NT; t++) {
        const __m512 v = _mm512_cvtepi32_ps(isum[t]), db = _mm512_set1_ps(dx[(size_t)t * nbx + b]);
        if (S32)
            acc[t] = _mm512_fmadd_ps(d, _mm512_fmsub_ps(v, db, _mm512_set1_ps(off * xs[(size_t)t * nbx + b])), acc[t]);
        else
            gacc[t] = _mm512_fmadd_ps(v, db, gacc[t]);
    }
}

T_VNNI INLINE void group_end(const int NT, const __m512 *gacc, const float *xs, int nbx, int g, __m512 d,
                             const uint8_t *mins, int bf, float off, __m512 *acc) {
    for (int t = 0; t < NT; t++) {
        const __m512 xg = _mm512_set1_ps(xs[(size_t)t * nbx + g]);
        if (mins)
            acc[t] = _mm512_fmadd_ps(ld16_scales(mins, bf), xg, _mm512_fmadd_ps(d, gacc[t], acc[t]));
        else
            acc[t] = _mm512_fmadd_ps(d, _mm512_fnmadd_ps(_mm512_set1_ps(off), xg, gacc[t]), acc[t]);
    }
}

/* Split one tile's nibbles into the 64 bytes vpdpbusd takes per chunk (both 256-bit halves get the chunk,
 * the upper one shifted by 4 to take rows 8-15), once for all the tokens of a long product. */
T_VNNI INLINE __m512i split_chunk(const uint8_t *q) {
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)q));
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(v, shift), _mm512_set1_epi8(0x0F));
}

T_VNNI static void unpack_tile_vnni(const glmi4_mat *W, const uint8_t *p, uint8_t *unp) {
    const int ng = W->k_pad / W->group, GB = W->group / QK;
    const size_t gb = group_bytes(W);
    for (int g = 0; g < ng; g++, p += gb)
        for (int c = 0; c < 8 * GB; c++, unp += 64)
            _mm512_store_si512((void *)unp, split_chunk(p + gb - (size_t)GB * 256 + 32 * c));
}

/* NT tokens (1-4 or 8) against one int4 tile: per chunk one vpdpbusd per token on the chunk's 64 weight
 * bytes, split in registers or (UNP) read from the tile unpack_tile_vnni split. */
T_VNNI INLINE void q4_tile_vnni(const gemm_job *j, const uint8_t *p, const uint8_t *pf, const uint8_t *unp, int m,
                                const int NT, const int S32, const int UNP, float *outbuf) {
    const glmi4_mat *W = j->W;
    const int ng = W->k_pad / W->group, GB = W->group / QK, hdr = W->asym ? 64 : 32, bf = W->scale_bf16;
    const int nbx = j->ldq / QK;
    const size_t gb = group_bytes(W);
    const int8_t *xq = j->xq + (size_t)m * j->ldq;
    const float *dx = j->dx + (size_t)m * nbx, *xs = j->xs + (size_t)m * nbx;
    __m512 acc[8], gacc[8];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++, p += gb) {
        if (UNP) prefetch_group(pf ? pf + g * gb : NULL, gb);
        else if (NT == 1 || pf) prefetch_ahead(p, gb, (size_t)hdr, GB);
        const __m512 d = ld16_scales(p, bf);
        for (int t = 0; t < NT; t++) gacc[t] = _mm512_setzero_ps();
        for (int s = 0; s < (S32 ? 1 : GB); s++) {
            const int b = g * GB + s;
            const uint8_t *q = p + hdr + s * 256, *u = unp + (size_t)b * 512;
            __m512i isum[8];
            for (int t = 0; t < NT; t++) isum[t] = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) {
                const __m512i w = UNP ? _mm512_load_si512((const void *)(u + 64 * c)) : split_chunk(q + 32 * c);
                for (int t = 0; t < NT; t++)
                    isum[t] = _mm512_dpbusd_epi32(isum[t], w, _mm512_set1_epi32(ld32v(xq + (size_t)t * j->ldq + b * QK + 4 * c)));
            }
            block_end(NT, S32, isum, dx, xs, nbx, b, d, 8.f, acc, gacc);
        }
        if (!S32) group_end(NT, gacc, xs, nbx, g, d, W->asym ? p + 32 : NULL, bf, 8.f, acc);
    }
    for (int t = 0; t < NT; t++) _mm512_storeu_ps(outbuf + t * TILE, acc[t]);
}

/* Every (tokens, S32, UNP) variant compiled as its own function: inlined together into one, they compete
 * for registers and the one-token loop (decode) loses 15% to spilled addresses. */
typedef void (*tile_fn)(const gemm_job *, const uint8_t *, const uint8_t *, const uint8_t *, int, float *);
#define Q4V(NT, S32, UNP)                                                                                      \
    T_VNNI __attribute__((noinline)) static void q4v_##NT##_##S32##_##UNP(                                     \
        const gemm_job *j, const uint8_t *p, const uint8_t *pf, const uint8_t *unp, int m, float *out) {       \
        q4_tile_vnni(j, p, pf, unp, m, NT, S32, UNP, out);                                                     \
    }
Q4V(1, 0, 0) Q4V(2, 0, 0) Q4V(3, 0, 0) Q4V(4, 0, 0) Q4V(8, 0, 0) Q4V(8, 0, 1)
Q4V(1, 1, 0) Q4V(2, 1, 0) Q4V(3, 1, 0) Q4V(4, 1, 0) Q4V(8, 1, 0) Q4V(8, 1, 1)

/* The tokens of a tile from m on in blocks of 4 (fn[1]), then the 1-3 left in one block (fn[2..4]: 3, 2, 1); the
 * first block fetches the next tile (the one-token kernel streams with prefetches of its own). Two or three
 * tokens -- a batch of two, an expert chosen by a few tokens of a step, a short draft -- read the tile once,
 * not once per token (on a Xeon, 2048x2048 g32: 2 tokens 66 -> 43 µs, one token 33). */
static void tiles_tail(const gemm_job *j, int tile, int m, const uint8_t *p, const uint8_t *next,
                       tile_fn const fn[5], float *buf) {
    for (; m + 4 <= j->M; m += 4) { fn[1](j, p, m ? NULL : next, NULL, m, buf); store_tile(j, tile, m, 4, buf); }
    const int rest = j->M - m;
    if (rest) {
        fn[5 - rest](j, p, m ? NULL : next, NULL, m, buf);
        store_tile(j, tile, m, rest, buf);
    }
}

/* The tokens of a product in blocks of 8 (fn[0]), then the tail; the first block of each tile fetches the next
 * tile. unp (from UNPACK_M tokens on) holds the tile unpacked, for fn_unp. */
static void tiles_run(const gemm_job *j, int t0, int t1, tile_fn const fn[5], tile_fn fn_unp, uint8_t *unp,
                      void (*unpack)(const glmi4_mat *, const uint8_t *, uint8_t *)) {
    const size_t tb = tile_bytes(j->W);
    float buf[8 * TILE];
    for (int tile = t0; tile < t1; tile++) {
        const uint8_t *p = j->W->data + (size_t)tile * tb, *next = tile + 1 < t1 ? p + tb : NULL;
        int m = 0;
        if (unp) unpack(j->W, p, unp);
        for (; m + 8 <= j->M; m += 8) {
            (unp ? fn_unp : fn[0])(j, p, m ? NULL : next, unp, m, buf);
            store_tile(j, tile, m, 8, buf);
        }
        tiles_tail(j, tile, m, p, next, fn, buf);
    }
}

/* 16 tokens against one g32 tile: per chunk the weights are loaded (and the nibbles split) once for all 16
 * (the 8-token kernels do it twice, and their 8 dependency chains leave vpdpbusd's latency exposed), then each
 * token's block ends exactly as in q4_tile_vnni / q8_tile_vnni (S32), so the results are the same bits
 * whatever the batch. acc: 16 x 16 floats, in L1. */
T_VNNI INLINE void v16_tile(const gemm_job *j, const uint8_t *p, const uint8_t *pf, const act16 *a, float *acc,
                            const int BITS) {
    const glmi4_mat *W = j->W;
    const int ng = W->k_pad / W->group, bf = W->scale_bf16;
    const size_t gb = group_bytes(W);
    for (int t = 0; t < 16; t++) _mm512_storeu_ps(acc + 16 * t, _mm512_setzero_ps());
    for (int g = 0; g < ng; g++, p += gb) {
        prefetch_group(pf ? pf + g * gb : NULL, gb);
        const __m512 d = ld16_scales(p, bf);
        const uint8_t *q = p + 32;
        const int8_t *xb = a->x + (size_t)g * 8 * 64;
        __m512i isum[16];
        for (int t = 0; t < 16; t++) isum[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const __m512i w = BITS == 4 ? split_chunk(q + 32 * c)
                                        : _mm512_xor_si512(_mm512_loadu_si512((const void *)(q + 64 * c)),
                                                           _mm512_set1_epi8((char)0x80));
            for (int t = 0; t < 16; t++)
                isum[t] = _mm512_dpbusd_epi32(isum[t], w, _mm512_set1_epi32(ld32v(xb + c * 64 + 4 * t)));
        }
        for (int t = 0; t < 16; t++) {
            const __m512 v = _mm512_cvtepi32_ps(isum[t]);
            _mm512_storeu_ps(acc + 16 * t, _mm512_fmadd_ps(d, _mm512_fmsub_ps(v, _mm512_set1_ps(a->dx[g * 16 + t]),
                                                                              _mm512_set1_ps(a->c[g * 16 + t])),
                                                           _mm512_loadu_ps(acc + 16 * t)));
        }
    }
}

typedef void (*tile16_fn)(const gemm_job *, const uint8_t *, const uint8_t *, const act16 *, float *);
T_VNNI __attribute__((noinline)) static void q4v16_s32(const gemm_job *j, const uint8_t *p, const uint8_t *pf,
                                                        const act16 *a, float *acc) {
    v16_tile(j, p, pf, a, acc, 4);
}
T_VNNI __attribute__((noinline)) static void q8v16_s32(const gemm_job *j, const uint8_t *p, const uint8_t *pf,
                                                        const act16 *a, float *acc) {
    v16_tile(j, p, pf, a, acc, 8);
}

/* The laid-out tokens 16 at a time through fn16 (measured on the 1b, 16 sequences decoding: int4 +8%
 * aggregate decode, paired A/B), the rest through the 8/4/3/2/1-token kernels fn[0..4]. */
T_VNNI static void tiles_run16(const gemm_job *j, int t0, int t1, tile16_fn fn16, tile_fn const fn[5]) {
    const size_t tb = tile_bytes(j->W);
    float buf[16 * TILE];
    for (int tile = t0; tile < t1; tile++) {
        const uint8_t *p = j->W->data + (size_t)tile * tb, *next = tile + 1 < t1 ? p + tb : NULL;
        int m = 0;
        for (int k = 0; k < j->n16; k++, m += 16) {
            fn16(j, p, k ? NULL : next, &j->a16[k], buf);
            store_tile(j, tile, m, 16, buf);
        }
        for (; m + 8 <= j->M; m += 8) { fn[0](j, p, m ? NULL : next, NULL, m, buf); store_tile(j, tile, m, 8, buf); }
        tiles_tail(j, tile, m, p, next, fn, buf);
    }
}

T_VNNI static void gemm4_vnni(const gemm_job *j, int t0, int t1) {
    static tile_fn const fns[2][5] = {{q4v_8_0_0, q4v_4_0_0, q4v_3_0_0, q4v_2_0_0, q4v_1_0_0},
                                      {q4v_8_1_0, q4v_4_1_0, q4v_3_1_0, q4v_2_1_0, q4v_1_1_0}};
    const int s32 = j->W->group == QK && !j->W->asym;
    if (j->a16) {
        tiles_run16(j, t0, t1, q4v16_s32, fns[1]);
        return;
    }
    uint8_t *unp = j->M >= UNPACK_M ? xalloc((size_t)(j->W->k_pad / QK) * 512) : NULL;
    tiles_run(j, t0, t1, fns[s32], s32 ? q4v_8_1_1 : q4v_8_0_1, unp, unpack_tile_vnni);
    free(unp);
}

/* int8 weights: vpdpbusd wants u8 x s8, so use (q ^ 0x80) = q + 128 and subtract 128 * sum(x). */
T_VNNI INLINE void q8_tile_vnni(const gemm_job *j, const uint8_t *p, const uint8_t *pf, int m, const int NT,
                                const int S32, float *outbuf) {
    const glmi4_mat *W = j->W;
    const int ng = W->k_pad / W->group, GB = W->group / QK, bf = W->scale_bf16, nbx = j->ldq / QK;
    const size_t gb = group_bytes(W);
    const int8_t *xq = j->xq + (size_t)m * j->ldq;
    const float *dx = j->dx + (size_t)m * nbx, *xs = j->xs + (size_t)m * nbx;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[8], gacc[8];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++, p += gb) {
        if (NT == 1 || pf) prefetch_ahead(p, gb, 32, GB);
        const __m512 d = ld16_scales(p, bf);
        for (int t = 0; t < NT; t++) gacc[t] = _mm512_setzero_ps();
        const uint8_t *q = p + 32;
        for (int s = 0; s < (S32 ? 1 : GB); s++, q += 512) {
            const int b = g * GB + s;
            __m512i isum[8];
            for (int t = 0; t < NT; t++) isum[t] = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) {
                const __m512i v = _mm512_xor_si512(_mm512_loadu_si512((const void *)(q + 64 * c)), flip);
                for (int t = 0; t < NT; t++)
                    isum[t] = _mm512_dpbusd_epi32(isum[t], v, _mm512_set1_epi32(ld32v(xq + (size_t)t * j->ldq + b * QK + 4 * c)));
            }
            block_end(NT, S32, isum, dx, xs, nbx, b, d, 128.f, acc, gacc);
        }
        if (!S32) group_end(NT, gacc, xs, nbx, g, d, NULL, bf, 128.f, acc);
    }
    for (int t = 0; t < NT; t++) _mm512_storeu_ps(outbuf + t * TILE, acc[t]);
}

#define Q8V(NT, S32)                                                                                           \
    T_VNNI __attribute__((noinline)) static void q8v_##NT##_##S32(                                             \
        const gemm_job *j, const uint8_t *p, const uint8_t *pf, const uint8_t *unp, int m, float *out) {       \
        (void)unp;                                                                                             \
        q8_tile_vnni(j, p, pf, m, NT, S32, out);                                                               \
    }
Q8V(1, 0) Q8V(2, 0) Q8V(3, 0) Q8V(4, 0) Q8V(8, 0) Q8V(1, 1) Q8V(2, 1) Q8V(3, 1) Q8V(4, 1) Q8V(8, 1)

T_VNNI static void gemm8_vnni(const gemm_job *j, int t0, int t1) {
    static tile_fn const fns[2][5] = {{q8v_8_0, q8v_4_0, q8v_3_0, q8v_2_0, q8v_1_0},
                                      {q8v_8_1, q8v_4_1, q8v_3_1, q8v_2_1, q8v_1_1}};
    if (j->a16) tiles_run16(j, t0, t1, q8v16_s32, fns[1]);
    else tiles_run(j, t0, t1, fns[j->W->group == QK], NULL, NULL, NULL);
}
#endif /* GLMI4_X86 */

typedef void (*gemm_fn)(const gemm_job *, int, int);
typedef void (*quant_fn)(const float *, int, int, int, int8_t *, float *, float *);

static gemm_fn pick_gemm(int isa, int bits) {
#if GLMI4_X86
    if (isa == ISA_VNNI) return bits == 8 ? gemm8_vnni : gemm4_vnni;
    if (isa == ISA_AVX2) return bits == 8 ? gemm8_avx2 : gemm4_avx2;
    if (isa == ISA_AVXVNNI) return bits == 8 ? gemm8_vx : gemm4_vx;
#endif
    (void)isa;
    return bits == 8 ? gemm8_ref : gemm4_ref;
}

static quant_fn pick_quant(int isa) {
#if GLMI4_X86
    if (isa != ISA_REF) return quant_act_avx2;
#endif
    (void)isa;
    return quant_act_ref;
}

/* Several independent products (the experts of a step, the heads of latent attention) in one parallel
 * region: their tiles are numbered one after the other and handed out together. */
typedef struct {
    gemm_job *jobs;
    int n, total, chunk;
    _Atomic int next;
} gemm_batch;

static void gemm_task(void *arg, int tid, int nth) {
    (void)tid;
    gemm_batch *b = arg;
    int k = 0;                /* the job of the last piece: pieces only move forward */
    for (;;) {
        /* guided: big pieces first (long streams), ever smaller towards the end, so the threads finish
         * together; a thread slowed by another process simply takes fewer pieces */
        int t0 = atomic_load(&b->next), n;
        do {
            if (t0 >= b->total) return;
            n = (b->total - t0) / (2 * nth);
            if (n < b->chunk) n = b->chunk;
        } while (!atomic_compare_exchange_weak(&b->next, &t0, t0 + n));
        for (int t = t0, end = imin(t0 + n, b->total); t < end;) {
            while (t >= b->jobs[k].first + b->jobs[k].ntiles) k++;
            const gemm_job *j = &b->jobs[k];
            const int e = imin(end, j->first + j->ntiles);
            j->fn(j, t - j->first, e - j->first);
            t = e;
        }
    }
}

/* Run n products (W, M, xq, dx, xs, ldq, out, ldo, bias, accum set by the caller) together. */
static void run_gemms(pool *p, int isa, gemm_job *jobs, int n) {
    gemm_batch b = {.jobs = jobs, .n = n};
    size_t work = 0;
    for (int i = 0; i < n; i++) {
        gemm_job *j = &jobs[i];
        j->ntiles = j->W->n_pad / TILE;
        j->first = b.total;
        j->fn = pick_gemm(isa, j->W->bits);
        j->a16 = NULL;
        j->n16 = 0;
        j->xa = NULL;
        if (uses_act16(isa, j->W, j->M)) act16_build(j);
        if (uses_abs(isa, j->W, j->M)) abs_build(j);
        b.total += j->ntiles;
        work += (size_t)j->W->n_pad * j->W->k_pad * j->M;
    }
    if (!b.total) return;
    const int nth = p ? p->nth : 1;
    b.chunk = b.total / (nth * 32);   /* the smallest piece */
    if (b.chunk < 1) b.chunk = 1;
    atomic_store(&b.next, 0);
    atomic_fetch_add(&g_calls[isa], (uint64_t)n);
    if (work < SMALL_WORK) gemm_task(&b, 0, 1);   /* waking threads costs more */
    else pool_run(p, gemm_task, &b);
    for (int i = 0; i < n; i++) { act16_free(&jobs[i]); free(jobs[i].xa); jobs[i].xa = NULL; }
}

/* out[M][n] (+)= x[M][k] @ W.T (+ bias); activations already quantized. */
static void run_gemm(pool *p, int isa, const glmi4_mat *W, int M, const int8_t *xq, const float *dx,
                     const float *xs, int ldq, float *out, int ldo, const float *bias, int accum) {
    gemm_job j = {.W = W, .M = M, .xq = xq, .dx = dx, .xs = xs, .ldq = ldq, .out = out, .ldo = ldo,
                  .bias = bias, .accum = accum};
    run_gemms(p, isa, &j, 1);
}

/* ------------------------------------------------------------------ attention and element-wise ops */

#if GLMI4_X86
/* exp(x) for x <= 88 (Cephes polynomial, ~1 ulp): clamp, x = n ln2 + r (ln2 in two parts), exp(r) by a
 * degree-6 polynomial, times 2^n. exp8 (AVX2) and exp16 (AVX-512) share these constants, so every lane gives
 * the same bits on either ISA. Used by softmax and SiLU. */
static const float EXP_CLAMP[2] = {-87.3f, 88.3f}, EXP_LN2[2] = {0.693359375f, -2.12194440e-4f};
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
#define EXP_LOG2E 1.44269504088896341f

T_AVX2 INLINE __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_CLAMP[0])), _mm256_set1_ps(EXP_CLAMP[1]));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(EXP_LN2[0]), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(EXP_LN2[1]), x);
    __m256 y = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_POLY[i]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

T_AVX2 INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

typedef struct model model;

struct model {
    glmi4_spec s;
    glmi4_layer *layers;       /* own copy of the layer table; with a NextN layer, it is layers[n_layers] */
    int kv_layers;             /* cached layers per slot: n_layers, plus the NextN layer's */
    int isa;
    int *base, *len;           /* per slot, a ring buffer: position i lives at (base + i) % capacity */
    int *tslot, *tpos, *trow;  /* per token of the chunk in flight: its slot, position; rows wanting logits */
    pool *pool;
    void *kc, *vc;             /* [slots][layers][n_kv][capacity][head_dim], f32 or f16 */
    size_t kv_elt;
    float *x, *h, *qkv, *att, *ff;
    int8_t *aq;
    float *adx, *axs;
    int ldq;                   /* activation row stride: the largest k_pad */
    float *scores;             /* per thread: [group heads][capacity] */
    float *rowbuf;             /* per thread: ROWBUF(head_dim, group) floats: K/V rows, outputs, a block of rows */
    int kvh, kvw;              /* cache rows per position and layer, and their width: n_kv x head_dim, or one
                                  latent row of kv_lora + rot_dim (latent attention; no V cache) */
    float *tmp;                /* per thread: [ldq] floats, a row on its way to quantization */
    /* MoE (sized for max_batch tokens x top_k assignments) */
    int *eid, *apos, *cnt, *start;    /* per token: chosen experts [T][k], their assignment rows; per expert */
    float *ew, *rscore;        /* per token: the chosen experts' weights [T][k]; per thread: scores [3][experts] */
    int8_t *eq;                /* assignment rows' quantized activations [A][ldq] */
    float *edx, *exs, *eup, *eout, *sup, *sout;
    gemm_job *jobs;            /* one per expert (+ the shared one) or per head */
    /* latent attention (sized for max_batch tokens) */
    float *qa, *kva, *qf, *qlat, *olat, *vout;
    int8_t *hq;                /* per (token, head) quantized rows [T][heads][hkp] */
    float *hdx, *hxs;
    int hkp;                   /* the per-head rows' stride: the larger of nope and kv_lora, padded */
    glmi4_mat *uk, *uv;        /* [layers][heads]: each head's rows of kv_uk and kv_uv */
    float *mla_scratch;        /* the fast tiers' chunked latent attention (NULL: the plain one): per thread,
                                  see mla_thread_floats */
    float *mla_parts, *mla_ml; /* its chunks' partial results (split mode); per token, the running max and sum */
    int *mla_blk;              /* its token blocks */
};

/* element offset of position p (physical) of a cache row in a slot's region */
static inline size_t kv_off(const model *m, int slot, int layer, int kvh, int p) {
    const glmi4_spec *s = &m->s;
    return ((((size_t)slot * m->kv_layers + layer) * m->kvh + kvh) * s->capacity + p) * m->kvw;
}

static inline int phys(const model *m, int slot, int i) {
    int p = m->base[slot] + i;
    return p >= m->s.capacity ? p - m->s.capacity : p;
}

static inline void kv_get(const model *m, const void *c, size_t off, float *dst, int n) {
    if (m->s.kv_f16) {
        const uint16_t *h = (const uint16_t *)c + off;
        for (int i = 0; i < n; i++) dst[i] = h2f(h[i]);
    } else {
        memcpy(dst, (const float *)c + off, sizeof(float) * (size_t)n);
    }
}

static inline void kv_put(const model *m, void *c, size_t off, const float *src, int n) {
    if (m->s.kv_f16) {
        uint16_t *h = (uint16_t *)c + off;
        for (int i = 0; i < n; i++) h[i] = f2h(src[i]);
    } else {
        memcpy((float *)c + off, src, sizeof(float) * (size_t)n);
    }
}

#if GLMI4_X86
T_AVX2 static void kv_get_avx2(const model *m, const void *c, size_t off, float *dst, int n) {
    if (!m->s.kv_f16) { memcpy(dst, (const float *)c + off, sizeof(float) * (size_t)n); return; }
    const uint16_t *h = (const uint16_t *)c + off;
    for (int i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
}
#endif

#if GLMI4_X86
/* f32 -> f16 with F16C, round to nearest even like f2h */
T_AVX2 static void kv_put_f16c(void *c, size_t off, const float *src, int n) {
    uint16_t *h = (uint16_t *)c + off;
    for (int i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
}
#endif

typedef struct {
    model *m;
    int layer, T, hsplit, nitems;
    _Atomic int next;
} attn_job;

/* One (token, kv head, part of its query heads) item; plain C. */
static void attn_item_ref(model *m, attn_job *a, int item, int tid) {
    const glmi4_spec *s = &m->s;
    const int hd = s->head_dim, grp = s->n_heads / s->n_kv, per = grp / a->hsplit, ldq = s->n_heads * hd + 2 * s->n_kv * hd;
    const int t = item / (s->n_kv * a->hsplit), kvh = (item / a->hsplit) % s->n_kv, part = item % a->hsplit;
    const int h0 = kvh * grp + part * per, slot = m->tslot[t], n = m->tpos[t] + 1;
    const float scale = 1.f / sqrtf((float)hd);
    float *sc = m->scores + (size_t)tid * grp * s->capacity;
    float *row = m->rowbuf + (size_t)tid * ROWBUF(hd, grp);
    float *acc = row + hd;
    const float *q = m->qkv + (size_t)t * ldq + (size_t)h0 * hd;
    for (int i = 0; i < n; i++) {
        kv_get(m, m->kc, kv_off(m, slot, a->layer, kvh, phys(m, slot, i)), row, hd);
        for (int h = 0; h < per; h++) {
            float d = 0.f;
            for (int e = 0; e < hd; e++) d += q[h * hd + e] * row[e];
            sc[(size_t)h * n + i] = d * scale;
        }
    }
    for (int h = 0; h < per; h++) {
        float *r = sc + (size_t)h * n, mx = r[0], sum = 0.f;
        for (int i = 1; i < n; i++) mx = fmaxf(mx, r[i]);
        for (int i = 0; i < n; i++) { r[i] = expf(r[i] - mx); sum += r[i]; }
        for (int i = 0; i < n; i++) r[i] /= sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)per * hd);
    for (int i = 0; i < n; i++) {
        kv_get(m, m->vc, kv_off(m, slot, a->layer, kvh, phys(m, slot, i)), row, hd);
        for (int h = 0; h < per; h++) {
            const float p = sc[(size_t)h * n + i];
            for (int e = 0; e < hd; e++) acc[h * hd + e] += p * row[e];
        }
    }
    memcpy(m->att + (size_t)t * s->n_heads * hd + (size_t)h0 * hd, acc, sizeof(float) * (size_t)per * hd);
}

#if GLMI4_X86
/* 8 sums of 8 lanes each -> one vector [sum(a0) .. sum(a7)] */
T_AVX2 INLINE __m256 reduce8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* One (token, kv head, part of its query heads) item: the cached rows are converted to f32 ATT_BLK at a
 * time and shared by the item's query heads; scores 8 positions at a time (one horizontal reduction per
 * 8 dot products), and the weighted sum of V with a head's 64 outputs held in registers over a block. */
T_AVX2 static void attn_item_avx2(model *m, attn_job *a, int item, int tid) {
    const glmi4_spec *s = &m->s;
    const int hd = s->head_dim, grp = s->n_heads / s->n_kv, per = grp / a->hsplit, ldq = s->n_heads * hd + 2 * s->n_kv * hd;
    const int t = item / (s->n_kv * a->hsplit), kvh = (item / a->hsplit) % s->n_kv, part = item % a->hsplit;
    const int h0 = kvh * grp + part * per, slot = m->tslot[t], n = m->tpos[t] + 1;
    const float scale = 1.f / sqrtf((float)hd);
    float *sc = m->scores + (size_t)tid * grp * s->capacity;
    float *acc = m->rowbuf + (size_t)tid * ROWBUF(hd, grp), *blk = acc + (size_t)hd * (2 + grp);
    const float *q = m->qkv + (size_t)t * ldq + (size_t)h0 * hd;
    for (int i0 = 0; i0 < n; i0 += ATT_BLK) {
        const int nb = imin(ATT_BLK, n - i0);
        for (int r = 0; r < nb; r++) kv_get_avx2(m, m->kc, kv_off(m, slot, a->layer, kvh, phys(m, slot, i0 + r)), blk + r * hd, hd);
        for (int h = 0; h < per; h++) {
            const float *qh = q + h * hd;
            float *out = sc + (size_t)h * n + i0;
            int r = 0;
            for (; r + 8 <= nb; r += 8) {
                __m256 d[8];
                for (int k = 0; k < 8; k++) d[k] = _mm256_setzero_ps();
                for (int e = 0; e < hd; e += 8) {
                    const __m256 qv = _mm256_loadu_ps(qh + e);
                    for (int k = 0; k < 8; k++) d[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(blk + (r + k) * hd + e), d[k]);
                }
                _mm256_storeu_ps(out + r, _mm256_mul_ps(reduce8(d), _mm256_set1_ps(scale)));
            }
            for (; r < nb; r++) {
                __m256 d = _mm256_setzero_ps();
                for (int e = 0; e < hd; e += 8) d = _mm256_fmadd_ps(_mm256_loadu_ps(qh + e), _mm256_loadu_ps(blk + r * hd + e), d);
                out[r] = hsum8(d) * scale;
            }
        }
    }
    for (int h = 0; h < per; h++) {
        float *r = sc + (size_t)h * n, mx;
        int i = 0;
        {   /* the max, 8 at a time (fmaxf is a library call here) */
            __m256 v = _mm256_set1_ps(r[0]);
            for (; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(r + i));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            for (; i < n; i++) mx = r[i] > mx ? r[i] : mx;
        }
        const __m256 vm = _mm256_set1_ps(mx);
        __m256 vs = _mm256_setzero_ps();
        i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(r + i), vm));
            _mm256_storeu_ps(r + i, e);
            vs = _mm256_add_ps(vs, e);
        }
        float sum = hsum8(vs);
        for (; i < n; i++) { r[i] = expf(r[i] - mx); sum += r[i]; }
        const __m256 inv = _mm256_set1_ps(1.f / sum);
        for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(r + i, _mm256_mul_ps(_mm256_loadu_ps(r + i), inv));
        for (; i < n; i++) r[i] *= 1.f / sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)per * hd);
    for (int i0 = 0; i0 < n; i0 += ATT_BLK) {
        const int nb = imin(ATT_BLK, n - i0);
        for (int r = 0; r < nb; r++) kv_get_avx2(m, m->vc, kv_off(m, slot, a->layer, kvh, phys(m, slot, i0 + r)), blk + r * hd, hd);
        for (int h = 0; h < per; h++) {
            const float *p = sc + (size_t)h * n + i0;
            int e0 = 0;
            for (; e0 + 64 <= hd; e0 += 64) {           /* 64 outputs in 8 registers over the block */
                float *o = acc + h * hd + e0;
                __m256 v[8];
                for (int k = 0; k < 8; k++) v[k] = _mm256_loadu_ps(o + 8 * k);
                for (int r = 0; r < nb; r++) {
                    const __m256 pr = _mm256_broadcast_ss(p + r);
                    for (int k = 0; k < 8; k++) v[k] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(blk + r * hd + e0 + 8 * k), v[k]);
                }
                for (int k = 0; k < 8; k++) _mm256_storeu_ps(o + 8 * k, v[k]);
            }
            for (; e0 < hd; e0 += 8) {                  /* head_dim not a multiple of 64: the rest, 8 at a time */
                __m256 v = _mm256_loadu_ps(acc + h * hd + e0);
                for (int r = 0; r < nb; r++) v = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r), _mm256_loadu_ps(blk + r * hd + e0), v);
                _mm256_storeu_ps(acc + h * hd + e0, v);
            }
        }
    }
    memcpy(m->att + (size_t)t * s->n_heads * hd + (size_t)h0 * hd, acc, sizeof(float) * (size_t)per * hd);
}

/* exp8 on 16 lanes (the same constants and operations) */
T_VNNI INLINE __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_CLAMP[0])), _mm512_set1_ps(EXP_CLAMP[1]));
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_LN2[0]), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_LN2[1]), x);
    __m512 y = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_POLY[i]));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* L consecutive floats repeated over 16 lanes; a broadcast load, no shuffle */
T_VNNI INLINE __m512 bcast_l(const float *p, const int L) {
    if (L == 2) { double d; memcpy(&d, p, 8); return _mm512_castpd_ps(_mm512_set1_pd(d)); }
    if (L == 4) return _mm512_broadcast_f32x4(_mm_loadu_ps(p));
    if (L == 8) return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)p)));
    return _mm512_loadu_ps(p);
}

/* Scores of the 16/L heads packed in q2 against 16 rows. q2 holds, per L dims, lane s*L+l = q_s[e+l], and the
 * row's L dims are broadcast, so one FMA does L dims of 16/L dot products (as many FMAs as 16-wide dots) and
 * a dot product ends as L lanes, not 16: log2(L) rounds of (even lanes + odd lanes) of row pairs leave
 * [row][head] scores, 16 per vector, with 3 to 4 shuffles per 16 scores instead of a full reduction each.
 * A head's lanes and their sum order do not depend on the other heads in q2. */
T_VNNI INLINE void att_scores16(const float *q2, const float *const *kr, int hd, const int L, float scale, float *out,
                                int nrow) {
    const int HV = 16 / L;
    __m512 acc[16];
    for (int k = 0; k < 16; k++) acc[k] = _mm512_setzero_ps();
    for (int j = 0; j < hd; j += L) {
        const __m512 qv = _mm512_loadu_ps(q2 + (size_t)j * HV);
        for (int k = 0; k < 16; k++) acc[k] = _mm512_fmadd_ps(qv, bcast_l(kr[k] + j, L), acc[k]);
    }
    const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
    int nv = 16;
    for (int w = L; w > 1; w /= 2, nv /= 2)
        for (int k = 0; k < nv / 2; k++)
            acc[k] = _mm512_add_ps(_mm512_permutex2var_ps(acc[2 * k], ev, acc[2 * k + 1]),
                                   _mm512_permutex2var_ps(acc[2 * k], od, acc[2 * k + 1]));
    for (int k = 0; k < nv; k++) {          /* vector k: rows k*L .. k*L+L-1 */
        const int valid = (nrow - k * L) * HV;
        if (valid <= 0) break;
        const __mmask16 mk = valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
        _mm512_mask_storeu_ps(out + k * 16, mk, _mm512_mul_ps(acc[k], _mm512_set1_ps(scale)));
    }
}

/* NH heads x NZ*16 outputs in registers, streaming a block's V rows (each loaded once for the NH heads);
 * head h's probabilities: ph[h][r * HV] */
T_VNNI INLINE void att_pv_tile(float *o, int hd, const float *const *ph, int HV, const float *const *vr, int e0, int nb,
                               const int NH, const int NZ) {
    __m512 acc[4][4];
    for (int h = 0; h < NH; h++)
        for (int z = 0; z < NZ; z++) acc[h][z] = _mm512_loadu_ps(o + h * hd + e0 + 16 * z);
    for (int r = 0; r < nb; r++) {
        __m512 v[4];
        for (int z = 0; z < NZ; z++) v[z] = _mm512_loadu_ps(vr[r] + e0 + 16 * z);
        for (int h = 0; h < NH; h++) {
            const __m512 pr = _mm512_set1_ps(ph[h][(size_t)r * HV]);
            for (int z = 0; z < NZ; z++) acc[h][z] = _mm512_fmadd_ps(pr, v[z], acc[h][z]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int z = 0; z < NZ; z++) _mm512_storeu_ps(o + h * hd + e0 + 16 * z, acc[h][z]);
}

T_VNNI static void att_pv(float *o, int hd, const float *const *ph, int HV, const float *const *vr, int nb, int nh) {
#define PV_TILE(NZ)                                                           \
    switch (nh) {                                                             \
    case 1: att_pv_tile(o, hd, ph, HV, vr, e0, nb, 1, NZ); break;              \
    case 2: att_pv_tile(o, hd, ph, HV, vr, e0, nb, 2, NZ); break;              \
    case 3: att_pv_tile(o, hd, ph, HV, vr, e0, nb, 3, NZ); break;              \
    default: att_pv_tile(o, hd, ph, HV, vr, e0, nb, 4, NZ); break;             \
    }
    int e0 = 0;
    for (; e0 + 64 <= hd; e0 += 64) PV_TILE(4)
    for (; e0 < hd; e0 += 16) PV_TILE(1)
#undef PV_TILE
}

/* r[i] = exp(r[i] - max) over n positions of the HV heads interleaved in r ([position][head], HV a power of two
 * <= 16); max and sum are vertical, then the lanes of a head are folded (a head's sum order is fixed by HV
 * alone). Lane x of *vmax / *vsum: head x % HV's max and sum. */
T_VNNI static void softmax16_exp(float *r, int n, int HV, __m512 *vmax, __m512 *vsum) {
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int nf = n * HV;
    __m512 vm = _mm512_set1_ps(-INFINITY), vs = _mm512_setzero_ps();
    for (int i = 0; i < nf; i += 16) {
        const __mmask16 mk = nf - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nf - i)) - 1);
        vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mk, r + i));
    }
    for (int d = 8; d >= HV; d /= 2)     /* fold the lanes of a head (max is exact: order does not matter) */
        vm = _mm512_max_ps(vm, _mm512_permutexvar_ps(_mm512_xor_si512(iota, _mm512_set1_epi32(d)), vm));
    for (int i = 0; i < nf; i += 16) {
        const __mmask16 mk = nf - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nf - i)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, r + i), vm));
        _mm512_mask_storeu_ps(r + i, mk, e);
        vs = _mm512_mask_add_ps(vs, mk, vs, e);
    }
    for (int d = 8; d >= HV; d /= 2)
        vs = _mm512_add_ps(vs, _mm512_permutexvar_ps(_mm512_xor_si512(iota, _mm512_set1_epi32(d)), vs));
    *vmax = vm;
    *vsum = vs;
}

/* Softmax over n positions of the HV heads interleaved in r (softmax16_exp, then each divided by its sum) */
T_VNNI static void softmax16(float *r, int n, int HV) {
    __m512 vm, vs;
    softmax16_exp(r, n, HV, &vm, &vs);
    const int nf = n * HV;
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), vs);
    for (int i = 0; i < nf; i += 16) {
        const __mmask16 mk = nf - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nf - i)) - 1);
        _mm512_mask_storeu_ps(r + i, mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, r + i), inv));
    }
}

/* A block of cached rows as f32 row pointers: into the cache when it is f32, else converted into blk.
 * Unused pointers (past nb) repeat row 0 so the score kernel can always read 16 rows. */
T_VNNI static void kv_rows512(const model *m, const void *c, int slot, int layer, int kvh, int i0, int nb, float *blk,
                              const float **rp) {
    const int hd = m->s.head_dim;
    for (int r = 0; r < nb; r++) {
        const size_t off = kv_off(m, slot, layer, kvh, phys(m, slot, i0 + r));
        if (!m->s.kv_f16) { rp[r] = (const float *)c + off; continue; }
        const uint16_t *h = (const uint16_t *)c + off;
        float *d = blk + (size_t)r * hd;
        for (int e = 0; e < hd; e += 16) _mm512_storeu_ps(d + e, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + e))));
        rp[r] = d;
    }
    for (int r = nb; r < ATT_BLK; r++) rp[r] = rp[0];
}

/* One (token, kv head, part of its query heads) item with AVX-512 (head_dim % 16 == 0). Heads go in groups
 * of HV (a power of two <= 8 set by the model's group size, never by the batch, so a head's arithmetic is the
 * same whatever the batch or the split), padded with zero queries. Scores are kept [row][head] per group, so
 * the softmax max and sum are vertical too; P.V holds 4 heads x 64 outputs in registers over a block.
 * Measured (1b, 8 heads per kv head, 140 positions, f16 cache): 6.6 us per item in cache vs 12 us for the
 * AVX2 one; from DRAM (16 sequences) it is bound by reading the cache: 7.8 -> 5.8 ms per decode step. */
T_VNNI static void attn_item_avx512(model *m, attn_job *a, int item, int tid) {
    const glmi4_spec *s = &m->s;
    const int hd = s->head_dim, grp = s->n_heads / s->n_kv, per = grp / a->hsplit, ldq = s->n_heads * hd + 2 * s->n_kv * hd;
    const int t = item / (s->n_kv * a->hsplit), kvh = (item / a->hsplit) % s->n_kv, part = item % a->hsplit;
    const int h0 = kvh * grp + part * per, slot = m->tslot[t], n = m->tpos[t] + 1;
    const int HV = grp > 4 ? 8 : grp > 2 ? 4 : grp, L = 16 / HV, ng = (per + HV - 1) / HV;
    const float scale = 1.f / sqrtf((float)hd);
    float *sc = m->scores + (size_t)tid * SC_HEADS(grp) * s->capacity;
    float *q2 = m->rowbuf + (size_t)tid * ROWBUF(hd, grp), *blk = q2 + (size_t)hd * SC_HEADS(grp);
    const float *q = m->qkv + (size_t)t * ldq + (size_t)h0 * hd;
    float *out = m->att + (size_t)t * s->n_heads * hd + (size_t)h0 * hd;
    const float *rp[ATT_BLK];
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    {   /* group g, dims j..j+L-1: 16 floats, lane s*L+l = q_{g*HV+s}[j+l], gathered (0 for padding heads) */
        const __m512i hs = _mm512_srli_epi32(iota, __builtin_ctz(L)), idx = _mm512_add_epi32(
            _mm512_mullo_epi32(hs, _mm512_set1_epi32(hd)), _mm512_and_si512(iota, _mm512_set1_epi32(L - 1)));
        for (int g = 0; g < ng; g++) {
            const __mmask16 mk = _mm512_cmplt_epi32_mask(hs, _mm512_set1_epi32(per - g * HV));
            for (int j = 0; j < hd; j += L)
                _mm512_storeu_ps(q2 + (size_t)g * HV * hd + (size_t)j * HV,
                                 _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk, idx, q + (size_t)g * HV * hd + j, 4));
        }
    }
    for (int i0 = 0; i0 < n; i0 += ATT_BLK) {
        const int nb = imin(ATT_BLK, n - i0);
        kv_rows512(m, m->kc, slot, a->layer, kvh, i0, nb, blk, rp);
        for (int g = 0; g < ng; g++) {
            const float *qg = q2 + (size_t)g * HV * hd;
            for (int r = 0; r < nb; r += 16) {
                float *o = sc + (size_t)g * HV * n + (size_t)(i0 + r) * HV;
                switch (L) {
                case 2: att_scores16(qg, rp + r, hd, 2, scale, o, nb - r); break;
                case 4: att_scores16(qg, rp + r, hd, 4, scale, o, nb - r); break;
                case 8: att_scores16(qg, rp + r, hd, 8, scale, o, nb - r); break;
                default: att_scores16(qg, rp + r, hd, 16, scale, o, nb - r); break;
                }
            }
        }
    }
    for (int g = 0; g < ng; g++) softmax16(sc + (size_t)g * HV * n, n, HV);
    memset(out, 0, sizeof(float) * (size_t)per * hd);
    for (int i0 = 0; i0 < n; i0 += ATT_BLK) {
        const int nb = imin(ATT_BLK, n - i0);
        kv_rows512(m, m->vc, slot, a->layer, kvh, i0, nb, blk, rp);
        for (int g = 0; g < ng; g++)
            for (int hq = g * HV; hq < imin(per, g * HV + HV); hq += 4) {
                const float *p = sc + (size_t)g * HV * n + (size_t)i0 * HV + (hq - g * HV), *ph[4] = {p, p + 1, p + 2, p + 3};
                att_pv(out + (size_t)hq * hd, hd, ph, HV, rp, nb, imin(4, imin(per, g * HV + HV) - hq));
            }
    }
}
#endif

static void attn_task(void *arg, int tid, int nth) {
    (void)nth;
    attn_job *a = arg;
    for (;;) {
        int it = atomic_fetch_add(&a->next, 1);
        if (it >= a->nitems) break;
#if GLMI4_X86
        if (a->m->isa == ISA_VNNI && a->m->s.head_dim % 16 == 0) { attn_item_avx512(a->m, a, it, tid); continue; }
        if (a->m->isa != ISA_REF && a->m->s.head_dim % 8 == 0) { attn_item_avx2(a->m, a, it, tid); continue; }
#endif
        attn_item_ref(a->m, a, it, tid);
    }
}

static void rmsnorm(const float *x, const float *w, int n, float eps, float *out) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* rotate the first rot dims of each of nheads vectors (stride apart): in interleaved pairs (2i, 2i+1), or in
 * NeoX order, pairs (i, i + rot/2) (glm4_moe); the rest pass through */
static void rope(float *v, int nheads, int stride, int rot, const float *c, const float *sn, int neox) {
    const int half = rot / 2;
    for (int h = 0; h < nheads; h++) {
        float *x = v + (size_t)h * stride;
        for (int i = 0; i < half; i++) {
            const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
            const float x0 = x[a], x1 = x[b];
            x[a] = x0 * c[i] - x1 * sn[i];
            x[b] = x1 * c[i] + x0 * sn[i];
        }
    }
}

static float dot_ref(const float *a, const float *b, int n) {
    float s = 0.f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy_ref(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

#if GLMI4_X86
T_AVX2 static float dot_avx2(const float *a, const float *b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum8(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

T_AVX2 static void axpy_avx2(float *y, float a, const float *x, int n) {
    const __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}
#endif

/* fp32 dot product and y += a*x: the same bits for a given vector whatever the batch, per kernel variant */
static inline float dotf(const model *m, const float *a, const float *b, int n) {
#if GLMI4_X86
    if (m->isa != ISA_REF) return dot_avx2(a, b, n);
#endif
    return dot_ref(a, b, n);
}

static inline void axpyf(const model *m, float *y, float a, const float *x, int n) {
#if GLMI4_X86
    if (m->isa != ISA_REF) { axpy_avx2(y, a, x, n); return; }
#endif
    axpy_ref(y, a, x, n);
}

static void silu_mul_ref(const float *gu, int F, float *out) {
    for (int i = 0; i < F; i++) {
        const float g = gu[i];
        out[i] = g / (1.f + expf(-g)) * gu[F + i];
    }
}

#if GLMI4_X86
T_AVX2 static void silu_mul_avx2(const float *gu, int F, float *out) {
    int i = 0;
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= F; i += 8) {
        const __m256 g = _mm256_loadu_ps(gu + i);
        const __m256 sg = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(sg, _mm256_loadu_ps(gu + F + i)));
    }
    for (; i < F; i++) {
        const float g = gu[i];
        out[i] = g / (1.f + expf(-g)) * gu[F + i];
    }
}
#endif

/* Row-parallel element-wise stages before a matrix product: each row made, then quantized for it. */
enum { ROW_NORM, ROW_SILU, ROW_COPY };

typedef struct {
    model *m;
    int kind, T;                 /* ROW_NORM: rmsnorm(src row, w) over K; ROW_SILU: silu(gate) * up of a src row of
                                    2F; ROW_COPY: the src row as it is */
    const float *w, *src;
    int lds, F;                  /* src row stride */
    float eps;                   /* ROW_NORM: the norm's epsilon */
    float *dst;                  /* ROW_NORM: keep the normed rows here (stride ldd); NULL: a scratch row */
    int ldd;
    int8_t *q;                   /* the quantized rows (stride ldo; dx, xs: ldo / 32); NULL: m->aq and its stride */
    float *dx, *xs;
    int ldo, K, Kp, G;
    _Atomic int next;
} rows_job;

static void rows_task(void *arg, int tid, int nth) {
    (void)nth;
    rows_job *r = arg;
    model *m = r->m;
    quant_fn qf = pick_quant(m->isa);
    for (;;) {
        const int t = atomic_fetch_add(&r->next, 1);
        if (t >= r->T) break;
        const float *src = r->src + (size_t)t * r->lds, *row = src;
        float *tmp = m->tmp + (size_t)tid * m->ldq;
        if (r->kind == ROW_NORM) {
            if (r->dst) tmp = r->dst + (size_t)t * r->ldd;
            rmsnorm(src, r->w, r->K, r->eps, tmp);
            row = tmp;
        } else if (r->kind == ROW_SILU) {
#if GLMI4_X86
            if (m->isa != ISA_REF) silu_mul_avx2(src, r->F, tmp);
            else
#endif
                silu_mul_ref(src, r->F, tmp);
            row = tmp;
        }
        const int nbx = r->ldo / QK;
        qf(row, r->K, r->Kp, r->G, r->q + (size_t)t * r->ldo, r->dx + (size_t)t * nbx, r->xs + (size_t)t * nbx);
    }
}

/* r's rows made and quantized for W (its k, k_pad and group); the fields left 0 take the defaults above */
static void run_rows(model *m, rows_job *r, const glmi4_mat *W) {
    r->m = m;
    r->K = W->k;
    r->Kp = W->k_pad;
    r->G = W->group;
    if (!r->q) { r->q = m->aq; r->dx = m->adx; r->xs = m->axs; r->ldo = m->ldq; }
    atomic_store(&r->next, 0);
    if ((size_t)r->T * r->Kp < ROWS_SMALL) rows_task(r, 0, 1);      /* decode: not worth waking the pool */
    else pool_run(m->pool, rows_task, r);
}

static void embed_row(const glmi4_emb *E, int id, float *out) {
    const int ng = E->k_pad / E->group;
    const uint8_t *sc = E->scales + (size_t)id * ng * 2, *mn = E->mins ? E->mins + (size_t)id * ng * 2 : NULL;
    for (int i = 0; i < E->k; i++) {
        const int g = i / E->group;
        const float d = scale_at(sc, g, E->scale_bf16);
        if (E->bits == 8) {
            out[i] = d * (float)((const int8_t *)E->q)[(size_t)id * E->k_pad + i];
        } else {
            const uint8_t b = E->q[(size_t)id * (E->k_pad / 2) + i / 2];
            const int qv = (i & 1) ? b >> 4 : b & 15;
            out[i] = E->asym ? d * (float)qv + scale_at(mn, g, E->scale_bf16) : d * (float)(qv - 8);
        }
    }
}

static void cache_put(const model *m, void *c, size_t off, const float *src, int n) {
#if GLMI4_X86
    if (m->isa != ISA_REF && m->s.kv_f16 && n % 8 == 0) { kv_put_f16c(c, off, src, n); return; }
#endif
    kv_put(m, c, off, src, n);
}

static void cache_get(const model *m, const void *c, size_t off, float *dst, int n) {
#if GLMI4_X86
    if (m->isa != ISA_REF && n % 8 == 0) { kv_get_avx2(m, c, off, dst, n); return; }
#endif
    kv_get(m, c, off, dst, n);
}

/* ------------------------------------------------------------------ the forward step */

/* x += W @ a for the T quantized activation rows; with a post norm (glm4), x += rmsnorm(W @ a): the product
 * goes to m->h first (free here: the activations are already quantized in m->aq) and each row is normed
 * there on its own, so a token's result is the same in any batch. */
static void sublayer_out(model *m, const glmi4_mat *W, int T, const float *post_norm) {
    const int H = m->s.hidden;
    if (!post_norm) {
        run_gemm(m->pool, m->isa, W, T, m->aq, m->adx, m->axs, m->ldq, m->x, H, NULL, 1);
        return;
    }
    run_gemm(m->pool, m->isa, W, T, m->aq, m->adx, m->axs, m->ldq, m->h, m->ldq, NULL, 0);
    for (int t = 0; t < T; t++) {
        float *y = m->h + (size_t)t * m->ldq, *x = m->x + (size_t)t * H;
        rmsnorm(y, post_norm, H, m->s.norm_eps, y);
        for (int i = 0; i < H; i++) x[i] += y[i];
    }
}

/* Grouped-query attention (the dense GLMs, glm4_moe): x += attn_out(attention(rotary(norms(qkv(norm(x)))))). */
static void attn_gqa(model *m, const glmi4_layer *L, int l, int T) {
    const glmi4_spec *s = &m->s;
    const int H = s->hidden, hd = s->head_dim, qs = s->n_heads * hd, kvs = s->n_kv * hd, ldqkv = qs + 2 * kvs;
    size_t attn_work = 0;
    run_rows(m, &(rows_job){.kind = ROW_NORM, .T = T, .w = L->input_norm, .eps = m->s.norm_eps, .src = m->x,
                            .lds = H}, &L->qkv);
    run_gemm(m->pool, m->isa, &L->qkv, T, m->aq, m->adx, m->axs, m->ldq, m->qkv, ldqkv, L->qkv_bias, 0);
    for (int t = 0; t < T; t++) {       /* q/k norms, rotary at the token's position, then cache K and V */
        const int pos = m->tpos[t], slot = m->tslot[t];
        float *q = m->qkv + (size_t)t * ldqkv;
        const int half = s->rot_dim / 2;
        const float *c = s->rope_cos + (size_t)pos * half, *sn = s->rope_sin + (size_t)pos * half;
        attn_work += (size_t)(pos + 1) * s->n_heads * hd;
        if (L->q_norm) {
            for (int h = 0; h < s->n_heads; h++) rmsnorm(q + h * hd, L->q_norm, hd, s->norm_eps, q + h * hd);
            for (int h = 0; h < s->n_kv; h++) rmsnorm(q + qs + h * hd, L->k_norm, hd, s->norm_eps, q + qs + h * hd);
        }
        rope(q, s->n_heads, hd, s->rot_dim, c, sn, s->rope_neox);
        rope(q + qs, s->n_kv, hd, s->rot_dim, c, sn, s->rope_neox);
        for (int kh = 0; kh < s->n_kv; kh++) {
            const size_t off = kv_off(m, slot, l, kh, phys(m, slot, pos));
            cache_put(m, m->kc, off, q + qs + kh * hd, hd);
            cache_put(m, m->vc, off, q + qs + kvs + kh * hd, hd);
        }
    }
    {   /* split a kv head's query heads when there are fewer items than threads */
        const int grp = s->n_heads / s->n_kv, nth = m->pool ? m->pool->nth : 1;
        int hsplit = 1;
        while (hsplit < grp && T * s->n_kv * hsplit < nth) {
            hsplit++;
            while (grp % hsplit) hsplit++;
        }
        attn_job a = {.m = m, .layer = l, .T = T, .hsplit = hsplit, .nitems = T * s->n_kv * hsplit};
        atomic_store(&a.next, 0);
        if (a.nitems == 1 || attn_work < SMALL_WORK) attn_task(&a, 0, 1);
        else pool_run(m->pool, attn_task, &a);
    }
    run_rows(m, &(rows_job){.kind = ROW_COPY, .T = T, .src = m->att, .lds = qs}, &L->attn_out);
    sublayer_out(m, &L->attn_out, T, L->post_self_attn_norm);
}

#if GLMI4_X86
/* The AVX2 tiers' latent attention kernels over a chunk's rows (width lw: the latent, then the rope key), two
 * heads at a time so each row's load feeds both (6 loads per 8 multiply-adds, where one head took 10). */

/* Scores of NHB (1-2) heads against rows r..r+NR-1 (NR 1-4): one accumulator per (head, row), 8 dims a step over
 * the latent part, then the rope part, reduced by hsum8, so a (head, row)'s sum order depends on neither NHB nor
 * NR (nor on the chunk: rows are whole). R and rp multiples of 8. */
T_AVX2 INLINE void mla_scores_tile(const float *const *ql, const float *const *qr, const float *blk, int lw, int R,
                                   int rp, float scale, float *const *out, int r, const int NHB, const int NR) {
    __m256 acc[2][4];
    for (int h = 0; h < NHB; h++)
        for (int k = 0; k < NR; k++) acc[h][k] = _mm256_setzero_ps();
    for (int part = 0; part < 2; part++) {
        const int off = part ? R : 0, n = part ? rp : R;
        for (int i = 0; i < n; i += 8) {
            __m256 x[4];
            for (int k = 0; k < NR; k++) x[k] = _mm256_loadu_ps(blk + (size_t)(r + k) * lw + off + i);
            for (int h = 0; h < NHB; h++) {
                const __m256 q = _mm256_loadu_ps((part ? qr[h] : ql[h]) + i);
                for (int k = 0; k < NR; k++) acc[h][k] = _mm256_fmadd_ps(q, x[k], acc[h][k]);
            }
        }
    }
    for (int h = 0; h < NHB; h++)
        for (int k = 0; k < NR; k++) out[h][r + k] = hsum8(acc[h][k]) * scale;
}

/* out[h][r] = (ql[h] . row_r[0:R] + qr[h] . row_r[R:R+rp]) * scale for nhb (1-2) heads, 4 rows at a time */
T_AVX2 static void mla_scores_avx2(const float *const *ql, const float *const *qr, int nhb, const float *blk, int nb,
                                   int lw, int R, int rp, float scale, float *const *out) {
    int r = 0;
    if (nhb == 2) {
        for (; r + 4 <= nb; r += 4) mla_scores_tile(ql, qr, blk, lw, R, rp, scale, out, r, 2, 4);
        for (; r < nb; r++) mla_scores_tile(ql, qr, blk, lw, R, rp, scale, out, r, 2, 1);
    } else {
        for (; r + 4 <= nb; r += 4) mla_scores_tile(ql, qr, blk, lw, R, rp, scale, out, r, 1, 4);
        for (; r < nb; r++) mla_scores_tile(ql, qr, blk, lw, R, rp, scale, out, r, 1, 1);
    }
}

/* o[h][0:R] += p[h][r] * row_r[0:R] for nhb (1-2) heads over the rows in order, 32 outputs a head at a time (each
 * output a chain of FMAs in row order: its bits do not depend on nhb) */
T_AVX2 INLINE void mla_values_tile(float *const *o, const float *const *p, const float *blk, int nb, int lw, int c,
                                   const int NHB) {
    __m256 acc[2][4];
    for (int h = 0; h < NHB; h++)
        for (int j = 0; j < 4; j++) acc[h][j] = _mm256_loadu_ps(o[h] + c + 8 * j);
    for (int r = 0; r < nb; r++) {
        const float *x = blk + (size_t)r * lw + c;
        const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8), x2 = _mm256_loadu_ps(x + 16),
                     x3 = _mm256_loadu_ps(x + 24);
        for (int h = 0; h < NHB; h++) {
            const __m256 w = _mm256_set1_ps(p[h][r]);
            acc[h][0] = _mm256_fmadd_ps(w, x0, acc[h][0]);
            acc[h][1] = _mm256_fmadd_ps(w, x1, acc[h][1]);
            acc[h][2] = _mm256_fmadd_ps(w, x2, acc[h][2]);
            acc[h][3] = _mm256_fmadd_ps(w, x3, acc[h][3]);
        }
    }
    for (int h = 0; h < NHB; h++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(o[h] + c + 8 * j, acc[h][j]);
}

T_AVX2 static void mla_values_avx2(float *const *o, const float *const *p, int nhb, const float *blk, int nb, int lw,
                                   int R) {
    for (int c = 0; c < R; c += 32) {
        if (nhb == 2) mla_values_tile(o, p, blk, nb, lw, c, 2);
        else mla_values_tile(o, p, blk, nb, lw, c, 1);
    }
}
#endif

#if GLMI4_X86
/* Latent attention on the fast tiers, in chunks of MLA_CHUNK positions: per chunk, each head's scores against the
 * chunk's rows (converted to f32 once), their max m, exp(score - m) and its sum l, and o = the sum of those
 * times the rows' latents; the chunks' (m, l, o) are then merged in chunk order (flash-decoding's split
 * softmax). The chunking is a function of the position alone, so a token's arithmetic is the same whatever
 * the batch or the threads: a few tokens (decode) spread their chunks over the threads, and each cached row is
 * read and converted once per step rather than once per thread and pass; more tokens (a prompt) go in blocks of
 * MLA_QB tokens of one slot, which share each converted chunk. On AVX-512, scores and P.V are attn_item_avx512's
 * kernels, heads in pairs (MLA_HV: a model constant; pairs waste no lanes at an even head count); on the AVX2 and
 * AVX-VNNI tiers, mla_scores_avx2 and mla_values_avx2 (two heads at a time). */
#define MLA_HV 2
#define MLA_CHUNK 256   /* positions per partial softmax (576 f32 rows of GLM-4.7-Flash: 590 KB, in L2) */
#define MLA_QB 4        /* tokens of one slot sharing a converted chunk */
#define MLA_SPLIT 4     /* up to this many tokens (and fewer than the threads) split their chunks over threads */

/* per thread: packed queries [MLA_QB][SC_HEADS(NH)][lw], chunk rows [MLA_CHUNK][lw], scores
 * [SC_HEADS(NH)][MLA_CHUNK], one chunk's partial result [NH][kv_lora + 2] */
static size_t mla_thread_floats(const glmi4_spec *s) {
    const size_t lw = (size_t)s->kv_lora + s->rot_dim, sh = SC_HEADS(s->n_heads);
    return MLA_QB * sh * lw + MLA_CHUNK * lw + sh * MLA_CHUNK + (size_t)s->n_heads * (s->kv_lora + 2);
}

static int mla_chunks(int n) { return (n + MLA_CHUNK - 1) / MLA_CHUNK; }

typedef struct {
    model *m;
    int layer, T, hsplit, nitems;
    int split;              /* items are (token, chunk, head part); else blocks of tokens */
    int *blk;               /* block mode: first token of each block, then T */
    int cum[MLA_SPLIT + 1]; /* split mode: chunks before token t */
    _Atomic int next;
} mla_job;

/* token t's queries for heads h0..h0+nh-1, packed for att_scores16: group g, dims j..j+L-1: lane s*L+l =
 * q_{g*HV+s}[j+l] (0 for a padding head); R % L == 0, so a chunk of dims is all latent or all rope */
T_VNNI static void mla_pack_q(const model *m, int t, int h0, int nh, float *q2) {
    const glmi4_spec *s = &m->s;
    const int NH = s->n_heads, R = s->kv_lora, lw = R + s->rot_dim, qw = s->nope + s->rot_dim;
    const int HV = MLA_HV, L = 16 / HV, ng = (nh + HV - 1) / HV;
    const float *ql = m->qlat + ((size_t)t * NH + h0) * R, *qr = m->qf + ((size_t)t * NH + h0) * qw + s->nope;
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i hs = _mm512_srli_epi32(iota, __builtin_ctz(L)), dim = _mm512_and_si512(iota, _mm512_set1_epi32(L - 1));
    const __m512i il = _mm512_add_epi32(_mm512_mullo_epi32(hs, _mm512_set1_epi32(R)), dim);
    const __m512i ir = _mm512_add_epi32(_mm512_mullo_epi32(hs, _mm512_set1_epi32(qw)), dim);
    for (int g = 0; g < ng; g++) {
        const __mmask16 mk = _mm512_cmplt_epi32_mask(hs, _mm512_set1_epi32(nh - g * HV));
        for (int j = 0; j < lw; j += L)
            _mm512_storeu_ps(q2 + (size_t)g * HV * lw + (size_t)j * HV,
                             j < R ? _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk, il, ql + (size_t)g * HV * R + j, 4)
                                   : _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk, ir, qr + (size_t)g * HV * qw + j - R, 4));
    }
}

/* One chunk of nb rows for nh heads (queries packed in q2): head h's o at o + h*R, its max and sum at mx[h], l[h] */
T_VNNI static void mla_chunk(const model *m, const float *q2, int nh, const float *const *rows, int nb, float *sc,
                             float *o, float *mx_out, float *l_out) {
    const glmi4_spec *s = &m->s;
    const int R = s->kv_lora, lw = R + s->rot_dim, HV = MLA_HV, ng = (nh + HV - 1) / HV;
    const float scale = 1.f / sqrtf((float)s->head_dim);
    for (int r = 0; r < nb; r += 16)
        for (int g = 0; g < ng; g++)
            att_scores16(q2 + (size_t)g * HV * lw, rows + r, lw, 16 / MLA_HV, scale,
                         sc + (size_t)g * HV * MLA_CHUNK + (size_t)r * HV, nb - r);
    for (int g = 0; g < ng; g++) {
        __m512 vm, vs;
        float mx[16], sum[16];
        softmax16_exp(sc + (size_t)g * HV * MLA_CHUNK, nb, HV, &vm, &vs);
        _mm512_storeu_ps(mx, vm);
        _mm512_storeu_ps(sum, vs);
        for (int k = 0; k < HV && g * HV + k < nh; k++) {
            mx_out[g * HV + k] = mx[k];
            l_out[g * HV + k] = sum[k];
        }
    }
    memset(o, 0, sizeof(float) * (size_t)nh * R);
    for (int r0 = 0; r0 < nb; r0 += 32) {       /* 32 rows at a time stay in L1 over the head quads */
        for (int h = 0; h < nh; h += 4) {
            const float *ph[4];
            for (int k = 0; k < 4; k++)
                ph[k] = sc + (size_t)((h + k) / HV) * HV * MLA_CHUNK + (size_t)r0 * HV + (h + k) % HV;
            att_pv(o + (size_t)h * R, R, ph, HV, rows + r0, imin(32, nb - r0), imin(4, nh - h));
        }
    }
}

/* Rows c*MLA_CHUNK .. +nb of a slot's latent cache as f32 row pointers: into the cache itself where it is f32 and
 * in_place (AVX-512's kernels take row pointers), else converted by cache_get into buf, contiguous (the AVX2
 * kernels read rows at a stride). Pointers past nb repeat row 0, to a multiple of 16 (AVX-512's score kernel
 * reads 16 rows). */
static void mla_rows(const model *m, int slot, int layer, int c, int nb, float *buf, const float **rows, int in_place) {
    const int lw = m->kvw;
    for (int r = 0; r < nb; r++) {
        const size_t off = kv_off(m, slot, layer, 0, phys(m, slot, c * MLA_CHUNK + r));
        if (in_place && !m->s.kv_f16) {
            rows[r] = (const float *)m->kc + off;
            continue;
        }
        cache_get(m, m->kc, off, buf + (size_t)r * lw, lw);
        rows[r] = buf + (size_t)r * lw;
    }
    for (int r = nb; r % 16; r++) rows[r] = rows[0];
}

/* The AVX2 / AVX-VNNI tiers' chunk over the rows in buf; per pair of heads, scores 4 rows at a time, each head's
 * max, exp and sum, and o over the rows */
T_AVX2 static void mla_chunk_avx2(const model *m, int t, int h0, int nh, const float *buf, int nb, float *sc, float *o,
                                  float *mx_out, float *l_out) {
    const glmi4_spec *s = &m->s;
    const int NH = s->n_heads, R = s->kv_lora, rp = s->rot_dim, lw = R + rp, qw = s->nope + rp;
    const float scale = 1.f / sqrtf((float)s->head_dim);
    const float *ql = m->qlat + ((size_t)t * NH + h0) * R, *qr = m->qf + ((size_t)t * NH + h0) * qw + s->nope;
    for (int h = 0; h < nh; h += 2) {       /* heads in pairs: each row's loads serve both */
        const int nhb = imin(2, nh - h);
        const float *qlh[2] = {ql + (size_t)h * R, ql + (size_t)(h + nhb - 1) * R};
        const float *qrh[2] = {qr + (size_t)h * qw, qr + (size_t)(h + nhb - 1) * qw};
        float *ph[2] = {sc + (size_t)h * MLA_CHUNK, sc + (size_t)(h + nhb - 1) * MLA_CHUNK};
        float *oh[2] = {o + (size_t)h * R, o + (size_t)(h + nhb - 1) * R};
        mla_scores_avx2(qlh, qrh, nhb, buf, nb, lw, R, rp, scale, ph);
        for (int k = 0; k < nhb; k++) {
            float *p = ph[k], mx = -INFINITY;
            for (int i = 0; i < nb; i++) mx = p[i] > mx ? p[i] : mx;
            __m256 vs = _mm256_setzero_ps();
            int i = 0;
            for (; i + 8 <= nb; i += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(mx)));
                _mm256_storeu_ps(p + i, e);
                vs = _mm256_add_ps(vs, e);
            }
            float sum = hsum8(vs);
            for (; i < nb; i++) { p[i] = expf(p[i] - mx); sum += p[i]; }
            mx_out[h + k] = mx;
            l_out[h + k] = sum;
            memset(oh[k], 0, sizeof(float) * (size_t)R);
        }
        mla_values_avx2(oh, (const float *const *)ph, nhb, buf, nb, lw, R);
    }
}

/* Merge chunk c's partial (o, m, l) of one head into the running one (acc: o, then m and l): in chunk order,
 * the same operations whichever thread computed the chunk. Element-wise, so 8 lanes give the bits 16 would:
 * every fast tier uses it. */
T_AVX2 static void mla_merge(float *acc, float *acc_m, float *acc_l, const float *o, float m, float l, int R, int c) {
    if (c == 0) {
        memcpy(acc, o, sizeof(float) * (size_t)R);
        *acc_m = m;
        *acc_l = l;
        return;
    }
    const float mx = fmaxf(*acc_m, m), a = expf(*acc_m - mx), b = expf(m - mx);
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    for (int i = 0; i < R; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(_mm256_loadu_ps(o + i), vb, _mm256_mul_ps(_mm256_loadu_ps(acc + i), va)));
    *acc_m = mx;
    *acc_l = *acc_l * a + l * b;
}

T_AVX2 static void mla_finish(float *acc, float l, int R) {
    const __m256 inv = _mm256_set1_ps(1.f / l);
    for (int i = 0; i < R; i += 8) _mm256_storeu_ps(acc + i, _mm256_mul_ps(_mm256_loadu_ps(acc + i), inv));
}

static void mla_item_chunked(mla_job *a, int item, int tid) {
    model *m = a->m;
    const glmi4_spec *s = &m->s;
    const int NH = s->n_heads, R = s->kv_lora, lw = R + s->rot_dim, sh = SC_HEADS(NH), vnni = m->isa == ISA_VNNI;
    float *q2 = m->mla_scratch + (size_t)tid * mla_thread_floats(s), *buf = q2 + (size_t)MLA_QB * sh * lw;
    float *sc = buf + (size_t)MLA_CHUNK * lw, *part = sc + (size_t)sh * MLA_CHUNK;
    const float *rows[MLA_CHUNK + 16];      /* the chunk's rows (in buf, or in the cache) */
    if (a->split) {         /* (token, chunk, head part): the partial goes to the shared buffer */
        const int part_i = item % a->hsplit, per = (NH + a->hsplit - 1) / a->hsplit, h0 = part_i * per;
        const int nh = imin(NH, h0 + per) - h0, k = item / a->hsplit;
        int t = 0;
        while (k >= a->cum[t + 1]) t++;
        const int c = k - a->cum[t], n = m->tpos[t] + 1, nb = imin(MLA_CHUNK, n - c * MLA_CHUNK);
        if (nh <= 0) return;
        float *o = m->mla_parts + (size_t)k * NH * (R + 2) + (size_t)h0 * R;
        float *mx = m->mla_parts + (size_t)k * NH * (R + 2) + (size_t)NH * R + h0, *l = mx + NH;
        if (vnni) {
            mla_pack_q(m, t, h0, nh, q2);
            mla_rows(m, m->tslot[t], a->layer, c, nb, buf, rows, 1);
            mla_chunk(m, q2, nh, rows, nb, sc, o, mx, l);
        } else {
            mla_rows(m, m->tslot[t], a->layer, c, nb, buf, rows, 0);
            mla_chunk_avx2(m, t, h0, nh, buf, nb, sc, o, mx, l);
        }
        return;
    }
    /* a block of tokens t0..t1-1 of one slot at consecutive positions: each chunk converted once for all of them */
    const int t0 = a->blk[item], t1 = a->blk[item + 1], slot = m->tslot[t0], n1 = m->tpos[t1 - 1] + 1;
    if (vnni)
        for (int t = t0; t < t1; t++) mla_pack_q(m, t, 0, NH, q2 + (size_t)(t - t0) * sh * lw);
    for (int c = 0; c < mla_chunks(n1); c++) {
        mla_rows(m, slot, a->layer, c, imin(MLA_CHUNK, n1 - c * MLA_CHUNK), buf, rows, vnni);
        for (int t = t0; t < t1; t++) {
            const int nb = imin(MLA_CHUNK, m->tpos[t] + 1 - c * MLA_CHUNK);
            if (nb <= 0) continue;
            float *o = m->olat + (size_t)t * NH * R, *ml = m->mla_ml + (size_t)t * 2 * NH;
            float *mx = part + (size_t)NH * R, *l = mx + NH;
            if (vnni) mla_chunk(m, q2 + (size_t)(t - t0) * sh * lw, NH, rows, nb, sc, part, mx, l);
            else mla_chunk_avx2(m, t, 0, NH, buf, nb, sc, part, mx, l);
            for (int h = 0; h < NH; h++)
                mla_merge(o + (size_t)h * R, ml + h, ml + NH + h, part + (size_t)h * R, mx[h], l[h], R, c);
        }
    }
    for (int t = t0; t < t1; t++)
        for (int h = 0; h < NH; h++)
            mla_finish(m->olat + ((size_t)t * NH + h) * R, m->mla_ml[(size_t)t * 2 * NH + NH + h], R);
}

static void mla_task_chunked(void *arg, int tid, int nth) {
    (void)nth;
    mla_job *a = arg;
    for (int it; (it = atomic_fetch_add(&a->next, 1)) < a->nitems;) mla_item_chunked(a, it, tid);
}

/* The split mode's merge: token t's chunks, in order, per head */
static void mla_merge_split(model *m, const mla_job *a, int t) {
    const glmi4_spec *s = &m->s;
    const int NH = s->n_heads, R = s->kv_lora;
    for (int h = 0; h < NH; h++) {
        float *o = m->olat + ((size_t)t * NH + h) * R, mx = 0.f, l = 0.f;
        for (int c = 0; c < a->cum[t + 1] - a->cum[t]; c++) {
            const float *pc = m->mla_parts + (size_t)(a->cum[t] + c) * NH * (R + 2);
            mla_merge(o, &mx, &l, pc + (size_t)h * R, pc[(size_t)NH * R + h], pc[(size_t)NH * (R + 1) + h], R, c);
        }
        mla_finish(o, l, R);
    }
}

/* Latent attention of the T tokens over their slots' caches (the rows and rotated queries are in place) */
static void mla_attend_chunked(model *m, int layer, int T, size_t work) {
    const glmi4_spec *s = &m->s;
    const int nth = m->pool ? m->pool->nth : 1;
    mla_job a = {.m = m, .layer = layer, .T = T, .blk = m->mla_blk};
    atomic_store(&a.next, 0);
    if (T < nth && T <= MLA_SPLIT) {
        a.split = 1;
        for (int t = 0; t < T; t++) a.cum[t + 1] = a.cum[t] + mla_chunks(m->tpos[t] + 1);
        a.hsplit = 1;
        while (a.hsplit < s->n_heads && a.cum[T] * a.hsplit < nth) a.hsplit++;
        a.nitems = a.cum[T] * a.hsplit;
    } else {
        int nb = 0;
        for (int t = 0; t < T; t++)
            if (t == 0 || t - m->mla_blk[nb - 1] == MLA_QB || m->tslot[t] != m->tslot[t - 1] ||
                m->tpos[t] != m->tpos[t - 1] + 1)
                m->mla_blk[nb++] = t;
        m->mla_blk[nb] = T;
        a.nitems = nb;
    }
    if (a.nitems == 1 || work < SMALL_WORK) mla_task_chunked(&a, 0, 1);
    else pool_run(m->pool, mla_task_chunked, &a);
    if (a.split)
        for (int t = 0; t < T; t++) mla_merge_split(m, &a, t);
}
#endif

/* One (token, part of the heads) item of latent attention in plain C (the fast tiers' shapes go chunked, above):
 * scores against the cached latents (the absorbed query against the compressed KV, plus the rope parts), softmax,
 * and the weighted sum of the compressed KV (the value projection follows, per head, outside). */
static void mla_item(model *m, attn_job *a, int item, int tid) {
    const glmi4_spec *s = &m->s;
    const int NH = s->n_heads, R = s->kv_lora, rp = s->rot_dim, lw = R + rp, qw = s->nope + rp;
    const int t = item / a->hsplit, part = item % a->hsplit, per = (NH + a->hsplit - 1) / a->hsplit;
    const int h0 = part * per, h1 = imin(NH, h0 + per), slot = m->tslot[t], n = m->tpos[t] + 1;
    const float scale = 1.f / sqrtf((float)s->head_dim);
    float *sc = m->scores + (size_t)tid * SC_HEADS(NH) * s->capacity;
    float *blk = m->rowbuf + (size_t)tid * (SC_HEADS(NH) + ATT_BLK) * lw + (size_t)SC_HEADS(NH) * lw;
    const float *ql = m->qlat + (size_t)t * NH * R, *qr = m->qf + (size_t)t * NH * qw + s->nope;
    float *o = m->olat + (size_t)t * NH * R;
    for (int i0 = 0; i0 < n; i0 += ATT_BLK) {
        const int nb = imin(ATT_BLK, n - i0);
        for (int r = 0; r < nb; r++) cache_get(m, m->kc, kv_off(m, slot, a->layer, 0, phys(m, slot, i0 + r)), blk + r * lw, lw);
        for (int h = h0; h < h1; h++) {
            for (int r = 0; r < nb; r++)
                sc[(size_t)(h - h0) * n + i0 + r] =
                    (dotf(m, ql + (size_t)h * R, blk + r * lw, R) + dotf(m, qr + (size_t)h * qw, blk + r * lw + R, rp)) * scale;
        }
    }
    for (int h = h0; h < h1; h++) {
        float *p = sc + (size_t)(h - h0) * n, mx = p[0], sum = 0.f;
        for (int i = 1; i < n; i++) mx = fmaxf(mx, p[i]);
        for (int i = 0; i < n; i++) { p[i] = expf(p[i] - mx); sum += p[i]; }
        for (int i = 0; i < n; i++) p[i] /= sum;
        memset(o + (size_t)h * R, 0, sizeof(float) * (size_t)R);
    }
    for (int i0 = 0; i0 < n; i0 += ATT_BLK) {
        const int nb = imin(ATT_BLK, n - i0);
        for (int r = 0; r < nb; r++) cache_get(m, m->kc, kv_off(m, slot, a->layer, 0, phys(m, slot, i0 + r)), blk + r * lw, lw);
        for (int h = h0; h < h1; h++) {
            for (int r = 0; r < nb; r++) axpyf(m, o + (size_t)h * R, sc[(size_t)(h - h0) * n + i0 + r], blk + r * lw, R);
        }
    }
}

static void mla_task(void *arg, int tid, int nth) {
    (void)nth;
    attn_job *a = arg;
    for (int it; (it = atomic_fetch_add(&a->next, 1)) < a->nitems;) mla_item(a->m, a, it, tid);
}

/* The heads of one layer's per-head products (absorbed keys or values), x: per (token, head) rows of hkp. */
static void per_head_gemms(model *m, const glmi4_mat *heads, int T, float *out, int rows_per_head) {
    const int NH = m->s.n_heads, ld = NH * m->hkp;
    for (int h = 0; h < NH; h++)
        m->jobs[h] = (gemm_job){.W = &heads[h], .M = T, .xq = m->hq + (size_t)h * m->hkp,
                                .dx = m->hdx + (size_t)h * m->hkp / QK, .xs = m->hxs + (size_t)h * m->hkp / QK,
                                .ldq = ld, .out = out + (size_t)h * rows_per_head, .ldo = NH * rows_per_head};
    run_gemms(m->pool, m->isa, m->jobs, NH);
}

/* Latent attention (glm4_moe_lite) with kv_b absorbed: the cache holds, per token and layer, the normed
 * compressed KV and the rotated rope key (kv_lora + rot_dim values); each head's query is taken into the
 * latent space through its key part of kv_b (W_UK^T q_nope), attends there, and its latent output goes out
 * through its value part (W_UV o). The same arithmetic as expanding kv_b over the cache, without doing so. */
static void attn_mla(model *m, const glmi4_layer *L, int l, int T) {
    const glmi4_spec *s = &m->s;
    const int H = s->hidden, NH = s->n_heads, R = s->kv_lora, rp = s->rot_dim, lw = R + rp, qw = s->nope + rp;
    const glmi4_mat *uk = m->uk + (size_t)l * NH, *uv = m->uv + (size_t)l * NH;
    const int lora = L->q_a.data != NULL;
    run_rows(m, &(rows_job){.kind = ROW_NORM, .T = T, .w = L->input_norm, .eps = m->s.norm_eps, .src = m->x,
                            .lds = H}, &L->kv_a);
    gemm_job first[2] = {
        {.W = lora ? &L->q_a : &L->q_b, .M = T, .xq = m->aq, .dx = m->adx, .xs = m->axs, .ldq = m->ldq,
         .out = lora ? m->qa : m->qf, .ldo = lora ? s->q_lora : NH * qw, .bias = lora ? L->q_a_bias : NULL},
        {.W = &L->kv_a, .M = T, .xq = m->aq, .dx = m->adx, .xs = m->axs, .ldq = m->ldq, .out = m->kva, .ldo = lw,
         .bias = L->kv_a_bias}};
    run_gemms(m->pool, m->isa, first, 2);
    if (lora) {
        run_rows(m, &(rows_job){.kind = ROW_NORM, .T = T, .w = L->q_a_norm, .eps = s->latent_eps, .src = m->qa,
                            .lds = s->q_lora}, &L->q_b);
        run_gemm(m->pool, m->isa, &L->q_b, T, m->aq, m->adx, m->axs, m->ldq, m->qf, NH * qw, NULL, 0);
    }
    size_t work = 0;
    for (int t = 0; t < T; t++) {       /* the latent row into the cache; the rotary of the queries' rope parts */
        const int pos = m->tpos[t], slot = m->tslot[t], half = rp / 2;
        const float *c = s->rope_cos + (size_t)pos * half, *sn = s->rope_sin + (size_t)pos * half;
        float *kv = m->kva + (size_t)t * lw;
        rmsnorm(kv, L->kv_a_norm, R, s->latent_eps, kv);
        rope(kv + R, 1, rp, rp, c, sn, s->rope_neox);
        rope(m->qf + (size_t)t * NH * qw + s->nope, NH, qw, rp, c, sn, s->rope_neox);
        cache_put(m, m->kc, kv_off(m, slot, l, 0, phys(m, slot, pos)), kv, lw);
        work += (size_t)(pos + 1) * NH * lw;
    }
    run_rows(m, &(rows_job){.kind = ROW_COPY, .T = T * NH, .src = m->qf, .lds = qw, .q = m->hq, .dx = m->hdx,
                            .xs = m->hxs, .ldo = m->hkp}, &uk[0]);
    per_head_gemms(m, uk, T, m->qlat, R);
#if GLMI4_X86
    if (m->mla_scratch) mla_attend_chunked(m, l, T, work);
    else
#endif
    {
        const int nth = m->pool ? m->pool->nth : 1;
        int hsplit = 1;
        while (hsplit < NH && T * hsplit < nth) hsplit++;
        attn_job a = {.m = m, .layer = l, .T = T, .hsplit = hsplit, .nitems = T * hsplit};
        atomic_store(&a.next, 0);
        if (a.nitems == 1 || work < SMALL_WORK) mla_task(&a, 0, 1);
        else pool_run(m->pool, mla_task, &a);
    }
    run_rows(m, &(rows_job){.kind = ROW_COPY, .T = T * NH, .src = m->olat, .lds = R, .q = m->hq, .dx = m->hdx,
                            .xs = m->hxs, .ldo = m->hkp}, &uv[0]);
    per_head_gemms(m, uv, T, m->vout, s->v_dim);
    run_rows(m, &(rows_job){.kind = ROW_COPY, .T = T, .src = m->vout, .lds = NH * s->v_dim}, &L->attn_out);
    run_gemm(m->pool, m->isa, &L->attn_out, T, m->aq, m->adx, m->axs, m->ldq, m->x, H, L->attn_out_bias, 1);
}

/* The router's sigmoid scores of token t for experts e0..e1-1 into sc[e] */
static void router_scores(model *m, const glmi4_layer *L, int t, int e0, int e1, float *sc) {
    const int H = m->s.hidden;
    const float *x = m->h + (size_t)t * m->ldq;
    for (int e = e0; e < e1; e++) sc[e] = 1.f / (1.f + expf(-dotf(m, x, L->router + (size_t)e * H, H)));
}

/* The router of one token, as transformers' route() (fp32): sigmoid scores (in sc[0..E), made here unless
 * `scored`); the correction bias added only to choose, among the experts of the topk_groups best groups (a group
 * scored by its best two); the chosen experts' unbiased scores renormalised (norm_topk) and scaled.
 * sc: 3 x n_experts floats. */
static void route_token(model *m, const glmi4_layer *L, int t, float *sc, int scored) {
    const glmi4_spec *s = &m->s;
    const int E = s->n_experts, K = s->top_k, G = s->n_groups;
    float *choice = sc + E, *gscore = sc + 2 * E;
    int *eid = m->eid + (size_t)t * K;
    float *w = m->ew + (size_t)t * K;
    if (!scored) router_scores(m, L, t, 0, E, sc);
    for (int e = 0; e < E; e++) choice[e] = sc[e] + L->router_bias[e];
    if (G > 1) {
        const int per = E / G;
        for (int g = 0; g < G; g++) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int e = g * per; e < (g + 1) * per; e++) {
                const float v = choice[e];
                if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) { b2 = v; }
            }
            gscore[g] = b1 + b2;
        }
        for (int k = 0; k < s->topk_groups; k++) {      /* keep the best groups: mark them +inf */
            int best = -1;
            for (int g = 0; g < G; g++)
                if (gscore[g] != INFINITY && (best < 0 || gscore[g] > gscore[best])) best = g;
            gscore[best] = INFINITY;
        }
        for (int e = 0; e < E; e++)
            if (gscore[e / per] != INFINITY) choice[e] = -INFINITY;
    }
    float sum = 0.f;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < k; i++) taken |= eid[i] == e;
            if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
        }
        eid[k] = best;
        w[k] = sc[best];
        sum += w[k];
    }
    for (int k = 0; k < K; k++) w[k] = (s->norm_topk ? w[k] / (sum + 1e-20f) : w[k]) * s->routed_scaling;
}

typedef struct {
    model *m;
    const glmi4_layer *L;
    int T;
    _Atomic int next;
} route_job;

static void route_task(void *arg, int tid, int nth) {
    (void)nth;
    route_job *r = arg;
    float *sc = r->m->rscore + (size_t)tid * 3 * r->m->s.n_experts;
    for (int t; (t = atomic_fetch_add(&r->next, 1)) < r->T;) route_token(r->m, r->L, t, sc, 0);
}

#define ROUTE_SPLIT 16   /* experts per item when a few tokens share out their router's rows */

static void router_scores_task(void *arg, int tid, int nth) {
    (void)tid; (void)nth;
    route_job *r = arg;
    const int E = r->m->s.n_experts, per = (E + ROUTE_SPLIT - 1) / ROUTE_SPLIT;
    for (int it; (it = atomic_fetch_add(&r->next, 1)) < r->T * per;) {
        const int t = it / per, e0 = (it % per) * ROUTE_SPLIT;
        router_scores(r->m, r->L, t, e0, imin(E, e0 + ROUTE_SPLIT), r->m->rscore + (size_t)t * 3 * E);
    }
}

/* The MoE block of T tokens (their normed rows in m->h, quantized in m->aq): route each token, group the
 * (token, expert) assignments by expert, run every chosen expert once over its tokens (and the shared expert
 * over all), all experts in one parallel region per projection; x += the weighted sum + the shared output. */
static void moe_block(model *m, const glmi4_layer *L, int T) {
    const glmi4_spec *s = &m->s;
    const int E = s->n_experts, K = s->top_k, H = s->hidden, F = s->moe_ffn, Fs = s->shared_ffn;
    const int nbx = m->ldq / QK, A = T * K, Hkp = L->exp_up[0].k_pad;
    route_job rj = {.m = m, .L = L, .T = T};
    atomic_store(&rj.next, 0);
    const int nth = m->pool ? m->pool->nth : 1;
    if (T >= nth) {
        pool_run(m->pool, route_task, &rj);
    } else {    /* fewer tokens than threads: the router's rows (fp32, read whole) shared out, then each token's choice */
        pool_run(m->pool, router_scores_task, &rj);
        for (int t = 0; t < T; t++) route_token(m, L, t, m->rscore + (size_t)t * 3 * E, 1);
    }
    int *cnt = m->cnt, *fill = m->start + E, *start = m->start;
    memset(cnt, 0, sizeof(int) * (size_t)E);
    for (int a = 0; a < A; a++) cnt[m->eid[a]]++;
    for (int e = 0, at = 0; e < E; e++) { start[e] = fill[e] = at; at += cnt[e]; }
    for (int i = 0; i < A; i++) {           /* assignment rows in expert order, tokens in order within one */
        const int a = fill[m->eid[i]]++, t = i / K;
        m->apos[i] = a;
        memcpy(m->eq + (size_t)a * m->ldq, m->aq + (size_t)t * m->ldq, (size_t)Hkp);
        memcpy(m->edx + (size_t)a * nbx, m->adx + (size_t)t * nbx, sizeof(float) * (size_t)(Hkp / QK));
        memcpy(m->exs + (size_t)a * nbx, m->axs + (size_t)t * nbx, sizeof(float) * (size_t)(Hkp / QK));
    }
    for (int pass = 0; pass < 2; pass++) {      /* gate|up, then down */
        int n = 0;
        for (int e = 0; e < E; e++) {
            if (!cnt[e]) continue;
            const size_t r0 = (size_t)start[e];
            m->jobs[n++] = (gemm_job){.W = pass ? &L->exp_down[e] : &L->exp_up[e], .M = cnt[e],
                                      .xq = m->eq + r0 * m->ldq, .dx = m->edx + r0 * nbx, .xs = m->exs + r0 * nbx,
                                      .ldq = m->ldq, .out = pass ? m->eout + r0 * H : m->eup + r0 * 2 * F,
                                      .ldo = pass ? H : 2 * F};
        }
        if (Fs)
            m->jobs[n++] = (gemm_job){.W = pass ? &L->shared_down : &L->shared_up, .M = T, .xq = m->aq, .dx = m->adx,
                                      .xs = m->axs, .ldq = m->ldq, .out = pass ? m->sout : m->sup,
                                      .ldo = pass ? H : 2 * Fs};
        run_gemms(m->pool, m->isa, m->jobs, n);
        if (pass) break;
        run_rows(m, &(rows_job){.kind = ROW_SILU, .T = A, .src = m->eup, .lds = 2 * F, .F = F, .q = m->eq,
                                .dx = m->edx, .xs = m->exs, .ldo = m->ldq}, &L->exp_down[0]);
        if (Fs) run_rows(m, &(rows_job){.kind = ROW_SILU, .T = T, .src = m->sup, .lds = 2 * Fs, .F = Fs}, &L->shared_down);
    }
    float *acc = m->tmp;
    for (int t = 0; t < T; t++) {   /* the experts' weighted outputs in expert order (as transformers adds them) */
        const int *eid = m->eid + (size_t)t * K;
        memset(acc, 0, sizeof(float) * (size_t)H);
        for (int k = 0, last = -1; k < K; k++) {
            int j = -1;
            for (int i = 0; i < K; i++)
                if (eid[i] > last && (j < 0 || eid[i] < eid[j])) j = i;
            last = eid[j];
            axpyf(m, acc, m->ew[(size_t)t * K + j], m->eout + (size_t)m->apos[(size_t)t * K + j] * H, H);
        }
        float *x = m->x + (size_t)t * H;
        const float *sh = m->sout + (size_t)t * H;
        for (int i = 0; i < H; i++) x[i] += Fs ? acc[i] + sh[i] : acc[i];
    }
}

/* The T tokens in m->x through decoder layer l (the NextN layer: l = n_layers), in place. */
static void layer_forward(model *m, int l, int T) {
    const glmi4_spec *s = &m->s;
    const glmi4_layer *L = &m->layers[l];
    const int H = s->hidden;
    if (s->mla) attn_mla(m, L, l, T);
    else attn_gqa(m, L, l, T);
    run_rows(m, &(rows_job){.kind = ROW_NORM, .T = T, .w = L->post_norm, .eps = m->s.norm_eps, .src = m->x, .lds = H,
                            .dst = m->h, .ldd = m->ldq}, L->sparse ? &L->exp_up[0] : &L->ffn_up);
    if (L->sparse) {
        moe_block(m, L, T);
        return;
    }
    run_gemm(m->pool, m->isa, &L->ffn_up, T, m->aq, m->adx, m->axs, m->ldq, m->ff, 2 * s->ffn, NULL, 0);
    run_rows(m, &(rows_job){.kind = ROW_SILU, .T = T, .src = m->ff, .lds = 2 * s->ffn, .F = s->ffn}, &L->ffn_down);
    sublayer_out(m, &L->ffn_down, T, L->post_mlp_norm);
}

/* The logits of the R rows of m->x listed in rows, normed by final_norm, into R consecutive rows of logits. */
static void head_rows(model *m, const float *final_norm, const int *rows, int R, float *logits) {
    const glmi4_spec *s = &m->s;
    const int H = s->hidden, nbx = m->ldq / QK;
    for (int r = 0; r < R; r++) {
        float *tmp = m->h + (size_t)r * m->ldq;
        rmsnorm(m->x + (size_t)rows[r] * H, final_norm, H, s->norm_eps, tmp);
        pick_quant(m->isa)(tmp, s->head.k, s->head.k_pad, s->head.group, m->aq + (size_t)r * m->ldq,
                           m->adx + (size_t)r * nbx, m->axs + (size_t)r * nbx);
    }
    run_gemm(m->pool, m->isa, &s->head, R, m->aq, m->adx, m->axs, m->ldq, logits, s->vocab, NULL, 0);
}

/* T tokens (of any slots; m->tslot/tpos say where each goes) through every layer; then the logits of the
 * R tokens listed in rows, into R consecutive rows of logits, and (hidden != NULL: a NextN layer drafts from
 * them) every token's final normed hidden state [T][hidden]. Each token writes its K/V before attention
 * reads the cache, so a token sees its own slot's positions 0..pos: earlier chunks, earlier tokens of
 * this one, itself. Every weight matrix (every chosen expert) is read once for all T tokens. */
static void forward_chunk(model *m, const int32_t *ids, int T, const int *rows, int R, float *logits, float *hidden) {
    const glmi4_spec *s = &m->s;
    const int H = s->hidden;
    for (int t = 0; t < T; t++) embed_row(&s->embed, ids[t], m->x + (size_t)t * H);
    for (int l = 0; l < s->n_layers; l++) layer_forward(m, l, T);
    if (hidden)
        for (int t = 0; t < T; t++)
            rmsnorm(m->x + (size_t)t * H, s->final_norm, H, s->norm_eps, hidden + (size_t)t * H);
    if (R) head_rows(m, s->final_norm, rows, R, logits);
}

/* T positions start.. of slot's NextN cache (T <= max_batch): ids[t] the token after position start + t,
 * hidden[t] the target's final normed hidden state at it (or, chained, the NextN layer's own output). */
static void nextn_chunk(model *m, int slot, int start, const int32_t *ids, const float *hidden, int T) {
    const glmi4_spec *s = &m->s;
    const glmi4_nextn *N = s->nextn;
    const int H = s->hidden;
    for (int t = 0; t < T; t++) {
        float *joined = m->h + (size_t)t * m->ldq, *e = m->x + (size_t)t * H;
        m->tslot[t] = slot;
        m->tpos[t] = start + t;
        if (start + t == 0) {             /* nothing precedes position 0: its embedding is zero, so is its norm */
            memset(joined, 0, sizeof(float) * (size_t)H);
        } else {
            embed_row(&s->embed, ids[t], e);
            rmsnorm(e, N->enorm, H, s->norm_eps, joined);
        }
        rmsnorm(hidden + (size_t)t * H, N->hnorm, H, s->norm_eps, joined + H);
    }
    run_rows(m, &(rows_job){.kind = ROW_COPY, .T = T, .src = m->h, .lds = m->ldq}, &N->eh_proj);
    run_gemm(m->pool, m->isa, &N->eh_proj, T, m->aq, m->adx, m->axs, m->ldq, m->x, H, NULL, 0);
    layer_forward(m, s->n_layers, T);
}

/* ------------------------------------------------------------------ public API */

enum { E_OK = 0, E_ARG = -1, E_OVERFLOW = -2, E_TOKEN = -3, E_NOMEM = -4, E_ISA = -5 };

static int mat_ok(const glmi4_mat *W, int n, int k) {
    return W->data && W->n == n && W->k == k && W->n_pad % TILE == 0 && W->n_pad >= n && W->group % QK == 0 &&
           W->group > 0 && W->k_pad % W->group == 0 && W->k_pad >= k && (W->bits == 4 || (W->bits == 8 && !W->asym));
}

void glmi4_destroy(void *handle);

void *glmi4_create(const glmi4_spec *spec, char *err, int errlen) {
    const glmi4_spec *s = spec;
#define FAIL(...) do { if (err) snprintf(err, (size_t)errlen, __VA_ARGS__); glmi4_destroy(m); return NULL; } while (0)
    model *m = calloc(1, sizeof(model));
    if (!m) { if (err) snprintf(err, (size_t)errlen, "out of memory"); return NULL; }
    m->s = *s;
    if (s->n_kv <= 0 || s->n_heads % s->n_kv || s->head_dim % 4 || s->capacity < 1 || s->max_batch < 1 ||
        s->n_slots < 1 || s->head_dim > 1024 || s->rot_dim < 2 || s->rot_dim % 2 || s->rot_dim > s->head_dim)
        FAIL("unsupported shape: heads %d, kv heads %d, head_dim %d, rotary dims %d", s->n_heads, s->n_kv,
             s->head_dim, s->rot_dim);
    if (s->mla && (s->kv_lora < 1 || s->v_dim < 1 || s->nope < 1 || s->nope + s->rot_dim != s->head_dim ||
                   s->q_lora < 0))
        FAIL("unsupported latent attention shape: kv_lora_rank %d, v_head_dim %d, nope %d, rope %d", s->kv_lora,
             s->v_dim, s->nope, s->rot_dim);
    if (s->isa < 0 || s->isa >= ISA_COUNT || !isa_supported(s->isa))
        FAIL("this CPU cannot run the %s kernels", glmi4_isa_name(s->isa));
    m->isa = s->isa;
    const int NH = s->n_heads, qkvn = NH * s->head_dim + 2 * s->n_kv * s->head_dim, qw = s->nope + s->rot_dim;
    int any_sparse = 0;
    const glmi4_nextn *N = s->nextn;
    m->kv_layers = s->n_layers + (N != NULL);
    m->layers = calloc((size_t)m->kv_layers, sizeof(glmi4_layer));
    if (!m->layers) FAIL("out of memory");
    int kmax = s->head.k_pad, hkp = 0;
#define KMAX(W) do { kmax = (W).k_pad > kmax ? (W).k_pad : kmax; } while (0)
    if (N) {
        if (!N->enorm || !N->hnorm || !N->final_norm || !mat_ok(&N->eh_proj, s->hidden, 2 * s->hidden))
            FAIL("the NextN layer's packed weights do not match the model shape");
        KMAX(N->eh_proj);
    }
    for (int l = 0; l < m->kv_layers; l++) {
        const glmi4_layer *L = l < s->n_layers ? &s->layers[l] : &N->layer;
        m->layers[l] = *L;
        int ok = L->input_norm && L->post_norm;
        if (s->mla) {
            const int lora = L->q_a.data != NULL;
            ok = ok && mat_ok(&L->kv_a, s->kv_lora + s->rot_dim, s->hidden) && L->kv_a_norm &&
                 mat_ok(&L->kv_uk, NH * ROUND_TILE(s->kv_lora), s->nope) &&
                 mat_ok(&L->kv_uv, NH * ROUND_TILE(s->v_dim), s->kv_lora) &&
                 mat_ok(&L->attn_out, s->hidden, NH * s->v_dim) &&
                 (lora ? mat_ok(&L->q_a, s->q_lora, s->hidden) && L->q_a_norm && mat_ok(&L->q_b, NH * qw, s->q_lora)
                       : mat_ok(&L->q_b, NH * qw, s->hidden));
            if (ok) {
                KMAX(L->kv_a); KMAX(L->attn_out); KMAX(L->q_b);
                if (lora) KMAX(L->q_a);
                hkp = L->kv_uk.k_pad > hkp ? L->kv_uk.k_pad : hkp;
                hkp = L->kv_uv.k_pad > hkp ? L->kv_uv.k_pad : hkp;
            }
        } else {
            ok = ok && mat_ok(&L->qkv, qkvn, s->hidden) && mat_ok(&L->attn_out, s->hidden, NH * s->head_dim) &&
                 (!L->q_norm) == (!L->k_norm);
            if (ok) { KMAX(L->qkv); KMAX(L->attn_out); }
        }
        if (L->sparse) {
            const int E = s->n_experts, G = s->n_groups;
            if (E < 1 || s->top_k < 1 || s->top_k > E || G < 1 || E % G || s->topk_groups < 1 ||
                s->topk_groups > G || (G > 1 && E / G < 2) || s->top_k > s->topk_groups * (E / G))
                FAIL("unsupported routing: %d experts, top-%d, %d groups, top-%d groups", E, s->top_k, G,
                     s->topk_groups);
            ok = ok && L->router && L->router_bias && L->exp_up && L->exp_down;
            for (int e = 0; ok && e < E; e++) {
                ok = mat_ok(&L->exp_up[e], 2 * s->moe_ffn, s->hidden) && mat_ok(&L->exp_down[e], s->hidden, s->moe_ffn) &&
                     L->exp_up[e].k_pad == L->exp_up[0].k_pad;
                if (ok) { KMAX(L->exp_up[e]); KMAX(L->exp_down[e]); }
            }
            if (ok && s->shared_ffn) {
                ok = mat_ok(&L->shared_up, 2 * s->shared_ffn, s->hidden) &&
                     mat_ok(&L->shared_down, s->hidden, s->shared_ffn);
                if (ok) { KMAX(L->shared_up); KMAX(L->shared_down); }
            }
            any_sparse = 1;
        } else {
            ok = ok && mat_ok(&L->ffn_up, 2 * s->ffn, s->hidden) && mat_ok(&L->ffn_down, s->hidden, s->ffn);
            if (ok) { KMAX(L->ffn_up); KMAX(L->ffn_down); }
        }
        if (!ok) FAIL("layer %d: packed weights do not match the model shape", l);
    }
#undef KMAX
    m->s.layers = m->layers;
    if (!mat_ok(&s->head, s->vocab, s->hidden) || !s->final_norm || s->embed.n != s->vocab || s->embed.k != s->hidden)
        FAIL("output layer or embedding does not match the model shape");
    kmax = kmax > s->ffn ? kmax : s->ffn;
    kmax = (kmax + 127) / 128 * 128;
    m->ldq = kmax;
    m->hkp = hkp;
    const size_t T = (size_t)s->max_batch, nth = (size_t)(s->nthreads < 1 ? 1 : s->nthreads);
    const int grp = s->n_heads / s->n_kv;
    m->kv_elt = s->kv_f16 ? 2 : 4;
    m->kvh = s->mla ? 1 : s->n_kv;
    m->kvw = s->mla ? s->kv_lora + s->rot_dim : s->head_dim;
    const size_t kvn = (size_t)s->n_slots * m->kv_layers * m->kvh * s->capacity * m->kvw;
    m->base = calloc((size_t)s->n_slots, sizeof(int));
    m->len = calloc((size_t)s->n_slots, sizeof(int));
    m->tslot = calloc(T, sizeof(int));
    m->tpos = calloc(T, sizeof(int));
    m->trow = calloc(T, sizeof(int));
    if (!m->base || !m->len || !m->tslot || !m->tpos || !m->trow) FAIL("out of memory");
    m->kc = xalloc(kvn * m->kv_elt);
    m->x = xalloc(T * s->hidden * 4);
    m->h = xalloc(T * kmax * 4);
    m->ff = xalloc(T * 2 * s->ffn * 4);
    m->aq = xalloc(T * kmax);
    m->adx = xalloc(T * (kmax / QK) * 4);
    m->axs = xalloc(T * (kmax / QK) * 4);
    m->tmp = xalloc(nth * kmax * 4);
    int fail = !m->kc || !m->x || !m->h || !m->ff || !m->aq || !m->adx || !m->axs || !m->tmp;
    if (s->mla) {
        const size_t lw = (size_t)m->kvw, per_head = (size_t)NH * T;
#if GLMI4_X86
        if ((m->isa == ISA_VNNI && s->kv_lora % 16 == 0 && s->rot_dim % (16 / MLA_HV) == 0) ||
            (m->isa != ISA_REF && m->isa != ISA_VNNI && s->kv_lora % 32 == 0 && s->rot_dim % 8 == 0)) {
            m->mla_scratch = xalloc(nth * mla_thread_floats(s) * 4);
            m->mla_parts = xalloc((size_t)MLA_SPLIT * mla_chunks(s->capacity) * NH * (s->kv_lora + 2) * 4);
            m->mla_ml = xalloc(T * 2 * NH * 4);
            m->mla_blk = calloc(T + 1, sizeof(int));
            fail = fail || !m->mla_scratch || !m->mla_parts || !m->mla_ml || !m->mla_blk;
        } else
#endif
        {
            m->scores = xalloc(nth * SC_HEADS(NH) * s->capacity * 4);
            m->rowbuf = xalloc(nth * (SC_HEADS(NH) + ATT_BLK) * lw * 4);   /* packed queries, a block of rows */
            fail = fail || !m->scores || !m->rowbuf;
        }
        m->qa = xalloc(T * (s->q_lora ? s->q_lora : 1) * 4);
        m->kva = xalloc(T * lw * 4);
        m->qf = xalloc(T * NH * qw * 4);
        m->qlat = xalloc(per_head * s->kv_lora * 4);
        m->olat = xalloc(per_head * s->kv_lora * 4);
        m->vout = xalloc(per_head * s->v_dim * 4);
        m->hq = xalloc(per_head * hkp);
        m->hdx = xalloc(per_head * (hkp / QK) * 4);
        m->hxs = xalloc(per_head * (hkp / QK) * 4);
        m->uk = calloc((size_t)m->kv_layers * NH, sizeof(glmi4_mat));
        m->uv = calloc((size_t)m->kv_layers * NH, sizeof(glmi4_mat));
        fail = fail || !m->qa || !m->kva || !m->qf || !m->qlat || !m->olat || !m->vout ||
               !m->hq || !m->hdx || !m->hxs || !m->uk || !m->uv;
        for (int l = 0; !fail && l < m->kv_layers; l++)
            for (int h = 0; h < NH; h++) {     /* each head's rows of the stacked per-head matrices */
                const glmi4_layer *L = &m->layers[l];
                glmi4_mat *k = &m->uk[(size_t)l * NH + h], *v = &m->uv[(size_t)l * NH + h];
                *k = L->kv_uk;      /* a head's block is padded to whole tiles (zero rows) */
                k->n = s->kv_lora;
                k->n_pad = ROUND_TILE(s->kv_lora);
                k->data += (size_t)h * (k->n_pad / TILE) * tile_bytes(&L->kv_uk);
                *v = L->kv_uv;
                v->n = s->v_dim;
                v->n_pad = ROUND_TILE(s->v_dim);
                v->data += (size_t)h * (v->n_pad / TILE) * tile_bytes(&L->kv_uv);
            }
    } else {
        m->vc = xalloc(kvn * m->kv_elt);
        m->qkv = xalloc(T * qkvn * 4);
        m->att = xalloc(T * s->n_heads * s->head_dim * 4);
        m->scores = xalloc(nth * SC_HEADS(grp) * s->capacity * 4);
        m->rowbuf = xalloc(nth * ROWBUF(s->head_dim, grp) * 4);
        fail = fail || !m->vc || !m->qkv || !m->att || !m->scores || !m->rowbuf;
    }
    if (any_sparse) {
        const size_t A = T * (size_t)s->top_k, E = (size_t)s->n_experts, F = (size_t)s->moe_ffn;
        m->eid = calloc(A, sizeof(int));
        m->apos = calloc(A, sizeof(int));
        m->ew = calloc(A, sizeof(float));
        m->cnt = calloc(E, sizeof(int));
        m->start = calloc(2 * E, sizeof(int));
        m->rscore = xalloc(nth * 3 * E * 4);    /* per thread (or per token of a step of fewer tokens) */
        m->eq = xalloc(A * kmax);
        m->edx = xalloc(A * (kmax / QK) * 4);
        m->exs = xalloc(A * (kmax / QK) * 4);
        m->eup = xalloc(A * 2 * F * 4);
        m->eout = xalloc(A * s->hidden * 4);
        m->sup = xalloc(T * 2 * (size_t)(s->shared_ffn ? s->shared_ffn : 1) * 4);
        m->sout = xalloc(T * s->hidden * 4);
        fail = fail || !m->eid || !m->apos || !m->ew || !m->cnt || !m->start || !m->rscore || !m->eq || !m->edx ||
               !m->exs || !m->eup || !m->eout || !m->sup || !m->sout;
    }
    m->jobs = calloc((size_t)(s->n_experts > NH ? s->n_experts : NH) + 1, sizeof(gemm_job));
    if (fail || !m->jobs)
        FAIL("out of memory for the KV cache (%zu MiB) and work buffers; lower the context or the number of "
             "sequences", (s->mla ? 1 : 2) * kvn * m->kv_elt >> 20);
    m->pool = pool_new((int)nth);
    if (!m->pool) FAIL("could not start %d threads", (int)nth);
    return m;
#undef FAIL
}

void glmi4_destroy(void *handle) {
    model *m = handle;
    if (!m) return;
    pool_free(m->pool);
    free(m->layers);
    free(m->kc); free(m->vc); free(m->x); free(m->h); free(m->qkv); free(m->att); free(m->ff);
    free(m->aq); free(m->adx); free(m->axs); free(m->scores); free(m->rowbuf); free(m->tmp);
    free(m->base); free(m->len); free(m->tslot); free(m->tpos); free(m->trow);
    free(m->eid); free(m->apos); free(m->ew); free(m->cnt); free(m->start); free(m->rscore); free(m->eq);
    free(m->edx); free(m->exs); free(m->eup); free(m->eout); free(m->sup); free(m->sout); free(m->jobs);
    free(m->qa); free(m->kva); free(m->qf); free(m->qlat); free(m->olat); free(m->vout); free(m->hq);
    free(m->hdx); free(m->hxs); free(m->uk); free(m->uv);
    free(m->mla_scratch); free(m->mla_parts); free(m->mla_ml); free(m->mla_blk);
    free(m);
}

static int slot_ok(const model *m, int slot) { return slot >= 0 && slot < m->s.n_slots; }

int glmi4_kv_len(void *handle, int slot) {
    model *m = handle;
    return slot_ok(m, slot) ? m->len[slot] : E_ARG;
}

void glmi4_reset(void *handle, int slot) {
    model *m = handle;
    if (!slot_ok(m, slot)) return;
    m->len[slot] = 0;
    m->base[slot] = 0;
}

/* One step over n_entries entries: entry e appends counts[e] ids (concatenated in ids, in entry order) to
 * slot slots[e]; at most one entry per slot. The tokens of all entries go through the layers together,
 * max_batch at a time. logits: NULL, or in entry order each entry's last position's row, every position's rows
 * for the entries with all[e] set (all: NULL for none) [rows][vocab]. hidden: NULL, or [sum counts][hidden],
 * every token's final normed hidden state (what a NextN layer drafts from). Nothing is appended when an argument
 * is refused. */
int glmi4_step(void *handle, const int32_t *ids, const int32_t *slots, const int32_t *counts, int n_entries,
               float *logits, const uint8_t *all, float *hidden) {
    model *m = handle;
    const glmi4_spec *s = &m->s;
    if (n_entries < 1) return E_ARG;
    int total = 0;
    for (int e = 0; e < n_entries; e++) {
        if (!slot_ok(m, slots[e]) || counts[e] < 1) return E_ARG;
        for (int f = 0; f < e; f++)
            if (slots[f] == slots[e]) return E_ARG;
        if (m->len[slots[e]] + counts[e] > s->capacity) return E_OVERFLOW;
        total += counts[e];
    }
    for (int i = 0; i < total; i++)
        if (ids[i] < 0 || ids[i] >= s->vocab) return E_TOKEN;
    int *rows = m->trow;
    int e = 0, off = 0;                     /* entry of the next token, its offset in that entry */
    size_t written = 0;                     /* logits rows filled so far */
    for (int done = 0; done < total;) {
        const int T = imin(s->max_batch, total - done);
        int R = 0;
        for (int t = 0; t < T; t++) {
            m->tslot[t] = slots[e];
            m->tpos[t] = m->len[slots[e]] + off;
            const int last = ++off == counts[e];
            if ((all && all[e]) || last) rows[R++] = t;
            if (last) { e++; off = 0; }
        }
        float *out = logits && R ? logits + written * s->vocab : NULL;
        forward_chunk(m, ids + done, T, rows, out ? R : 0, out, hidden ? hidden + (size_t)done * s->hidden : NULL);
        written += R;
        done += T;
    }
    for (int i = 0; i < n_entries; i++) m->len[slots[i]] += counts[i];
    return E_OK;
}

/* The NextN layer over positions start..start+T-1 of slot's ring (its own cache layer; positions may lie past
 * the slot's length: chained drafts): ids [T] the tokens after those positions, hidden [T][hidden] the states
 * there. logits [vocab]: the last position's; x_out [hidden]: its layer output before the final norm (the
 * state a chained draft takes). Chunks of max_batch positions, each cached before the next attends. */
int glmi4_draft(void *handle, int slot, int start, int T, const int32_t *ids, const float *hidden, float *logits,
                float *x_out) {
    model *m = handle;
    const glmi4_spec *s = &m->s;
    if (!s->nextn) return E_ARG;
    if (!slot_ok(m, slot) || T < 1 || start < 0) return E_ARG;
    if (start + T > s->capacity) return E_OVERFLOW;
    for (int t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= s->vocab) return E_TOKEN;
    int done = 0, n = 0;
    for (; done < T; done += n) {
        n = imin(s->max_batch, T - done);
        nextn_chunk(m, slot, start + done, ids + done, hidden + (size_t)done * s->hidden, n);
    }
    const int last = n - 1;
    memcpy(x_out, m->x + (size_t)last * s->hidden, sizeof(float) * (size_t)s->hidden);
    head_rows(m, s->nextn->final_norm, &last, 1, logits);
    return E_OK;
}

/* dst drops what it held and holds src's first n positions (src == dst: keep the first n) */
int glmi4_copy_prefix(void *handle, int src, int dst, int n) {
    model *m = handle;
    const glmi4_spec *s = &m->s;
    if (!slot_ok(m, src) || !slot_ok(m, dst) || n < 0 || n > m->len[src]) return E_ARG;
    if (src != dst) {
        const size_t rowb = (size_t)m->kvw * m->kv_elt;
        for (int l = 0; l < m->kv_layers; l++)
            for (int kh = 0; kh < m->kvh; kh++) {
                /* the source's ring may wrap: copy in at most two runs; dst starts unwrapped (base 0) */
                const int p0 = phys(m, src, 0), first = imin(n, s->capacity - p0);
                const size_t d = kv_off(m, dst, l, kh, 0) * m->kv_elt;
                const size_t a = kv_off(m, src, l, kh, p0) * m->kv_elt, b = kv_off(m, src, l, kh, 0) * m->kv_elt;
                void *caches[2] = {m->kc, m->vc};
                for (int c = 0; c < 2 && caches[c]; c++) {
                    memcpy((char *)caches[c] + d, (char *)caches[c] + a, rowb * first);
                    memcpy((char *)caches[c] + d + rowb * first, (char *)caches[c] + b, rowb * (n - first));
                }
            }
        m->base[dst] = 0;
    }
    m->len[dst] = n;
    return E_OK;
}

/* The prompt cache's copy of a slot's first n positions, in the cache's own elements: [K, then V unless the
 * attention is latent][cached layer (the NextN layer's last, where one is loaded)][cache row][n][row width].
 * glmi4_kv_bytes(h, n) is its size. */
long long glmi4_kv_bytes(void *handle, int n) {
    const model *m = handle;
    return (long long)(m->vc ? 2 : 1) * m->kv_layers * m->kvh * n * m->kvw * (long long)m->kv_elt;
}

/* copy the first n positions of a slot out (to_slot 0) or in (to_slot 1; the slot then holds exactly them) */
static int kv_transfer(model *m, int slot, int n, char *buf, int to_slot) {
    const glmi4_spec *s = &m->s;
    if (!slot_ok(m, slot) || n < 1 || n > s->capacity || (!to_slot && n > m->len[slot])) return E_ARG;
    if (to_slot) m->base[slot] = 0;          /* imported rows start the ring unwrapped */
    const size_t rowb = (size_t)m->kvw * m->kv_elt;
    const int p0 = phys(m, slot, 0), first = imin(n, s->capacity - p0);   /* the ring may wrap: two runs */
    void *caches[2] = {m->kc, m->vc};
    for (int c = 0; c < 2 && caches[c]; c++)
        for (int l = 0; l < m->kv_layers; l++)
            for (int kh = 0; kh < m->kvh; kh++, buf += rowb * n) {
                char *a = (char *)caches[c] + kv_off(m, slot, l, kh, p0) * m->kv_elt;
                char *b = (char *)caches[c] + kv_off(m, slot, l, kh, 0) * m->kv_elt;
                if (to_slot) {
                    memcpy(a, buf, rowb * first);
                    memcpy(b, buf + rowb * first, rowb * (n - first));
                } else {
                    memcpy(buf, a, rowb * first);
                    memcpy(buf + rowb * first, b, rowb * (n - first));
                }
            }
    if (to_slot) m->len[slot] = n;
    return E_OK;
}

int glmi4_kv_export(void *handle, int slot, int n, void *out) { return kv_transfer(handle, slot, n, out, 0); }
int glmi4_kv_import(void *handle, int slot, int n, const void *in) { return kv_transfer(handle, slot, n, (char *)in, 1); }

typedef struct {
    model *m;
    int slot, n_keep;
    const float *c, *sn;
    _Atomic int next;         /* the next cached layer to re-rotate */
} shift_job;

static void shift_task(void *arg, int tid, int nth) {
    (void)tid, (void)nth;
    shift_job *j = arg;
    model *m = j->m;
    const glmi4_spec *s = &m->s;
    const int at = s->mla ? s->kv_lora : 0;      /* where the rotated dims start in a cache row */
    float row[1024];
    for (int l; (l = atomic_fetch_add(&j->next, 1)) < m->kv_layers;)
        for (int kh = 0; kh < m->kvh; kh++)
            for (int i = j->n_keep; i < m->len[j->slot]; i++) {
                const size_t off = kv_off(m, j->slot, l, kh, phys(m, j->slot, i)) + at;
                kv_get(m, m->kc, off, row, s->rot_dim);
                rope(row, 1, s->rot_dim, s->rot_dim, j->c, j->sn, s->rope_neox);
                kv_put(m, m->kc, off, row, s->rot_dim);
            }
}

/* StreamingLLM: drop logical slots n_keep..n_keep+n_discard-1. The ring advances by n_discard, the
 * n_keep attention sinks are copied forward (O(n_keep)), and the remaining keys are re-rotated by
 * -n_discard positions in place, so positions stay 0..len-1 without recomputing anything. */
int glmi4_shift(void *handle, int slot, int n_keep, int n_discard) {
    model *m = handle;
    const glmi4_spec *s = &m->s;
    if (!slot_ok(m, slot) || n_keep < 0 || n_discard < 0 || n_keep + n_discard > m->len[slot] || s->head_dim > 1024)
        return E_ARG;
    if (n_discard == 0) return E_OK;
    const size_t rowb = (size_t)m->kvw * m->kv_elt;
    for (int l = 0; l < m->kv_layers; l++)
        for (int kh = 0; kh < m->kvh; kh++)
            for (int i = n_keep - 1; i >= 0; i--) {      /* descending: source and target may overlap */
                const size_t src = kv_off(m, slot, l, kh, phys(m, slot, i)) * m->kv_elt;
                const size_t dst = kv_off(m, slot, l, kh, phys(m, slot, i + n_discard)) * m->kv_elt;
                memmove((char *)m->kc + dst, (char *)m->kc + src, rowb);
                if (m->vc) memmove((char *)m->vc + dst, (char *)m->vc + src, rowb);
            }
    m->base[slot] = (m->base[slot] + n_discard) % s->capacity;
    m->len[slot] -= n_discard;
    float c[512], sn[512];                        /* rot_dim <= head_dim <= 1024 (checked at create) */
    for (int i = 0; i < s->rot_dim / 2; i++) {    /* rotate by -n_discard; angles in double */
        const double ang = -(double)n_discard * (double)s->inv_freq[i];
        c[i] = (float)cos(ang);
        sn[i] = (float)sin(ang);
    }
    shift_job j = {.m = m, .slot = slot, .n_keep = n_keep, .c = c, .sn = sn};
    atomic_store(&j.next, 0);
    pool_run(m->pool, shift_task, &j);
    return E_OK;
}

/* ------------------------------------------------------------------ entry points for tests and benchmarks */

int glmi4_quant_act(int isa, const float *x, int K, int Kp, int G, int8_t *q, float *dx, float *xs) {
    if (!isa_supported(isa) || Kp % G || G % QK || Kp < K) return E_ISA;
    pick_quant(isa)(x, K, Kp, G, q, dx, xs);
    return E_OK;
}

/* out[M][W->n] = x[M][W->k] @ W.T with the given kernel variant and thread count. */
int glmi4_matmul(int isa, const glmi4_mat *W, int M, const float *x, float *out, int nthreads) {
    if (!isa_supported(isa)) return E_ISA;
    if (!mat_ok(W, W->n, W->k) || M < 1) return E_ARG;
    const int ldq = W->k_pad, nbx = ldq / QK;
    int8_t *q = xalloc((size_t)M * ldq);
    float *dx = xalloc((size_t)M * nbx * 4), *xs = xalloc((size_t)M * nbx * 4);
    pool *p = nthreads > 1 ? pool_new(nthreads) : NULL;
    int rc = (!q || !dx || !xs || (nthreads > 1 && !p)) ? E_NOMEM : E_OK;
    if (!rc) {
        for (int m = 0; m < M; m++)
            pick_quant(isa)(x + (size_t)m * W->k, W->k, W->k_pad, W->group, q + (size_t)m * ldq, dx + (size_t)m * nbx,
                            xs + (size_t)m * nbx);
        run_gemm(p, isa, W, M, q, dx, xs, ldq, out, W->n, NULL, 0);
    }
    pool_free(p);
    free(q); free(dx); free(xs);
    return rc;
}

/* Time `iters` matrix-vector products (M tokens) on prepared activations: the kernel's own speed. */
double glmi4_bench_matmul(int isa, const glmi4_mat *W, int M, int iters, int nthreads) {
    if (!isa_supported(isa) || !mat_ok(W, W->n, W->k) || M < 1) return -1.0;
    const int ldq = W->k_pad, nbx = ldq / QK;
    int8_t *q = xalloc((size_t)M * ldq);
    float *dx = xalloc((size_t)M * nbx * 4), *xs = xalloc((size_t)M * nbx * 4), *x = xalloc((size_t)W->k * 4),
          *out = xalloc((size_t)M * W->n * 4);
    pool *p = pool_new(nthreads);
    double secs = -1.0;
    if (q && dx && xs && x && out && p) {
        for (int i = 0; i < W->k; i++) x[i] = (float)((i * 7919) % 255 - 127) / 127.f;
        for (int m = 0; m < M; m++)
            pick_quant(isa)(x, W->k, W->k_pad, W->group, q + (size_t)m * ldq, dx + (size_t)m * nbx, xs + (size_t)m * nbx);
        run_gemm(p, isa, W, M, q, dx, xs, ldq, out, W->n, NULL, 0);
        const uint64_t t0 = now_ns();
        for (int i = 0; i < iters; i++) run_gemm(p, isa, W, M, q, dx, xs, ldq, out, W->n, NULL, 0);
        secs = (double)(now_ns() - t0) * 1e-9 / iters;
    }
    pool_free(p);
    free(q); free(dx); free(xs); free(x); free(out);
    return secs;
}

/* f32 <-> f16 as the KV cache stores it (tests check the software conversion against numpy). */
void glmi4_f2h(const float *x, uint16_t *out, int n) { for (int i = 0; i < n; i++) out[i] = f2h(x[i]); }
void glmi4_h2f(const uint16_t *x, float *out, int n) { for (int i = 0; i < n; i++) out[i] = h2f(x[i]); }
