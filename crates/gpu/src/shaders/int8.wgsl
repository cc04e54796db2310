// int8 spine products: a [rows, cols] matrix is q [rows, cols] int8 (row-major) with one f32
// scale per `group` consecutive elements of a row (scales [rows, cols/group]; group == cols is
// per-row scaling). Read here as vec4<u32> chunks of 16 values; cols and group are multiples of
// 16, so a chunk lies inside one group.
//
// matvec: out[r] = sum_c W[r, c] * x[c]            (one token; memory-bound)
// matmat: out[t, r] = sum_c W[r, c] * xs[t, c]     (a chunk of n tokens; compute-bound)
// Shapes: xs [n, cols] f32, out [n, rows] f32.

struct Dims {
    rows: u32,
    cols: u32,
    n: u32,
    // Workgroups along x of a dispatch that spilled into y (more than 65,535 groups).
    groups_x: u32,
    group: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<storage, read> q: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> scales: array<f32>;
@group(0) @binding(2) var<storage, read> xs: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<uniform> dims: Dims;

// The four int8 values of a word (byte 0 first), sign-extended by an arithmetic shift.
fn i8x4(w: u32) -> vec4<f32> {
    return vec4<f32>((vec4<i32>(bitcast<i32>(w)) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
}

// The scale of row r's chunk c (16 values from column 16c).
fn scale_of(r: u32, c: u32) -> f32 {
    return scales[r * (dims.cols / dims.group) + 16u * c / dims.group];
}

// ---- One token -----------------------------------------------------------------------------------

// As MXFP4's: a team of 32 invocations per row, 8 rows per workgroup, lane l taking chunks
// l, l + 32, ... (a team reads 512 contiguous bytes per step).
const LANES: u32 = 32u;
const ROWS: u32 = 8u;
var<workgroup> partial: array<f32, 256>;

@compute @workgroup_size(256)
fn matvec(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row = (wid.x + wid.y * dims.groups_x) * ROWS + lid / LANES;
    let lane = lid % LANES;
    let chunks = dims.cols / 16u;
    var acc = 0.0;
    if row < dims.rows {
        for (var c = lane; c < chunks; c += LANES) {
            let p = q[row * chunks + c];
            let x = 4u * c;
            let s = dot(i8x4(p.x), xs[x]) + dot(i8x4(p.y), xs[x + 1u]) + dot(i8x4(p.z), xs[x + 2u]) + dot(i8x4(p.w), xs[x + 3u]);
            acc += s * scale_of(row, c);
        }
    }
    partial[lid] = acc;
    workgroupBarrier();
    for (var off = LANES / 2u; off > 0u; off >>= 1u) {
        if lane < off {
            partial[lid] += partial[lid + off];
        }
        workgroupBarrier();
    }
    if lane == 0u && row < dims.rows {
        out[row] = partial[lid];
    }
}

// ---- A chunk of tokens ---------------------------------------------------------------------------

// Tiles of 64 rows x 32 tokens, 16 columns deep: the tile's weights are widened and scaled once
// per step into workgroup memory beside the 32 tokens' 16 inputs; each invocation accumulates
// 4 rows x 2 tokens.
const TR: u32 = 64u;
const TT: u32 = 32u;
var<workgroup> wt: array<f32, 1024>; // [16 columns][64 rows]
var<workgroup> xt: array<f32, 512>; // [16 columns][32 tokens]

@compute @workgroup_size(256)
fn matmat(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = wid.x * TR;
    let tok0 = wid.y * TT;
    let chunks = dims.cols / 16u;
    // Loading: invocation lid widens word lid % 4 of row lid / 4's chunk; invocations below 128
    // read input vec4 lid % 4 of token lid / 4.
    let lr = lid / 4u;
    let wd = lid % 4u;
    // Computing: rows 4 * (lid / 16) .. +3, tokens 2 * (lid % 16) and the next.
    let ty = lid / 16u;
    let tx = lid % 16u;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    for (var c = 0u; c < chunks; c++) {
        var w = vec4<f32>(0.0);
        let r = row0 + lr;
        if r < dims.rows {
            w = i8x4(q[r * chunks + c][wd]) * scale_of(r, c);
        }
        wt[(4u * wd + 0u) * TR + lr] = w.x;
        wt[(4u * wd + 1u) * TR + lr] = w.y;
        wt[(4u * wd + 2u) * TR + lr] = w.z;
        wt[(4u * wd + 3u) * TR + lr] = w.w;
        if lid < 128u {
            var xv = vec4<f32>(0.0);
            let t = tok0 + lr;
            if t < dims.n {
                xv = xs[(t * dims.cols) / 4u + 4u * c + wd];
            }
            xt[(4u * wd + 0u) * TT + lr] = xv.x;
            xt[(4u * wd + 1u) * TT + lr] = xv.y;
            xt[(4u * wd + 2u) * TT + lr] = xv.z;
            xt[(4u * wd + 3u) * TT + lr] = xv.w;
        }
        workgroupBarrier();
        for (var k = 0u; k < 16u; k++) {
            let wv = vec4<f32>(wt[k * TR + 4u * ty], wt[k * TR + 4u * ty + 1u], wt[k * TR + 4u * ty + 2u], wt[k * TR + 4u * ty + 3u]);
            a0 += wv * xt[k * TT + 2u * tx];
            a1 += wv * xt[k * TT + 2u * tx + 1u];
        }
        workgroupBarrier();
    }
    let r = row0 + 4u * ty;
    let t0 = tok0 + 2u * tx;
    for (var i = 0u; i < 4u; i++) {
        if r + i < dims.rows {
            if t0 < dims.n {
                out[t0 * dims.rows + r + i] = a0[i];
            }
            if t0 + 1u < dims.n {
                out[(t0 + 1u) * dims.rows + r + i] = a1[i];
            }
        }
    }
}
