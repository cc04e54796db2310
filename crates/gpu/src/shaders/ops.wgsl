// Row-wise operations over [n, dim] f32, one workgroup per row (rows past 65,535 spill into y).
//
// rms_norm: out = x / sqrt(mean(x^2) + eps) * weight   (twin: scalar::rms_norm)
// softmax:  out = exp(x - max) / sum                   (twin: scalar::softmax_inplace)

struct Params {
    dim: u32,
    rows: u32,
    groups_x: u32,
    eps: f32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> weight: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;

var<workgroup> red: array<f32, 256>;

// Sum (max when `take_max`) of every invocation's `v` over the workgroup, the same value to all.
fn reduce(lid: u32, v: f32, take_max: bool) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var off = 128u; off > 0u; off >>= 1u) {
        if lid < off {
            red[lid] = select(red[lid] + red[lid + off], max(red[lid], red[lid + off]), take_max);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(256)
fn rms_norm(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row = wid.x + wid.y * params.groups_x;
    if row >= params.rows {
        return;
    }
    let base = row * params.dim;
    var ss = 0.0;
    for (var i = lid; i < params.dim; i += 256u) {
        ss += x[base + i] * x[base + i];
    }
    let inv = inverseSqrt(reduce(lid, ss, false) / f32(params.dim) + params.eps);
    for (var i = lid; i < params.dim; i += 256u) {
        out[base + i] = x[base + i] * inv * weight[i];
    }
}

@compute @workgroup_size(256)
fn softmax(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row = wid.x + wid.y * params.groups_x;
    if row >= params.rows {
        return;
    }
    let base = row * params.dim;
    var m = -3.4028235e38;
    for (var i = lid; i < params.dim; i += 256u) {
        m = max(m, x[base + i]);
    }
    m = reduce(lid, m, true);
    var sum = 0.0;
    for (var i = lid; i < params.dim; i += 256u) {
        sum += exp(x[base + i] - m);
    }
    let inv = 1.0 / reduce(lid, sum, false);
    for (var i = lid; i < params.dim; i += 256u) {
        out[base + i] = exp(x[base + i] - m) * inv;
    }
}
