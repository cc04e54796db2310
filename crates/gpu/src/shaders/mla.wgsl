// Absorbed-MLA attention of a prompt chunk (K3's NoPE MLA): every head of every token of the
// chunk over the shared latent cache, causally, with an online softmax. The CPU twin is
// `deltafin_kernels::attention::mla_attend_chunk` (same inputs; its output is token-major).
//
// A workgroup takes 16 heads of one token (they see the same positions: 0 ..= first + token);
// 16 invocations share each query: invocation `part` holds the query's vec4s part, part + 16,
// .. (9 of them: width <= 576) and the output's vec4s part, part + 16, .. (8: kvl <= 512), all in
// registers as named variables (an array indexed by a variable would go to local memory). The
// cache goes by in blocks of 8 positions, put into workgroup memory as f32 once for all 16
// queries; each invocation adds its part of the 8 scores, 128 invocations sum the 16 parts, and
// each invocation then updates its query's running maximum and sum (the same values in all 16,
// so no further barrier) and its share of the output.
//
// The binding of the cache (1) and `cache_quad`, which reads one position's 4 channels as f32,
// come from the source put before this (`attention.rs`: f32 rows or bf16 bits).

struct Dims {
    heads: u32,
    // tokens of the chunk
    s: u32,
    // positions cached before the chunk
    first: u32,
    // values per cached row (latent then rope) and of the latent alone
    width: u32,
    kvl: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read> q: array<vec4<f32>>; // [heads, s, width] absorbed, pre-scaled
@group(0) @binding(2) var<storage, read_write> out: array<vec4<f32>>; // [heads, s, kvl]
@group(0) @binding(3) var<uniform> dims: Dims;

const G: u32 = 16u; // queries (heads of one token) per workgroup
const PARTS: u32 = 16u; // invocations per query
const P: u32 = 8u; // cached positions per block
const ROW: u32 = 144u; // vec4s of a block row in workgroup memory (the widest row: 576 values)
const NEG: f32 = -3.0e38; // below every score (WGSL may assume no infinities)

var<workgroup> kb: array<vec4<f32>, 1152>; // [P, ROW] the block's rows, zeros past width
var<workgroup> partial: array<f32, 2048>; // [G, P, PARTS] each part's share of each score
var<workgroup> scores: array<f32, 128>; // [G, P]

// Vec4 k of query row `base` (in vec4s), zero past the row.
fn q_quad(base: u32, k: u32, w4: u32, live: bool) -> vec4<f32> {
    if live && k < w4 {
        return q[base + k];
    }
    return vec4<f32>(0.0);
}

// Invocation `part`'s share of the score of block row `p`.
fn score_part(p: u32, part: u32, q0: vec4<f32>, q1: vec4<f32>, q2: vec4<f32>, q3: vec4<f32>, q4: vec4<f32>,
              q5: vec4<f32>, q6: vec4<f32>, q7: vec4<f32>, q8: vec4<f32>) -> f32 {
    let b = p * ROW + part;
    var s = dot(q0, kb[b]);
    s += dot(q1, kb[b + 16u]);
    s += dot(q2, kb[b + 32u]);
    s += dot(q3, kb[b + 48u]);
    s += dot(q4, kb[b + 64u]);
    s += dot(q5, kb[b + 80u]);
    s += dot(q6, kb[b + 96u]);
    s += dot(q7, kb[b + 112u]);
    s += dot(q8, kb[b + 128u]);
    return s;
}

@compute @workgroup_size(256)
fn attend(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let w4 = dims.width / 4u;
    let o4 = dims.kvl / 4u;
    let token = wg.y;
    let lq = lid / PARTS;
    let part = lid % PARTS;
    let head = wg.x * G + lq;
    let live = head < dims.heads;
    let len = dims.first + token + 1u; // positions this token sees
    let qb = (head * dims.s + token) * w4;
    let q0 = q_quad(qb, part, w4, live);
    let q1 = q_quad(qb, part + 16u, w4, live);
    let q2 = q_quad(qb, part + 32u, w4, live);
    let q3 = q_quad(qb, part + 48u, w4, live);
    let q4 = q_quad(qb, part + 64u, w4, live);
    let q5 = q_quad(qb, part + 80u, w4, live);
    let q6 = q_quad(qb, part + 96u, w4, live);
    let q7 = q_quad(qb, part + 112u, w4, live);
    let q8 = q_quad(qb, part + 128u, w4, live);
    var o0 = vec4<f32>(0.0);
    var o1 = vec4<f32>(0.0);
    var o2 = vec4<f32>(0.0);
    var o3 = vec4<f32>(0.0);
    var o4v = vec4<f32>(0.0);
    var o5 = vec4<f32>(0.0);
    var o6 = vec4<f32>(0.0);
    var o7 = vec4<f32>(0.0);
    var m = NEG;
    var l = 0.0;
    for (var j0 = 0u; j0 < len; j0 += P) {
        // The block's rows as f32, zeros past the row and past the positions this token sees.
        for (var i = lid; i < P * ROW; i += 256u) {
            let p = i / ROW;
            let k = i % ROW;
            var v = vec4<f32>(0.0);
            if k < w4 && j0 + p < len {
                v = cache_quad(j0 + p, k);
            }
            kb[i] = v;
        }
        workgroupBarrier();
        for (var p = 0u; p < P; p++) {
            partial[(lq * P + p) * PARTS + part] = score_part(p, part, q0, q1, q2, q3, q4, q5, q6, q7, q8);
        }
        workgroupBarrier();
        if lid < G * P {
            var s = 0.0;
            for (var j = 0u; j < PARTS; j++) {
                s += partial[lid * PARTS + j];
            }
            scores[lid] = select(NEG, s, j0 + lid % P < len);
        }
        workgroupBarrier();
        var mb = m;
        for (var p = 0u; p < P; p++) {
            mb = max(mb, scores[lq * P + p]);
        }
        let alpha = exp(m - mb);
        l *= alpha;
        o0 *= alpha;
        o1 *= alpha;
        o2 *= alpha;
        o3 *= alpha;
        o4v *= alpha;
        o5 *= alpha;
        o6 *= alpha;
        o7 *= alpha;
        for (var p = 0u; p < P; p++) {
            let e = select(0.0, exp(scores[lq * P + p] - mb), j0 + p < len);
            l += e;
            let b = p * ROW + part;
            o0 += e * kb[b];
            o1 += e * kb[b + 16u];
            o2 += e * kb[b + 32u];
            o3 += e * kb[b + 48u];
            o4v += e * kb[b + 64u];
            o5 += e * kb[b + 80u];
            o6 += e * kb[b + 96u];
            o7 += e * kb[b + 112u];
        }
        m = mb;
        workgroupBarrier();
    }
    if !live {
        return;
    }
    let inv = 1.0 / l;
    let ob = (head * dims.s + token) * o4;
    if part < o4 { out[ob + part] = o0 * inv; }
    if part + 16u < o4 { out[ob + part + 16u] = o1 * inv; }
    if part + 32u < o4 { out[ob + part + 32u] = o2 * inv; }
    if part + 48u < o4 { out[ob + part + 48u] = o3 * inv; }
    if part + 64u < o4 { out[ob + part + 64u] = o4v * inv; }
    if part + 80u < o4 { out[ob + part + 80u] = o5 * inv; }
    if part + 96u < o4 { out[ob + part + 96u] = o6 * inv; }
    if part + 112u < o4 { out[ob + part + 112u] = o7 * inv; }
}
