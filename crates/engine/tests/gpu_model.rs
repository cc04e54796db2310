//! The model with its routed experts and a prompt chunk's spine products on the GPU (Mesa's
//! llvmpipe in CI): a step that fails part-way through a layer's experts leaves the GPU's
//! runners clean, and the next request computes what it would have computed alone.

mod common;

use std::sync::Arc;

use common::*;
use deltafin_engine::experts::{ExpertSource, StoreExperts};
use deltafin_engine::generate::generate_greedy;
use deltafin_engine::k3::{K3Model, RunConfig};
use deltafin_gpu::expert::{ExpertRunner, Situ};
use deltafin_gpu::spine::SpineRunner;
use deltafin_gpu::{Gpu, GpuOptions};
use deltafin_store::{ExpertLayout, SpineDtype, Store};

fn gpu(test: &str) -> Option<Gpu> {
    let opts = GpuOptions { allow_software: true, name: std::env::var("DELTAFIN_GPU_ADAPTER").ok() };
    match Gpu::open(&opts) {
        Ok(g) => Some(g),
        Err(e) if std::env::var("DELTAFIN_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("{test}: DELTAFIN_REQUIRE_GPU=1 but no GPU adapter opened: {e}")
        }
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}

/// A source whose `fail_at`-th drain hands over one record and then fails (a read fault in the
/// middle of a layer, with an expert already on the GPU).
struct FailMidDrain<'a> {
    inner: StoreExperts<'a>,
    drains: usize,
    fail_at: usize,
}

impl ExpertSource for FailMidDrain<'_> {
    fn begin(&mut self, layer: usize, experts: &[usize]) -> anyhow::Result<()> {
        self.inner.begin(layer, experts)
    }
    fn drain(&mut self, f: &mut dyn FnMut(usize, &[u8]) -> anyhow::Result<()>) -> anyhow::Result<()> {
        self.drains += 1;
        if self.drains != self.fail_at {
            return self.inner.drain(f);
        }
        let mut handed = 0;
        let r = self.inner.drain(&mut |u, rec| {
            anyhow::ensure!(handed == 0, "injected read fault");
            handed += 1;
            f(u, rec)
        });
        anyhow::ensure!(r.is_err(), "the fixture's layer has more than one expert to fail between");
        r
    }
    fn bytes_read(&self) -> u64 {
        self.inner.bytes_read()
    }
    fn reset(&mut self) {
        self.inner.reset()
    }
}

#[test]
fn a_layer_that_fails_on_the_gpu_leaves_the_next_request_its_own_results() {
    let Some(g) = gpu("a_layer_that_fails_on_the_gpu_leaves_the_next_request_its_own_results") else { return };
    let name = "k3-small";
    let dir = convert_fixture(name, SpineDtype::F32, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let c = &store.manifest.config;
    let situ = Situ { beta: c.situ_beta(), linear_beta: c.activation_situ_linear_beta };
    let experts = ExpertRunner::new(g.clone(), c.moe_intermediate_size, c.expert_input_dim(), situ).unwrap();
    let spine = Arc::new(SpineRunner::new(g, 1 << 30));
    let run = RunConfig { gpu_experts: Some(Arc::new(experts)), gpu_spine: Some(spine.clone()), ..Default::default() };
    let model = K3Model::load(&store, &run).unwrap();
    // 40 tokens: a chunk whose spine products go to the GPU too.
    let prompt = reference(name).prompts[3].tokens.clone();
    assert!(prompt.len() >= SpineRunner::MIN_TOKENS);
    let clean = generate_greedy(&model, &mut StoreExperts::new(&store), &prompt, 4, None).unwrap();
    assert!(spine.used() > 0, "the prompt's spine products ran on the GPU");
    for fail_at in [1, 5] {
        let mut src = FailMidDrain { inner: StoreExperts::new(&store), drains: 0, fail_at };
        let e = generate_greedy(&model, &mut src, &prompt, 4, None).unwrap_err();
        assert!(format!("{e:#}").contains("injected read fault"), "{e:#}");
        src.reset();
        let again = generate_greedy(&model, &mut src, &prompt, 4, None).unwrap();
        assert_eq!(again.tokens, clean.tokens, "after a failure at drain {fail_at}");
        assert_eq!(again.prompt_logits, clean.prompt_logits, "after a failure at drain {fail_at}: logits");
    }
}

/// A prompt chunk's MLA attention (64 tokens a call) and KDA recurrence on the GPU: every
/// layer's tokens went there, the logits are the CPU's to f32 rounding, and the chunk's buffers stay within what
/// the memory plan reserves (per token, plus MLA's working set once).
#[test]
fn a_chunk_attends_on_the_gpu_within_the_plan() {
    let Some(g) = gpu("a_chunk_attends_on_the_gpu_within_the_plan") else { return };
    let name = "k3-small";
    let dir = convert_fixture(name, SpineDtype::F32, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let spine = Arc::new(SpineRunner::new(g, 1 << 30));
    let gpu_model = K3Model::load(&store, &RunConfig { gpu_spine: Some(spine.clone()), ..Default::default() }).unwrap();
    let cpu_model = K3Model::load(&store, &RunConfig::default()).unwrap();
    let c = &store.manifest.config;
    let mla_layers = (0..c.num_hidden_layers).filter(|&l| c.attn_kind(l) == deltafin_store::AttnKind::Mla).count();
    assert!(mla_layers > 0);
    let k = c.num_experts_per_token;
    let per_token = deltafin_engine::plan::prefill_token_bytes(&store.manifest, k) as usize;
    let working = deltafin_engine::plan::mla_working_bytes(&store.manifest) as usize;
    let held = |st: &deltafin_engine::k3::K3State| {
        st.scratch.pooled_bytes() + st.blocks.iter().map(|b| b.bytes()).sum::<usize>()
    };
    let vocab = c.vocab_size as u32;
    let mut logits = vec![0f32; c.vocab_size];
    let mut one = gpu_model.new_state();
    gpu_model.forward_chunk(&mut one, &mut StoreExperts::new(&store), &[7], &mut logits).unwrap();
    let base = held(&one);
    assert_eq!(spine.mla_tokens() + spine.kda_tokens(), 0, "one token attends on the CPU");
    // 1,100 tokens: MLA's calls of 64 (the last of 12), KDA's blocks of 1,024 (the second of 76).
    let t_n = 1100;
    let tokens: Vec<u32> = (0..t_n as u32).map(|i| (i * 37 + 11) % vocab).collect();
    let mut st = gpu_model.new_state();
    gpu_model.forward_chunk(&mut st, &mut StoreExperts::new(&store), &tokens, &mut logits).unwrap();
    assert_eq!(spine.mla_tokens(), (mla_layers * t_n) as u64, "every MLA layer's tokens on the GPU");
    let kda_layers = c.num_hidden_layers - mla_layers;
    assert_eq!(spine.kda_tokens(), (kda_layers * t_n) as u64, "every KDA layer's recurrence on the GPU");
    let took = held(&st);
    assert!(
        took <= base + per_token * t_n + working,
        "a chunk of {t_n} holds {took} bytes, the plan {}",
        base + per_token * t_n + working
    );
    let mut want = vec![0f32; c.vocab_size];
    let mut cst = cpu_model.new_state();
    cpu_model.forward_chunk(&mut cst, &mut StoreExperts::new(&store), &tokens, &mut want).unwrap();
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = logits.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(d <= 1e-4 * scale, "GPU vs CPU logits: max difference {d} (scale {scale})");
}
