// SiTU, Kimi K3's gated activation, element-wise over [n, inter]:
// out = beta * tanh(g / beta) * sigmoid(g) * (lbeta * tanh(u / lbeta), or u when unbounded).
// Twin: deltafin_kernels::scalar::situ.

struct Params {
    len: u32,
    // 1 when the up projection is bounded by `linear_beta`.
    bounded: u32,
    beta: f32,
    linear_beta: f32,
}

@group(0) @binding(0) var<storage, read> gate: array<f32>;
@group(0) @binding(1) var<storage, read> up: array<f32>;
@group(0) @binding(2) var<storage, read_write> act: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;

@compute @workgroup_size(256)
fn situ(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * 256u;
    if i >= params.len {
        return;
    }
    let g = gate[i];
    let u = up[i];
    let a = params.beta * tanh(g / params.beta) * (1.0 / (1.0 + exp(-g)));
    var x = u;
    if params.bounded != 0u {
        x = params.linear_beta * tanh(u / params.linear_beta);
    }
    act[i] = a * x;
}
