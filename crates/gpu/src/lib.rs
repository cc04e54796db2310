//! Deltafin's GPU backend (issue 28), on `wgpu`: Vulkan on Linux and Windows, Metal on macOS,
//! DirectX 12 on Windows, with the kernels written once in WGSL (`src/shaders`).
//!
//! What is here so far: opening an adapter ([`Gpu::open`], which says why when none will do),
//! matrices and vectors in GPU memory, the MXFP4 expert products for one token and for a chunk
//! of tokens, with the E2M1 values and E8M0 scales decoded in the shader ([`mxfp4`]), the int8
//! spine products likewise ([`int8`]) and the bf16 and f32 ones ([`dense`]), a routed expert with
//! SiTU between its products ([`expert`]), RMSNorm and softmax over rows ([`ops`]), and the GPU's own roofs, read bandwidth and FMA rate ([`roofline`]), which
//! `deltafin bench --kernels --device gpu` judges the products against. Every shader is tested
//! against its CPU scalar twin (`deltafin_kernels::scalar`), in CI on Mesa's software Vulkan
//! driver (llvmpipe). Absorbed-MLA attention of a prompt chunk is in [`attention`]; [`spine`]
//! runs a prompt chunk's spine products and attention for the model.
//!
//! Layers: `device` (adapter and device) <- `buffers` <- `product` (what the products share)
//! <- `mxfp4`, `int8`, `dense` <- `expert`; `ops`, `attention` and `roofline` beside them;
//! `spine` over `int8`, `dense` and `attention`.

pub mod attention;
mod buffers;
pub mod dense;
mod device;
pub mod expert;
pub mod int8;
pub mod kda;
pub mod mxfp4;
pub mod ops;
mod product;
pub mod roofline;
pub mod spine;

pub use buffers::{DenseValues, GpuDense, GpuInt8, GpuMxfp4, GpuVec};
pub use device::{AdapterSummary, Gpu, GpuOptions};
pub use product::BoundProduct;

/// What can go wrong on the GPU side, each with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("{}", no_adapter_message(seen, *software_allowed, name.as_deref()))]
    NoAdapter { seen: Vec<AdapterSummary>, software_allowed: bool, name: Option<String> },
    #[error("the GPU adapter {adapter} refused a device: {why}")]
    Device { adapter: String, why: String },
    #[error("{what} needs {bytes} bytes in one GPU buffer; this adapter allows {limit}")]
    TooLarge { what: &'static str, bytes: u64, limit: u64 },
    #[error("bad shapes for {what}: {why}")]
    Shape { what: &'static str, why: String },
    #[error("the GPU device was lost or stopped answering: {0}")]
    Lost(String),
    #[error("the GPU refused the work: {0}")]
    Rejected(String),
}

fn no_adapter_message(seen: &[AdapterSummary], software_allowed: bool, name: Option<&str>) -> String {
    let mut m = String::from("no usable GPU adapter");
    if let Some(n) = name {
        m.push_str(&format!(" named like \"{n}\""));
    }
    if seen.is_empty() {
        m.push_str(": none found (on Linux this needs a Vulkan driver and its loader, libvulkan1; on Windows DirectX 12 or Vulkan; on macOS Metal)");
    } else {
        let list: Vec<String> = seen.iter().map(|a| a.to_string()).collect();
        m.push_str(&format!(": found {}", list.join("; ")));
        if !software_allowed && seen.iter().any(|a| a.device_type == "Cpu") {
            m.push_str(" (a CPU-type adapter computes on the CPU's own cores and is taken only when named)");
        }
    }
    m
}
