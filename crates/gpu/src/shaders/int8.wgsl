// int8 spine products: a [rows, cols] matrix is q [rows, cols] int8 (row-major) with one f32
// scale per `group` consecutive elements of a row (scales [rows, cols/group]; group == cols is
// per-row scaling). Read here as vec4<u32> chunks of 16 values; cols is a multiple of 32 (a step of
// the chunk kernel) and group of 16, so a chunk lies inside one group.
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

// As MXFP4's: a team of 32 invocations serves 4 rows, 8 teams (32 rows) per workgroup; lane l
// takes chunks l, l + 32, ..., loads each chunk's 16 inputs once and applies them to the chunk in
// each of its 4 rows (a team reads 512 contiguous bytes of each row per step).
@compute @workgroup_size(256)
fn matvec(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = (wid.x + wid.y * dims.groups_x) * ROWS + (lid / LANES) * TEAM_ROWS;
    let chunks = dims.cols / 16u;
    let rows = team_rows(row0);
    var acc = vec4<f32>(0.0);
    for (var c = lid % LANES; c < chunks; c += LANES) {
        let x = 4u * c;
        let x0 = xs[x];
        let x1 = xs[x + 1u];
        let x2 = xs[x + 2u];
        let x3 = xs[x + 3u];
        for (var i = 0u; i < TEAM_ROWS; i++) {
            let p = q[rows[i] * chunks + c];
            let s = dot(i8x4(p.x), x0) + dot(i8x4(p.y), x1) + dot(i8x4(p.z), x2) + dot(i8x4(p.w), x3);
            acc[i] += s * scale_of(rows[i], c);
        }
    }
    team_sum_store(lid, row0, acc);
}

// ---- A chunk of tokens ---------------------------------------------------------------------------

// The shared tiles (tiles.wgsl), 32 columns (two chunks of 16) per step: invocation lid widens
// columns 4 (lid % 8) .. +3 of the step (one word) in 4 rows, scale applied.
fn word_of(r: u32, b: u32, kq: u32, chunks: u32) -> vec4<f32> {
    if r >= dims.rows {
        return vec4<f32>(0.0);
    }
    let c = 2u * b + kq / 4u;
    return i8x4(q[r * chunks + c][kq % 4u]) * scale_of(r, c);
}

@compute @workgroup_size(256)
fn matmat(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = wid.x * TR;
    let tok0 = wid.y * TT;
    let chunks = dims.cols / 16u;
    let r = row0 + 4u * (lid / 8u);
    let kq = lid % 8u;
    var acc: Acc;
    for (var b = 0u; b < dims.cols / 32u; b++) {
        put_weights(lid, word_of(r, b, kq, chunks), word_of(r + 1u, b, kq, chunks), word_of(r + 2u, b, kq, chunks), word_of(r + 3u, b, kq, chunks));
        put_inputs(lid, tok0, b);
        workgroupBarrier();
        multiply_tile(lid, &acc);
        workgroupBarrier();
    }
    store_tile(lid, row0, tok0, &acc);
}
