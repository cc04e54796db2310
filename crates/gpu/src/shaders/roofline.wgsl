// The GPU's two roofs, measured in the same run as the kernels they judge: the rate at which it
// reads its own memory, and its f32 FMA rate.

struct Params {
    // read: vec4 words in the source; fma: iterations per invocation.
    count: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> sink: array<u32>;
@group(0) @binding(2) var<uniform> params: Params;

// Every word of the source, each once, XOR-folded (the cheapest work that reads every byte);
// the fold is written so that no compiler can drop the reads.
@compute @workgroup_size(256)
fn read_all(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let stride = groups.x * 256u;
    var acc = vec4<u32>(0u);
    for (var i = gid.x; i < params.count; i += stride) {
        acc ^= src[i];
    }
    sink[gid.x] = acc.x ^ acc.y ^ acc.z ^ acc.w;
}

// Eight independent chains of vec4 FMAs per invocation (enough to hide the FMA latency):
// 8 x 4 x 2 FLOP per iteration. The multiplier and addend come from the invocation id, so no
// compiler can fold the chains.
@compute @workgroup_size(256)
fn fma_peak(@builtin(global_invocation_id) gid: vec3<u32>) {
    let m = vec4<f32>(0.999999) + vec4<f32>(f32(gid.x & 7u) * 1e-9);
    let c = vec4<f32>(1e-7) * f32((gid.x >> 3u) & 7u);
    var a0 = vec4<f32>(f32(gid.x) * 1e-6);
    var a1 = a0 + vec4<f32>(1.0);
    var a2 = a0 + vec4<f32>(2.0);
    var a3 = a0 + vec4<f32>(3.0);
    var a4 = a0 + vec4<f32>(4.0);
    var a5 = a0 + vec4<f32>(5.0);
    var a6 = a0 + vec4<f32>(6.0);
    var a7 = a0 + vec4<f32>(7.0);
    for (var i = 0u; i < params.count; i++) {
        a0 = fma(a0, m, c);
        a1 = fma(a1, m, c);
        a2 = fma(a2, m, c);
        a3 = fma(a3, m, c);
        a4 = fma(a4, m, c);
        a5 = fma(a5, m, c);
        a6 = fma(a6, m, c);
        a7 = fma(a7, m, c);
    }
    let s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
    sink[gid.x] = bitcast<u32>(s.x + s.y + s.z + s.w);
}
