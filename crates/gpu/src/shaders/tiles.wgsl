// What the products' shaders share (appended to each by `product.rs`; the shader declares `xs`,
// `out` and `dims`): the one-token kernel's reduction of a team's row sums, and the chunk
// kernel's tiles.
//
// Chunk: tiles of 128 rows x 64 tokens, 32 columns deep per step. Each step, every invocation
// puts 4 rows x 4 columns of decoded, scaled weights into `wt` (`put_weights`) and invocations
// below 128 put 4 tokens x 4 columns of inputs into `xt` (`put_inputs`), both transposed so that
// the multiply reads whole vec4s: 8 rows of weights in two loads and 4 tokens of inputs in one,
// for 32 multiply-adds (`multiply_tile`). Invocation lid accumulates rows 8 (lid / 16) .. +7 of
// tokens 4 (lid % 16) .. +3.

const LANES: u32 = 32u;
const TEAM_ROWS: u32 = 4u;
const ROWS: u32 = 32u;
var<workgroup> partial: array<vec4<f32>, 256>;

// The team's 32 lanes each hold partial sums of the team's 4 rows from `row0`: add them up and
// write the rows that exist.
fn team_sum_store(lid: u32, row0: u32, acc: vec4<f32>) {
    let lane = lid % LANES;
    partial[lid] = acc;
    workgroupBarrier();
    for (var off = LANES / 2u; off > 0u; off >>= 1u) {
        if lane < off {
            partial[lid] += partial[lid + off];
        }
        workgroupBarrier();
    }
    if lane < TEAM_ROWS && row0 + lane < dims.rows {
        out[row0 + lane] = partial[lid - lane][lane];
    }
}

// The rows of a team (4 from `row0`), those past the matrix replaced by row 0 (in bounds; never
// written).
fn team_rows(row0: u32) -> vec4<u32> {
    let rows = vec4<u32>(row0, row0 + 1u, row0 + 2u, row0 + 3u);
    return select(vec4<u32>(0u), rows, rows < vec4<u32>(dims.rows));
}

const TR: u32 = 128u;
const TT: u32 = 64u;
var<workgroup> wt: array<vec4<f32>, 1024>; // [32 columns][32 quads of rows]
var<workgroup> xt: array<vec4<f32>, 512>; // [32 columns][16 quads of tokens]

// Invocation lid's 4 rows (rq = lid / 8) at 4 columns (kq = lid % 8) of the step: w_i holds row
// i's four values.
fn put_weights(lid: u32, w0: vec4<f32>, w1: vec4<f32>, w2: vec4<f32>, w3: vec4<f32>) {
    let rq = lid / 8u;
    let k = 4u * (lid % 8u);
    wt[(k + 0u) * 32u + rq] = vec4<f32>(w0.x, w1.x, w2.x, w3.x);
    wt[(k + 1u) * 32u + rq] = vec4<f32>(w0.y, w1.y, w2.y, w3.y);
    wt[(k + 2u) * 32u + rq] = vec4<f32>(w0.z, w1.z, w2.z, w3.z);
    wt[(k + 3u) * 32u + rq] = vec4<f32>(w0.w, w1.w, w2.w, w3.w);
}

// Token t's 4 inputs at columns 32 b + 4 kq .. +3, zeros past the chunk.
fn input_quad(t: u32, b: u32, kq: u32) -> vec4<f32> {
    if t >= dims.n {
        return vec4<f32>(0.0);
    }
    return xs[(t * dims.cols) / 4u + 8u * b + kq];
}

// The step's inputs (columns 32 b .. +31) of tokens tok0 .. +63: invocation lid < 128 reads
// 4 tokens (tq = lid / 8) x 4 columns (kq = lid % 8); tokens past n are zeros.
fn put_inputs(lid: u32, tok0: u32, b: u32) {
    if lid >= 128u {
        return;
    }
    let tq = lid / 8u;
    let kq = lid % 8u;
    let t = tok0 + 4u * tq;
    let v0 = input_quad(t, b, kq);
    let v1 = input_quad(t + 1u, b, kq);
    let v2 = input_quad(t + 2u, b, kq);
    let v3 = input_quad(t + 3u, b, kq);
    let k = 4u * kq;
    xt[k * 16u + tq] = vec4<f32>(v0.x, v1.x, v2.x, v3.x);
    xt[(k + 1u) * 16u + tq] = vec4<f32>(v0.y, v1.y, v2.y, v3.y);
    xt[(k + 2u) * 16u + tq] = vec4<f32>(v0.z, v1.z, v2.z, v3.z);
    xt[(k + 3u) * 16u + tq] = vec4<f32>(v0.w, v1.w, v2.w, v3.w);
}

// An invocation's 8 rows x 4 tokens of sums: t<j>a rows 0-3 and t<j>b rows 4-7 of token j. Named
// fields, not an array: an array indexed by a loop variable anywhere (as a store loop would)
// can move all of it out of registers into per-invocation memory, and every multiply-add of
// the tile with it (the H100 ran the products at 0.03-0.04 of its FMA roof that way, at
// commit c564209).
struct Acc {
    t0a: vec4<f32>,
    t0b: vec4<f32>,
    t1a: vec4<f32>,
    t1b: vec4<f32>,
    t2a: vec4<f32>,
    t2b: vec4<f32>,
    t3a: vec4<f32>,
    t3b: vec4<f32>,
}

fn multiply_tile(lid: u32, acc: ptr<function, Acc>) {
    let ty = lid / 16u;
    let tx = lid % 16u;
    for (var k = 0u; k < 32u; k++) {
        let wa = wt[k * 32u + 2u * ty];
        let wb = wt[k * 32u + 2u * ty + 1u];
        let x = xt[k * 16u + tx];
        (*acc).t0a += wa * x.x;
        (*acc).t0b += wb * x.x;
        (*acc).t1a += wa * x.y;
        (*acc).t1b += wb * x.y;
        (*acc).t2a += wa * x.z;
        (*acc).t2b += wb * x.z;
        (*acc).t3a += wa * x.w;
        (*acc).t3b += wb * x.w;
    }
}

// Token t's rows r .. r + 7 (a: the first 4, b: the next), those in the matrix and the chunk.
fn store_token(t: u32, r: u32, a: vec4<f32>, b: vec4<f32>) {
    if t >= dims.n {
        return;
    }
    let o = t * dims.rows + r;
    if r < dims.rows { out[o] = a.x; }
    if r + 1u < dims.rows { out[o + 1u] = a.y; }
    if r + 2u < dims.rows { out[o + 2u] = a.z; }
    if r + 3u < dims.rows { out[o + 3u] = a.w; }
    if r + 4u < dims.rows { out[o + 4u] = b.x; }
    if r + 5u < dims.rows { out[o + 5u] = b.y; }
    if r + 6u < dims.rows { out[o + 6u] = b.z; }
    if r + 7u < dims.rows { out[o + 7u] = b.w; }
}

fn store_tile(lid: u32, row0: u32, tok0: u32, acc: ptr<function, Acc>) {
    let r = row0 + 8u * (lid / 16u);
    let t0 = tok0 + 4u * (lid % 16u);
    store_token(t0, r, (*acc).t0a, (*acc).t0b);
    store_token(t0 + 1u, r, (*acc).t1a, (*acc).t1b);
    store_token(t0 + 2u, r, (*acc).t2a, (*acc).t2b);
    store_token(t0 + 3u, r, (*acc).t3a, (*acc).t3b);
}
