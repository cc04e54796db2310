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

// A team of 32 invocations serves 4 rows, 8 teams (32 rows) per workgroup: lane l takes blocks
// l, l + 32, ... and, for each, loads the block's 32 inputs once and applies them to the block in
// each of its 4 rows (a team reads 512 contiguous bytes of each row per step). With one row per
// team, every 16 bytes of weights cost 128 bytes of input loads, and the H100 ran the product at
// 0.16 of its read roof (bench-results/gpu/h100-e8872cd).
//
// Decoding the E2M1 values with `e2m1`'s arithmetic costs about a dozen instructions per weight,
// more than the GPU's lanes issue at its memory rate (a byte holds two weights). Here each pair of
// nibbles i and i + 4 of a word becomes two half floats at once: the nibble's magnitude bits go to
// bits 9-11 of its half (exponent bits 10-11, mantissa bit 9) and its sign to bit 15, which is
// the E2M1 value times 2^-14 exactly (e = 0 lands on the half subnormals 0 and 2^-15), widened
// by `unpack2x16float`; the block's sum is scaled back by 2^14 (exact: a power of two). On an
// H100 (bench-results/gpu/h100-df2a91d) the product ran at 0.39-0.41 of the read roof this way,
// 0.32 with a 16-entry table in workgroup memory and 0.25 with `e2m1`.

fn half_pair(t: u32) -> vec2<f32> {
    return unpack2x16float(((t & 0x00070007u) << 9u) | ((t & 0x00080008u) << 12u));
}

// Word w's eight elements (nibble i is element i) against inputs a (elements 0-3), b (4-7),
// times 2^-14.
fn word_dot(w: u32, a: vec4<f32>, b: vec4<f32>) -> f32 {
    let p0 = half_pair(w);
    let p1 = half_pair(w >> 4u);
    let p2 = half_pair(w >> 8u);
    let p3 = half_pair(w >> 12u);
    return dot(vec4<f32>(p0.x, p1.x, p2.x, p3.x), a) + dot(vec4<f32>(p0.y, p1.y, p2.y, p3.y), b);
}

fn block_dot(p: vec4<u32>, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>, x4: vec4<f32>, x5: vec4<f32>, x6: vec4<f32>, x7: vec4<f32>) -> f32 {
    return (word_dot(p.x, x0, x1) + word_dot(p.y, x2, x3) + word_dot(p.z, x4, x5) + word_dot(p.w, x6, x7)) * 16384.0;
}

@compute @workgroup_size(256)
fn matvec(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = (wid.x + wid.y * dims.groups_x) * ROWS + (lid / LANES) * TEAM_ROWS;
    let nb = dims.cols / 32u;
    let rows = team_rows(row0);
    var acc = vec4<f32>(0.0);
    for (var b = lid % LANES; b < nb; b += LANES) {
        let x = b * 8u;
        let x0 = xs[x];
        let x1 = xs[x + 1u];
        let x2 = xs[x + 2u];
        let x3 = xs[x + 3u];
        let x4 = xs[x + 4u];
        let x5 = xs[x + 5u];
        let x6 = xs[x + 6u];
        let x7 = xs[x + 7u];
        // The team's 4 rows written out, not looped: no vector indexed by a variable.
        let k = vec4<u32>(rows * nb + b);
        acc.x += block_dot(packed[k.x], x0, x1, x2, x3, x4, x5, x6, x7) * scale_of(k.x);
        acc.y += block_dot(packed[k.y], x0, x1, x2, x3, x4, x5, x6, x7) * scale_of(k.y);
        acc.z += block_dot(packed[k.z], x0, x1, x2, x3, x4, x5, x6, x7) * scale_of(k.z);
        acc.w += block_dot(packed[k.w], x0, x1, x2, x3, x4, x5, x6, x7) * scale_of(k.w);
    }
    team_sum_store(lid, row0, acc);
}

// ---- A chunk of tokens ---------------------------------------------------------------------------

// The shared tiles (tiles.wgsl), one MXFP4 block deep per step: invocation lid decodes columns
// 4 (lid % 8) .. +3 of the block (half of one word: nibbles 0-3 or 4-7) in 4 rows, scale
// applied (a power of two, so exact).
fn block_quarter(r: u32, b: u32, kq: u32, nb: u32) -> vec4<f32> {
    if r >= dims.rows {
        return vec4<f32>(0.0);
    }
    let blk = r * nb + b;
    let w = packed[blk][kq / 2u];
    return select(hi(w), lo(w), kq % 2u == 0u) * scale_of(blk);
}

@compute @workgroup_size(256)
fn matmat(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = wid.x * TR;
    let tok0 = wid.y * TT;
    let nb = dims.cols / 32u;
    let r = row0 + 4u * (lid / 8u);
    let kq = lid % 8u;
    var acc: Acc;
    for (var b = 0u; b < nb; b++) {
        put_weights(lid, block_quarter(r, b, kq, nb), block_quarter(r + 1u, b, kq, nb), block_quarter(r + 2u, b, kq, nb), block_quarter(r + 3u, b, kq, nb));
        put_inputs(lid, tok0, b);
        workgroupBarrier();
        multiply_tile(lid, &acc);
        workgroupBarrier();
    }
    store_tile(lid, row0, tok0, &acc);
}
