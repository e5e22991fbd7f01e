// out [M, N] = x [M, K] float32 times w [N, K] float32 transposed (+ a float32 bias), with AVX2
// and FMA: the float32 linears and LM head of the CPU worker on CPUs without AVX-512, where it
// is faster than oneDNN at every batch size (benchmarks/results/avx2/linears.md).
//
// The weight is packed once (kernels/cpu/f32_matmul.py) into panels of PANEL_COLUMNS output
// columns, [N / 16][K][16] with N padded to a multiple of 16, so one k of a panel is one
// 64-byte cache line: two 8-float vectors. A tile of TILE_ROWS rows x one panel keeps its
// 6 x 2 sums in 12 registers (plus 2 weight vectors and 1 broadcast of x: 15 of 16), the usual
// AVX2 micro-kernel shape. Each thread owns a contiguous run of panels; its row tiles go
// through a panel in passes of PASS_K (so the part of the panel they share stays in L1), and
// meanwhile prefetch the next panel, spread evenly over the tiles and passes, so memory
// streams the weight while the FMAs run instead of between panels. A thread done with its
// run takes what is left of the others' from their ends (see share_units), so a core slowed
// by another process does not hold the call up. `out` is contiguous [M, N]: padding columns
// are computed and never stored. The gated MLP's gate_up matmul can store silu(gate) * up
// instead (f32_matmul_silu_and_mul).
// Built by kernels/cpu/kernel_loader.py with `cc -O3 -march=native -fopenmp`.

#include <stdint.h>
#include <string.h>

#include "scalar_math.h"
#include "work_sharing.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define F32_MATMUL_BUILT 1
#include <immintrin.h>
#include <omp.h>

#include "f32_tiles.h"

// x bytes of one row block: under half of a 512 KiB L2 (Zen 3), room left for the panel.
#define ROW_BLOCK_BYTES (192 * 1024)
// Tiles of one row block at most (384 rows): its tiles' sums live on the thread's stack
// between passes (a TileSums each, two for the gated MLP), 48 KiB at most even for a tiny k.
#define MAX_BLOCK_TILES 64

// One call as its threads share it. A unit of work is one row block (at most ROW_BLOCK_BYTES
// of x, so it stays in L2 while the panels stream past it) times one panel, or for the gated
// MLP one (gate, up) pair of panels. Thread r of T owns the panels [P r / T, P (r + 1) / T) of
// every row block and goes through them block by block: a decode batch (one block) is a run of
// panels, and a prompt no longer reads all of its x from L3 again for every panel (941 rows x
// 576: 2 MiB per panel). Every output is one tile's k-ordered sum whichever thread computes
// it: the sharing changes no bit.
typedef struct {
    const float* x;
    int64_t x_stride;
    const float* packed;
    const float* bias;
    float* out;
    int64_t rows, k;
    int64_t num_columns;      // of `out`
    int64_t units_per_block;  // panels, or (gate, up) pairs when `gated`
    int gated;
    int64_t num_tiles, block_tiles, num_blocks;
} Matmul;

static Matmul matmul_of(const float* x, int64_t x_stride, const float* packed,
                        const float* bias, float* out, int64_t rows, int64_t k,
                        int64_t num_columns, int64_t units_per_block, int gated) {
    const int64_t tile_bytes = TILE_ROWS * k * (int64_t)sizeof(float);
    const int64_t num_tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t fitting = tile_bytes < ROW_BLOCK_BYTES ? ROW_BLOCK_BYTES / tile_bytes : 1;
    const int64_t block_tiles = fitting < MAX_BLOCK_TILES ? fitting : MAX_BLOCK_TILES;
    const Matmul m = {
        .x = x,
        .x_stride = x_stride,
        .packed = packed,
        .bias = bias,
        .out = out,
        .rows = rows,
        .k = k,
        .num_columns = num_columns,
        .units_per_block = units_per_block,
        .gated = gated,
        .num_tiles = num_tiles,
        .block_tiles = block_tiles,
        .num_blocks = (num_tiles + block_tiles - 1) / block_tiles,
    };
    return m;
}

static inline const float* panel_at(const Matmul* m, int64_t panel) {
    return m->packed + panel * m->k * PANEL_COLUMNS;
}

static inline int64_t tile_first_row(const Matmul* m, int64_t t) {
    return m->rows * t / m->num_tiles;
}

// How a unit's tiles go through its panel: in `passes` passes over k (PASS_K at most each),
// every tile per pass; call c of them (pass c / tiles, tile c % tiles) prefetches lines
// [lines c / calls, lines (c + 1) / calls) of the next panel.
typedef struct {
    int64_t k, num_tiles, passes, calls;
} Passes;

static inline Passes passes_of(int64_t k, int64_t num_tiles) {
    const int64_t passes = k > PASS_K ? (k + PASS_K - 1) / PASS_K : 1;
    const Passes p = {k, num_tiles, passes, passes * num_tiles};
    return p;
}

static inline int64_t pass_begin(const Passes* p, int64_t call) {
    return p->k * (call / p->num_tiles) / p->passes;
}

static inline int64_t pass_end(const Passes* p, int64_t call) {
    return p->k * (call / p->num_tiles + 1) / p->passes;
}

static inline int64_t share_of(int64_t lines, const Passes* p, int64_t call) {
    return lines * call / p->calls;
}

// Row tiles [first_tile, end_tile) through panel `panel`, pass by pass, prefetching `next` (a
// panel, or NULL) spread evenly over the calls, so memory streams the next weight while the
// FMAs run. Rows are split evenly over the fewest tiles of at most TILE_ROWS (27 rows: 6, 6,
// 5, 5, 5): a tile of r rows keeps 2r FMA chains going, and below 4 rows (8 chains, two FMA
// units of latency 4) it waits on its own sums.
static void panel_tiles(const Matmul* m, int64_t panel, int64_t first_tile, int64_t end_tile,
                        const float* next) {
    const Passes p = passes_of(m->k, end_tile - first_tile);
    const int64_t next_lines = next != NULL ? m->k : 0;
    const int64_t first_column = panel * PANEL_COLUMNS;
    const int64_t columns_left = m->num_columns - first_column;
    TileSums sums[p.num_tiles];
    memset(sums, 0, sizeof(sums));
    for (int64_t call = 0; call < p.calls; ++call) {
        const int64_t t = first_tile + call % p.num_tiles;
        const int64_t row = tile_first_row(m, t);
        const int64_t first_line = share_of(next_lines, &p, call);
        tile_rows(m->x + row * m->x_stride, m->x_stride, panel_at(m, panel),
                  pass_begin(&p, call), pass_end(&p, call), &sums[t - first_tile],
                  (const char*)next + first_line * LINE_BYTES,
                  share_of(next_lines, &p, call + 1) - first_line,
                  (int)(tile_first_row(m, t + 1) - row));
    }
    for (int64_t t = first_tile; t < end_tile; ++t) {
        const int64_t row = tile_first_row(m, t);
        const TileOutput o = {
            m->out + row * m->num_columns + first_column,
            m->num_columns,
            m->bias != NULL ? m->bias + first_column : NULL,
            (int32_t)(columns_left < PANEL_COLUMNS ? columns_left : PANEL_COLUMNS),
            NULL,
        };
        store_tile(&sums[t - first_tile], &o, (int)(tile_first_row(m, t + 1) - row));
    }
}

// Row tiles [first_tile, end_tile) through (gate, up) pair j of a gate_up weight whose up half
// starts at panel units_per_block, pass by pass: the gate panel's sums, then the up panel's;
// at the end each tile's gate outputs go to a 6 x 16 scratch (L1) and its up tile stores
// silu(gate) * up into `out` [rows, num_columns]. The gate calls prefetch the up panel, the up
// calls `next` (the next pair's gate panel, or NULL).
static void pair_tiles(const Matmul* m, int64_t j, int64_t first_tile, int64_t end_tile,
                       const float* next) {
    const Passes p = passes_of(m->k, end_tile - first_tile);
    const int64_t next_lines = next != NULL ? m->k : 0;
    const float* w_gate = panel_at(m, j);
    const float* w_up = panel_at(m, m->units_per_block + j);
    const float* gate_bias = m->bias != NULL ? m->bias + j * PANEL_COLUMNS : NULL;
    const float* up_bias = m->bias != NULL ? m->bias + m->num_columns + j * PANEL_COLUMNS : NULL;
    TileSums gate_sums[p.num_tiles], up_sums[p.num_tiles];
    memset(gate_sums, 0, sizeof(gate_sums));
    memset(up_sums, 0, sizeof(up_sums));
    for (int64_t call = 0; call < p.calls; ++call) {
        const int64_t t = first_tile + call % p.num_tiles;
        const int64_t row = tile_first_row(m, t);
        const int num_rows = (int)(tile_first_row(m, t + 1) - row);
        const float* x_rows = m->x + row * m->x_stride;
        const int64_t begin = pass_begin(&p, call), end = pass_end(&p, call);
        const int64_t first_up = share_of(m->k, &p, call);
        const int64_t first_next = share_of(next_lines, &p, call);
        tile_rows(x_rows, m->x_stride, w_gate, begin, end, &gate_sums[t - first_tile],
                  (const char*)w_up + first_up * LINE_BYTES,
                  share_of(m->k, &p, call + 1) - first_up, num_rows);
        tile_rows(x_rows, m->x_stride, w_up, begin, end, &up_sums[t - first_tile],
                  (const char*)next + first_next * LINE_BYTES,
                  share_of(next_lines, &p, call + 1) - first_next, num_rows);
    }
    float gate[TILE_ROWS * PANEL_COLUMNS] __attribute__((aligned(32)));
    for (int64_t t = first_tile; t < end_tile; ++t) {
        const int64_t row = tile_first_row(m, t);
        const int num_rows = (int)(tile_first_row(m, t + 1) - row);
        const TileOutput to_gate = {gate, PANEL_COLUMNS, gate_bias, PANEL_COLUMNS, NULL};
        const TileOutput to_out = {m->out + row * m->num_columns + j * PANEL_COLUMNS,
                                   m->num_columns, up_bias, PANEL_COLUMNS, gate};
        store_tile(&gate_sums[t - first_tile], &to_gate, num_rows);
        store_tile(&up_sums[t - first_tile], &to_out, num_rows);
    }
}

// Row block `block` times panel (or pair) `panel`, prefetching weight panel `next` (-1: none).
static void run_unit(const Matmul* m, int64_t block, int64_t panel, int64_t next) {
    const int64_t first_tile = block * m->block_tiles;
    const int64_t end_tile =
        first_tile + m->block_tiles < m->num_tiles ? first_tile + m->block_tiles : m->num_tiles;
    const float* next_panel = next >= 0 ? panel_at(m, next) : NULL;
    if (m->gated)
        pair_tiles(m, panel, first_tile, end_tile, next_panel);
    else
        panel_tiles(m, panel, first_tile, end_tile, next_panel);
}

// Run `run` of `parts` from the front (its owner, prefetching each unit's successor) or from
// the back (another thread, prefetching the unit before), until nothing is left of it. Unit i
// of the run is row block i / width times the run's (i % width)-th panel.
static void take_units(const Matmul* m, RunClaims* claims, int parts, int run, int from_front) {
    const int64_t first_panel = m->units_per_block * run / parts;
    const int64_t width = m->units_per_block * (run + 1) / parts - first_panel;
    const int64_t size = width * m->num_blocks;
    const int step = from_front ? 1 : -1;
    for (int64_t i; (i = claim(&claims[run], size, from_front)) >= 0;) {
        const int64_t next = i + step >= 0 && i + step < size ? first_panel + (i + step) % width
                                                              : -1;
        run_unit(m, i / width, first_panel + i % width, next);
    }
}

// Thread `part` of `parts` (inside the parallel region): its own run, then what is left of the
// others (work_sharing.h).
static void share_units(const Matmul* m, RunClaims* claims, int parts, int part) {
    take_units(m, claims, parts, part, 1);
    for (int other = 1; other < parts; ++other)
        take_units(m, claims, parts, (part + other) % parts, 0);
}

// `m` on `num_threads` threads sharing its units.
static void run_shared(const Matmul* m, int32_t num_threads) {
    const int32_t slots = num_threads > 1 ? num_threads : 1;
    RunClaims runs[slots];
    init_claims(runs, slots);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    share_units(m, runs, omp_get_num_threads(), omp_get_thread_num());
}
#endif

// Output columns per panel (the packed weight's rows are padded to a multiple of this); 0
// where the kernel is not built (no AVX2/FMA, or AVX-512, where oneDNN's wider code runs).
int f32_matmul_panel_columns(void) {
#if defined(F32_MATMUL_BUILT)
    return PANEL_COLUMNS;
#else
    return 0;
#endif
}

// x: float32 [rows, k] with rows `x_stride` floats apart and unit column stride; packed: the
// weight as above, 64-byte aligned, `num_panels` panels of which the first `num_columns`
// columns are real; bias: float32 [num_columns] or NULL; out: contiguous float32
// [rows, num_columns]. Units (row block x panel) are shared by `num_threads` threads.
void f32_matmul(const float* x, int64_t x_stride, const float* packed, const float* bias,
                float* out, int64_t rows, int64_t k, int64_t num_panels, int64_t num_columns,
                int32_t num_threads) {
#if defined(F32_MATMUL_BUILT)
    const Matmul m = matmul_of(x, x_stride, packed, bias, out, rows, k, num_columns, num_panels, 0);
    run_shared(&m, num_threads);
#else
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)rows, (void)k;
    (void)num_panels, (void)num_columns, (void)num_threads;
#endif
}

// out [rows, width] = silu(x W_gate^T + b_gate) * (x W_up^T + b_up) for a gate_up weight
// packed as above with its up half starting at panel num_pairs (width = num_pairs * 16: the
// halves split on a panel boundary), bias [2 * width] or NULL: the gated MLP's matmul and
// activation in one pass, without the [rows, 2 * width] intermediate. Units (row block x
// pair) are shared by `num_threads` threads as in f32_matmul.
void f32_matmul_silu_and_mul(const float* x, int64_t x_stride, const float* packed,
                             const float* bias, float* out, int64_t rows, int64_t k,
                             int64_t num_pairs, int32_t num_threads) {
#if defined(F32_MATMUL_BUILT)
    const Matmul m =
        matmul_of(x, x_stride, packed, bias, out, rows, k, num_pairs * PANEL_COLUMNS, num_pairs,
                  1);
    run_shared(&m, num_threads);
#else
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)out, (void)rows, (void)k;
    (void)num_pairs, (void)num_threads;
#endif
}
