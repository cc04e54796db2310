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

// The step's inputs (columns 32 b .. +31) of tokens tok0 .. +63: invocation lid < 128 reads
// 4 tokens (tq = lid / 8) x 4 columns (kq = lid % 8); tokens past n are zeros.
fn put_inputs(lid: u32, tok0: u32, b: u32) {
    if lid >= 128u {
        return;
    }
    let tq = lid / 8u;
    let kq = lid % 8u;
    var v: array<vec4<f32>, 4>;
    for (var j = 0u; j < 4u; j++) {
        let t = tok0 + 4u * tq + j;
        v[j] = vec4<f32>(0.0);
        if t < dims.n {
            v[j] = xs[(t * dims.cols) / 4u + 8u * b + kq];
        }
    }
    let k = 4u * kq;
    for (var i = 0u; i < 4u; i++) {
        xt[(k + i) * 16u + tq] = vec4<f32>(v[0][i], v[1][i], v[2][i], v[3][i]);
    }
}

fn multiply_tile(lid: u32, acc: ptr<function, array<vec4<f32>, 8>>) {
    let ty = lid / 16u;
    let tx = lid % 16u;
    for (var k = 0u; k < 32u; k++) {
        let wa = wt[k * 32u + 2u * ty];
        let wb = wt[k * 32u + 2u * ty + 1u];
        let x = xt[k * 16u + tx];
        (*acc)[0] += wa * x.x;
        (*acc)[1] += wb * x.x;
        (*acc)[2] += wa * x.y;
        (*acc)[3] += wb * x.y;
        (*acc)[4] += wa * x.z;
        (*acc)[5] += wb * x.z;
        (*acc)[6] += wa * x.w;
        (*acc)[7] += wb * x.w;
    }
}

fn store_tile(lid: u32, row0: u32, tok0: u32, acc: ptr<function, array<vec4<f32>, 8>>) {
    let r = row0 + 8u * (lid / 16u);
    let t0 = tok0 + 4u * (lid % 16u);
    for (var j = 0u; j < 4u; j++) {
        let t = t0 + j;
        if t >= dims.n {
            break;
        }
        let a = (*acc)[2u * j];
        let b = (*acc)[2u * j + 1u];
        for (var i = 0u; i < 4u; i++) {
            if r + i < dims.rows {
                out[t * dims.rows + r + i] = a[i];
            }
            if r + 4u + i < dims.rows {
                out[t * dims.rows + r + 4u + i] = b[i];
            }
        }
    }
}
