// Dense spine products, bf16 or f32 weights (`dims.format`: 0 f32, 1 bf16), row-major [rows, cols],
// cols a multiple of 32. Read as vec4<u32> (8 bf16 values) or vec4<f32> (4 values); bf16 widens
// exactly (its bits are the top half of an f32's). The scale binding is unused.
//
// matvec: out[r] = sum_c W[r, c] * x[c]            (one token; memory-bound)
// matmat: out[t, r] = sum_c W[r, c] * xs[t, c]     (a chunk of n tokens; compute-bound)
// Twins: deltafin_kernels::scalar::{bf16_matvec, f32_matvec}.

struct Dims {
    rows: u32,
    cols: u32,
    n: u32,
    groups_x: u32,
    format: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> unused: array<u32>;
@group(0) @binding(2) var<storage, read> xs: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<uniform> dims: Dims;

// bf16 pairs of a word: element 2j is the low half of word j.
fn bf16x2(v: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(v << 16u), bitcast<f32>(v & 0xffff0000u));
}

// Four values of row r from column c (a multiple of 4), widened.
fn four(r: u32, c: u32) -> vec4<f32> {
    if dims.format == 1u {
        let p = w[(r * dims.cols + c) / 8u];
        let h = (c / 4u) % 2u;
        let a = select(p.x, p.z, h == 1u);
        let b = select(p.y, p.w, h == 1u);
        return vec4<f32>(bf16x2(a), bf16x2(b));
    }
    return bitcast<vec4<f32>>(w[(r * dims.cols + c) / 4u]);
}

// ---- One token -----------------------------------------------------------------------------------

// As the quantised products': a team of 32 invocations serves 4 rows, lane l taking 8-column
// chunks l, l + 32, ... (a team reads 512 contiguous bytes of bf16 per row per step, 1 KiB of f32).
@compute @workgroup_size(256)
fn matvec(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = (wid.x + wid.y * dims.groups_x) * ROWS + (lid / LANES) * TEAM_ROWS;
    let chunks = dims.cols / 8u;
    let rows = team_rows(row0);
    var acc = vec4<f32>(0.0);
    for (var c = lid % LANES; c < chunks; c += LANES) {
        let x0 = xs[2u * c];
        let x1 = xs[2u * c + 1u];
        for (var i = 0u; i < TEAM_ROWS; i++) {
            acc[i] += dot(four(rows[i], 8u * c), x0) + dot(four(rows[i], 8u * c + 4u), x1);
        }
    }
    team_sum_store(lid, row0, acc);
}

// ---- A chunk of tokens ---------------------------------------------------------------------------

// Row r's 4 values from column c, zeros past the matrix.
fn four_in(r: u32, c: u32) -> vec4<f32> {
    if r >= dims.rows {
        return vec4<f32>(0.0);
    }
    return four(r, c);
}

@compute @workgroup_size(256)
fn matmat(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = wid.x * TR;
    let tok0 = wid.y * TT;
    let r = row0 + 4u * (lid / 8u);
    let kq = lid % 8u;
    var acc: Acc;
    for (var b = 0u; b < dims.cols / 32u; b++) {
        let c = 32u * b + 4u * kq;
        put_weights(lid, four_in(r, c), four_in(r + 1u, c), four_in(r + 2u, c), four_in(r + 3u, c));
        put_inputs(lid, tok0, b);
        workgroupBarrier();
        multiply_tile(lid, &acc);
        workgroupBarrier();
    }
    store_tile(lid, row0, tok0, &acc);
}
