// MXFP4 products, as the store holds them (compressed-tensors mxfp4-pack-quantized): a [rows, cols]
// matrix is packed [rows, cols/2] bytes, element 2j in the LOW nibble of byte j, and scales
// [rows, cols/32] E8M0 bytes, one per block of 32 elements along a row. Read here as words: one
// block's 16 bytes are one vec4<u32>, and nibble i of word w (bits 4i..4i+3) is element 8w + i of
// the block. The E2M1 values and E8M0 scales are decoded here, in the shader.
//
// matvec: out[r] = sum_c W[r, c] * x[c]            (one token; memory-bound)
// matmat: out[t, r] = sum_c W[r, c] * xs[t, c]     (a chunk of n tokens; compute-bound)
// Shapes: xs [n, cols] f32, out [n, rows] f32; cols a multiple of 32.

struct Dims {
    rows: u32,
    cols: u32,
    n: u32,
    // Workgroups along x of a dispatch that spilled into y (more than 65,535 groups).
    groups_x: u32,
}

@group(0) @binding(0) var<storage, read> packed: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> scales: array<u32>;
@group(0) @binding(2) var<storage, read> xs: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<uniform> dims: Dims;

// E2M1 nibbles to f32: magnitude m = 2e + f (e exponent, f mantissa bit) is f*0.5 for e = 0 and
// 2^(e-1) * (1 + f/2) for e > 0, whose f32 bits are (m << 22) + (126 << 23); bit 3 is the sign.
fn e2m1(n: vec4<u32>) -> vec4<f32> {
    let m = n & vec4<u32>(7u);
    let normal = bitcast<vec4<f32>>((m << vec4<u32>(22u)) + vec4<u32>(126u << 23u));
    let v = select(normal, vec4<f32>(m) * 0.5, m < vec4<u32>(2u));
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(v) | ((n & vec4<u32>(8u)) << vec4<u32>(28u)));
}

// Block i's E8M0 scale, 2^(e-127): e = 0 is the subnormal 2^-127, e = 255 is NaN (the store
// refuses such scales on the way in).
fn scale_of(i: u32) -> f32 {
    let e = (scales[i >> 2u] >> ((i & 3u) * 8u)) & 0xffu;
    if e == 0u {
        return bitcast<f32>(0x00400000u);
    }
    if e == 255u {
        return bitcast<f32>(0x7fc00000u);
    }
    return bitcast<f32>(e << 23u);
}

// The eight elements of word w: nibbles 0-3 and 4-7.
fn lo(w: u32) -> vec4<f32> {
    return e2m1((vec4<u32>(w) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u));
}
fn hi(w: u32) -> vec4<f32> {
    return e2m1((vec4<u32>(w) >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(15u));
}

// ---- One token -----------------------------------------------------------------------------------

// A team of 32 invocations per row, 8 rows per workgroup: lane l takes blocks l, l + 32, ... of its
// row, so a team reads 512 contiguous bytes per step; the team's sums meet in workgroup memory.
const LANES: u32 = 32u;
const ROWS: u32 = 8u;
var<workgroup> partial: array<f32, 256>;

@compute @workgroup_size(256)
fn matvec(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row = (wid.x + wid.y * dims.groups_x) * ROWS + lid / LANES;
    let lane = lid % LANES;
    let nb = dims.cols / 32u;
    var acc = 0.0;
    if row < dims.rows {
        for (var b = lane; b < nb; b += LANES) {
            let blk = row * nb + b;
            let p = packed[blk];
            let x = b * 8u;
            let s = dot(lo(p.x), xs[x]) + dot(hi(p.x), xs[x + 1u])
                + dot(lo(p.y), xs[x + 2u]) + dot(hi(p.y), xs[x + 3u])
                + dot(lo(p.z), xs[x + 4u]) + dot(hi(p.z), xs[x + 5u])
                + dot(lo(p.w), xs[x + 6u]) + dot(hi(p.w), xs[x + 7u]);
            acc += s * scale_of(blk);
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

// Tiles of 64 rows x 32 tokens, one MXFP4 block (32 columns) deep: the workgroup decodes the tile's
// 64 blocks once (scale applied: a power of two, so exact) into workgroup memory beside the 32
// tokens' 32 inputs, and each invocation accumulates 4 rows x 2 tokens.
const TR: u32 = 64u;
const TT: u32 = 32u;
var<workgroup> wt: array<f32, 2048>; // [32 columns][64 rows]
var<workgroup> xt: array<f32, 1024>; // [32 columns][32 tokens]

@compute @workgroup_size(256)
fn matmat(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = wid.x * TR;
    let tok0 = wid.y * TT;
    let nb = dims.cols / 32u;
    // Loading: invocation lid decodes word lid % 4 of row lid / 4, and reads input vec4 lid % 8 of
    // token lid / 8.
    let lr = lid / 4u;
    let wd = lid % 4u;
    let lt = lid / 8u;
    let q = lid % 8u;
    // Computing: rows 4 * (lid / 16) .. +3, tokens 2 * (lid % 16) and the next.
    let ty = lid / 16u;
    let tx = lid % 16u;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    for (var b = 0u; b < nb; b++) {
        var wlo = vec4<f32>(0.0);
        var whi = vec4<f32>(0.0);
        let r = row0 + lr;
        if r < dims.rows {
            let blk = r * nb + b;
            let word = packed[blk][wd];
            let s = scale_of(blk);
            wlo = lo(word) * s;
            whi = hi(word) * s;
        }
        let k = 8u * wd;
        wt[(k + 0u) * TR + lr] = wlo.x;
        wt[(k + 1u) * TR + lr] = wlo.y;
        wt[(k + 2u) * TR + lr] = wlo.z;
        wt[(k + 3u) * TR + lr] = wlo.w;
        wt[(k + 4u) * TR + lr] = whi.x;
        wt[(k + 5u) * TR + lr] = whi.y;
        wt[(k + 6u) * TR + lr] = whi.z;
        wt[(k + 7u) * TR + lr] = whi.w;
        var xv = vec4<f32>(0.0);
        let t = tok0 + lt;
        if t < dims.n {
            xv = xs[(t * dims.cols + b * 32u) / 4u + q];
        }
        xt[(4u * q + 0u) * TT + lt] = xv.x;
        xt[(4u * q + 1u) * TT + lt] = xv.y;
        xt[(4u * q + 2u) * TT + lt] = xv.z;
        xt[(4u * q + 3u) * TT + lt] = xv.w;
        workgroupBarrier();
        for (var c = 0u; c < 32u; c++) {
            let w = vec4<f32>(wt[c * TR + 4u * ty], wt[c * TR + 4u * ty + 1u], wt[c * TR + 4u * ty + 2u], wt[c * TR + 4u * ty + 3u]);
            a0 += w * xt[c * TT + 2u * tx];
            a1 += w * xt[c * TT + 2u * tx + 1u];
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
