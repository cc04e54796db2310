//! A loaded model ready to run: spine in memory, experts streamed under the memory plan. One
//! place that turns run options into a plan, a model and an expert source, for every command
//! that runs the model.

use std::sync::Arc;

use anyhow::Result;
use deltafin_store::Store;
use deltafin_store::presence::ExpertFetcher;
use serde::Serialize;

use crate::blocks::mla::LatentDtype;
use crate::k3::{K3Model, PromptBorrowing, RunConfig};
use crate::plan::{Budget, Plan, PlanRequest, default_budget, make_plan};
use crate::stream::activity::{DiskActivity, Watched};
use crate::stream::cache::Policy;
use crate::stream::reader::BackendKind;
use crate::stream::streaming::{LayerStats, StreamOptions, StreamingExperts};

pub use crate::gpu_plan::DEFAULT_GPU_MEMORY;
use crate::gpu_plan::{GpuSplit, gpu_memory_for, host_budget};

#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Bytes; `None` = 85% of what this process may use (MemAvailable, or the headroom under
    /// its cgroup's memory limit when that is smaller; see [`default_budget`]).
    pub memory_budget: Option<u64>,
    /// Context length the plan reserves MLA cache for.
    pub context_tokens: usize,
    pub backend: Option<BackendKind>,
    pub queue_depth: usize,
    pub policy: Policy,
    pub prefetch: bool,
    pub direct: bool,
    /// Override of the model's routed experts per token.
    pub experts_per_token: Option<usize>,
    /// Keep only this many leading spine layers resident (default: as many as the budget holds).
    pub resident_spine_layers: Option<usize>,
    /// Approximate mode (int8 activations for routed experts and prompt chunks' int8 spine
    /// products): [`numerics`].
    pub approx: bool,
    /// Predict each next MoE layer's experts even without prefetch (for router traces).
    pub predict: bool,
    /// Sequence states the plan reserves: the live one, plus one for a server's prefix snapshot
    /// and one for the state store's buffer (`--state-dir`).
    pub state_copies: usize,
    /// Prompt tokens per chunk (`--prefill-chunk`); `None` sizes chunks from the budget.
    pub prefill_chunk: Option<usize>,
    /// How the MLA latent cache stores its values; `None`: f32 for an f32 spine (the exactness
    /// studies' configuration, as the reference keeps an f32 model's cache), else bf16.
    pub latent_cache: Option<LatentDtype>,
    /// Fills a streaming store's absent experts on first use; `None` = offline (an absent
    /// expert is an error that says how to fetch it).
    pub fetcher: Option<Arc<dyn ExpertFetcher>>,
    /// Keep every read of the run (experts and streamed spine) for a replay of exactly those
    /// reads ([`Session::take_read_log`]).
    pub log_reads: bool,
    /// Counts the resident spine layers as they load (a server's `/health` while it loads).
    pub load_progress: Option<Arc<crate::k3::LoadProgress>>,
    /// Compute the routed experts on a GPU chosen by these options (`--device gpu`); `None`:
    /// on the CPU. No usable adapter is an error at start, never a fall-back, unless
    /// `gpu_auto`.
    pub gpu: Option<deltafin_gpu::GpuOptions>,
    /// `--device auto`: the GPU of `gpu` when one opens (and `--approx` is off), else the CPU;
    /// the choice and its reason are [`Session::device_choice`].
    pub gpu_auto: bool,
    /// With `gpu`: bytes of GPU memory for the spine's matrices (used by prompt chunks) and,
    /// in what they leave, cached routed experts (`None`: [`DEFAULT_GPU_MEMORY`]; 0 keeps the
    /// spine on the CPU and caches no expert there).
    pub gpu_memory: Option<u64>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            memory_budget: None,
            context_tokens: 4096,
            backend: None,
            queue_depth: 32,
            policy: Policy::Slru,
            prefetch: false,
            direct: true,
            experts_per_token: None,
            resident_spine_layers: None,
            approx: false,
            predict: false,
            state_copies: 1,
            prefill_chunk: None,
            latent_cache: None,
            fetcher: None,
            log_reads: false,
            load_progress: None,
            gpu: None,
            gpu_auto: false,
            gpu_memory: None,
        }
    }
}

pub struct Session {
    pub model: K3Model,
    pub experts: StreamingExperts,
    pub plan: Plan,
    /// The model's own top-k, to label runs that override it.
    pub default_top_k: usize,
    /// What both read back-ends report to (idle time; the read log when asked for).
    activity: Arc<DiskActivity>,
    /// `--device auto`'s choice and its reason.
    device_choice: Option<String>,
    /// What the GPU's memory takes from the host's budget, where they share it.
    gpu_note: Option<String>,
    /// With a GPU: what its memory holds and what crosses the bus.
    gpu_split: Option<GpuSplit>,
}

/// How a run read its experts, for reports.
#[derive(Debug, Clone, Serialize)]
pub struct StreamReport {
    pub io_backend: BackendKind,
    pub o_direct: bool,
    pub cache_policy: Policy,
    pub prefetch: bool,
    pub accesses: u64,
    /// Served without a demand read: cache hits, landed and adopted prefetches or read-ahead.
    pub hits: u64,
    /// The cache's own hits (`LayerStats::cache_hits`) over accesses.
    pub hit_rate: f64,
    pub cache_hits: u64,
    /// Demand accesses served by a prefetch or read-ahead (landed, or adopted in flight).
    pub prefetch_used: u64,
    /// Of those, the ones adopted while still in flight.
    pub adopted: u64,
    pub demand_reads: u64,
    pub prefetch_reads: u64,
    /// Of the prefetch reads, those large prompt chunks read ahead into free cache room.
    pub read_ahead: u64,
    pub prefetch_precision: Option<f64>,
    pub prefetch_recall: Option<f64>,
    pub expert_bytes_read: u64,
    pub io_wait_s: f64,
    /// Seconds spent verifying expert records as they land (assembly and xxh3, on the I/O
    /// thread, beside the engine's compute).
    pub verify_s: f64,
    pub bytes_verified: u64,
    pub per_layer: Vec<(usize, LayerStats)>,
}

impl Session {
    /// The memory plan this run would use, without loading anything: a `--context` beyond the
    /// model or a budget that cannot hold it is an error here, before minutes of loading.
    pub fn plan(store: &Store, opts: &RunOptions) -> Result<Plan> {
        Self::check_context(store, opts)?;
        let (budget, req) = plan_request(store, opts);
        make_plan(&store.manifest, &budget, &req)
    }

    fn check_context(store: &Store, opts: &RunOptions) -> Result<()> {
        let max = store.manifest.config.max_position_embeddings;
        anyhow::ensure!(
            opts.context_tokens <= max,
            "--context {} is beyond the model's {max} positions (its max_position_embeddings)",
            opts.context_tokens
        );
        Ok(())
    }

    /// The most sequences a continuous batch may carry with these options (at most `cap`;
    /// `plan::batch_size`), and one sequence's state in bytes. `opts.state_copies` counts one
    /// live state besides the others the run keeps.
    pub fn batch_size(store: &Store, opts: &RunOptions, cap: usize) -> (usize, u64) {
        let (budget, req) = plan_request(store, opts);
        crate::plan::batch_size(&store.manifest, &budget, &req, cap)
    }

    pub fn open(store: &Store, opts: &RunOptions) -> Result<Self> {
        let default_top_k = store.manifest.config.num_experts_per_token;
        let k = opts.experts_per_token.unwrap_or(default_top_k);
        // Demand reads for one layer, plus as many for the next layer's prefetch.
        let prefetch_buffers = if opts.prefetch { k } else { 0 };
        let io_buffers = k + prefetch_buffers;
        // Both read back-ends (experts, streamed spine) report to one activity: the disk's
        // idle time.
        let activity = Arc::new(if opts.log_reads { DiskActivity::logging() } else { DiskActivity::default() });
        let latent_cache = opts.latent_cache.unwrap_or(LatentDtype::auto(store.manifest.spine.matrix_dtype));
        let (gpu, device_choice) = Self::open_adapter(opts)?;
        let (mut budget, req) = plan_request(store, opts);
        Self::check_context(store, opts)?;
        // On memory the GPU shares with the host, its share comes out of the host's budget.
        let gpu_memory = gpu.as_ref().map(|g| gpu_memory_for(opts.gpu_memory, budget.bytes, g.shares_host_memory()));
        let mut gpu_note = None;
        if let (Some(g), Some(share)) = (&gpu, gpu_memory)
            && g.shares_host_memory()
        {
            budget = host_budget(budget, share)?;
            gpu_note = Some(format!(
                "the GPU shares the host's memory ({}): its {} (--gpu-memory) come out of the memory budget, which leaves the host {}",
                g.adapter().device_type,
                crate::units::human(share),
                crate::units::human(budget.bytes)
            ));
        }
        let plan = make_plan(&store.manifest, &budget, &req)?;
        // The whole spine's matrices, resident on the host or streamed: a prompt chunk uses all.
        let gpu_split =
            gpu_memory.map(|total| GpuSplit::new(total, plan.spine_bytes + plan.spine_bytes_per_token, &plan));
        let (gpu_experts, gpu_spine) = match (gpu, &gpu_split) {
            (Some(g), Some(split)) => Self::gpu_runners(store, g, split)?,
            _ => (None, None),
        };
        let model = K3Model::load(
            store,
            &RunConfig {
                resident_layers: Some(plan.spine_resident_layers),
                experts_per_token: opts.experts_per_token,
                prefetch: opts.prefetch,
                predict: opts.predict,
                context_reserve: opts.context_tokens,
                latent_cache: Some(latent_cache),
                approx: opts.approx,
                gpu_experts,
                gpu_spine,
                io_backend: opts.backend,
                prefill_chunk: plan.prefill_chunk,
                prompt_borrowing: (plan.prefill_chunk_lent > plan.prefill_chunk).then_some(PromptBorrowing {
                    max_chunk: plan.prefill_chunk_lent,
                    token_bytes: plan.prefill_token_bytes,
                }),
                disk_activity: Some(activity.clone()),
                load_progress: opts.load_progress.clone(),
            },
        )?;
        let watch = activity.clone();
        let expert_paths = store.experts.paths().to_vec();
        let mut experts = StreamingExperts::with_backend(
            store,
            StreamOptions {
                cache_slots_per_layer: plan.cache_slots_per_layer,
                policy: opts.policy,
                backend: opts.backend,
                direct: opts.direct,
                queue_depth: opts.queue_depth,
                io_buffers,
                prefetch_buffers,
            },
            move |b| Watched::wrap(b, watch.clone(), &expert_paths),
        )?;
        experts.set_fetcher(opts.fetcher.clone());
        Ok(Session { model, experts, plan, default_top_k, activity, device_choice, gpu_note, gpu_split })
    }

    /// The adapter of `--device gpu` (one that will not open is an error) or `--device auto`
    /// (the CPU then, with the reason), and what `auto` chose.
    fn open_adapter(opts: &RunOptions) -> Result<(Option<deltafin_gpu::Gpu>, Option<String>)> {
        let Some(g) = &opts.gpu else { return Ok((None, None)) };
        if opts.approx {
            anyhow::ensure!(
                opts.gpu_auto,
                "--approx runs on the CPU's integer kernels: it does not combine with --device gpu"
            );
            return Ok((None, Some("device auto: the CPU (--approx runs on the CPU's integer kernels)".into())));
        }
        let gpu = match deltafin_gpu::Gpu::open(g) {
            Ok(gpu) => gpu,
            Err(e) if opts.gpu_auto => return Ok((None, Some(format!("device auto: the CPU ({e})")))),
            Err(e) => return Err(e.into()),
        };
        let choice = opts.gpu_auto.then(|| {
            format!(
                "device auto: the GPU, {} (its arithmetic takes prompt chunks' spine, MLA attention and KDA recurrence, and the routed experts)",
                gpu.adapter()
            )
        });
        Ok((Some(gpu), choice))
    }

    /// The GPU's runners with `total` bytes of its memory: the spine's matrices first (what
    /// prompt chunks use every time), then as many routed experts as the rest holds.
    #[allow(clippy::type_complexity)]
    fn gpu_runners(
        store: &Store,
        gpu: deltafin_gpu::Gpu,
        split: &GpuSplit,
    ) -> Result<(Option<Arc<deltafin_gpu::expert::ExpertRunner>>, Option<Arc<deltafin_gpu::spine::SpineRunner>>)> {
        let c = &store.manifest.config;
        let situ = deltafin_gpu::expert::Situ { beta: c.situ_beta(), linear_beta: c.activation_situ_linear_beta };
        let spine = (split.spine_kept > 0)
            .then(|| Arc::new(deltafin_gpu::spine::SpineRunner::new(gpu.clone(), split.spine_kept as usize)));
        let cached_experts = split.experts_cached;
        let experts =
            deltafin_gpu::expert::ExpertRunner::new(gpu, c.moe_intermediate_size, c.expert_input_dim(), situ)?
                .with_cache(cached_experts);
        Ok((Some(Arc::new(experts)), spine))
    }

    /// On memory the GPU shares with the host: how much of the budget its copies take (said at
    /// start).
    pub fn gpu_note(&self) -> Option<&str> {
        self.gpu_note.as_deref()
    }

    /// With a GPU: what its memory holds and what crosses the bus (said at start).
    pub fn gpu_split(&self) -> Option<&GpuSplit> {
        self.gpu_split.as_ref().filter(|_| self.model.run().gpu_experts.is_some())
    }

    /// With `--device auto`: what it chose and why (said at start).
    pub fn device_choice(&self) -> Option<&str> {
        self.device_choice.as_deref()
    }

    /// Every read of the run so far, in submission order, taken (empty unless
    /// [`RunOptions::log_reads`]).
    pub fn take_read_log(&self) -> Vec<crate::stream::activity::LoggedRead> {
        self.activity.take_log()
    }

    /// Whether this run uses a different number of experts than the model was trained with.
    pub fn modified_top_k(&self) -> bool {
        self.model.config.num_experts_per_token != self.default_top_k
    }

    /// A label for outputs: the model, and the top-k override if any.
    pub fn variant(&self) -> String {
        if self.modified_top_k() {
            format!(
                "kimi_k3 with {} of {} routed experts per token (model default {}): a different model",
                self.model.config.num_experts_per_token, self.model.config.num_experts, self.default_top_k
            )
        } else {
            "kimi_k3".into()
        }
    }

    /// How this run computes, for every output.
    pub fn numerics(&self) -> &'static str {
        numerics(self.model.run().approx)
    }

    /// Where the routed experts compute: "cpu", or "gpu" (with [`Self::adapter`]).
    pub fn device(&self) -> &'static str {
        if self.model.run().gpu_experts.is_some() { "gpu" } else { "cpu" }
    }

    /// The GPU adapter the routed experts run on, for outputs (`None` on the CPU).
    pub fn adapter(&self) -> Option<String> {
        self.model.run().gpu_experts.as_ref().map(|g| g.gpu().adapter().to_string())
    }

    /// With `--device gpu`: the bytes of spine matrices on the GPU now, and the most it may keep.
    pub fn gpu_spine_bytes(&self) -> Option<(usize, usize)> {
        self.model.run().gpu_spine.as_ref().map(|g| (g.used(), g.budget()))
    }

    /// With `--device gpu`: tokens of prompt chunks whose MLA attention ran on the GPU so far,
    /// summed over MLA layers.
    pub fn gpu_mla_tokens(&self) -> Option<u64> {
        self.model.run().gpu_spine.as_ref().map(|g| g.mla_tokens())
    }

    /// With `--device gpu`: bytes of spine matrices past the GPU's share sent for single
    /// products of prompt chunks so far.
    pub fn gpu_streamed_bytes(&self) -> Option<u64> {
        self.model.run().gpu_spine.as_ref().map(|g| g.streamed_bytes())
    }

    /// With `--device gpu`: tokens of prompt chunks whose KDA recurrence ran on the GPU so far,
    /// summed over KDA layers.
    pub fn gpu_kda_tokens(&self) -> Option<u64> {
        self.model.run().gpu_spine.as_ref().map(|g| g.kda_tokens())
    }

    /// With `--device gpu`: the GPU's expert cache, (capacity in experts, held, hits, misses).
    pub fn gpu_expert_cache(&self) -> Option<(usize, usize, u64, u64)> {
        self.model.run().gpu_experts.as_ref().map(|g| g.cache_stats())
    }

    /// What a prompt state on disk must match beyond the store: the numerics and the latent
    /// cache's dtype (a bf16 cache's states are not an f32 cache's).
    pub fn state_numerics(&self) -> String {
        // Experts on the GPU sum in another order than the CPU's, and so do prompt chunks'
        // spine products there: their states are their own.
        let device = match (self.device(), self.model.run().gpu_spine.is_some()) {
            ("gpu", true) => "|experts on gpu|spine chunks on gpu",
            ("gpu", false) => "|experts on gpu",
            _ => "",
        };
        format!("{}|latent {}{device}", self.numerics(), self.model.latent_cache().name())
    }

    pub fn report(&self) -> StreamReport {
        let t = self.experts.total_stats();
        let mut per_layer: Vec<(usize, LayerStats)> = self.experts.stats.iter().map(|(l, s)| (*l, s.clone())).collect();
        per_layer.sort_by_key(|(l, _)| *l);
        let demand_misses_or_covered = t.demand_reads + t.prefetch_used;
        StreamReport {
            io_backend: self.experts.backend_kind,
            o_direct: self.experts.o_direct,
            cache_policy: self.experts_policy(),
            prefetch: self.model.run().prefetch,
            accesses: t.accesses,
            hits: t.hits,
            hit_rate: if t.accesses == 0 { 0.0 } else { t.cache_hits as f64 / t.accesses as f64 },
            cache_hits: t.cache_hits,
            prefetch_used: t.prefetch_used,
            adopted: t.adopted,
            demand_reads: t.demand_reads,
            prefetch_reads: t.prefetch_reads,
            read_ahead: t.read_ahead,
            prefetch_precision: (t.prefetch_reads > 0).then(|| t.prefetch_used as f64 / t.prefetch_reads as f64),
            prefetch_recall: (demand_misses_or_covered > 0 && self.model.run().prefetch)
                .then(|| t.prefetch_used as f64 / demand_misses_or_covered as f64),
            expert_bytes_read: t.bytes_read,
            io_wait_s: self.experts.io_wait.as_secs_f64(),
            verify_s: self.experts.verify_time.as_secs_f64(),
            bytes_verified: self.experts.bytes_verified,
            per_layer,
        }
    }

    fn experts_policy(&self) -> Policy {
        self.experts.policy()
    }
}

/// The budget and what the plan is asked to fit, from the command line's options.
fn plan_request(store: &Store, opts: &RunOptions) -> (Budget, PlanRequest) {
    let k = opts.experts_per_token.unwrap_or(store.manifest.config.num_experts_per_token);
    // Demand reads for one layer, plus as many for the next layer's prefetch.
    let io_buffers = k + if opts.prefetch { k } else { 0 };
    let budget = opts.memory_budget.map(Budget::given).unwrap_or_else(default_budget);
    let latent_cache = opts.latent_cache.unwrap_or(LatentDtype::auto(store.manifest.spine.matrix_dtype));
    let req = PlanRequest {
        latent_cache,
        context: opts.context_tokens,
        experts_per_token: k,
        io_buffers,
        resident_layers: opts.resident_spine_layers,
        state_copies: opts.state_copies,
        prefill_chunk: opts.prefill_chunk,
    };
    (budget, req)
}

/// How a run computes, as every output says it: with `approx`, the routed experts' activations
/// in int8 and, where the CPU has the integer kernels (AVX-512 VNNI), a prompt chunk's int8
/// spine products in integers with int8 activations.
pub fn numerics(approx: bool) -> &'static str {
    if !approx {
        "exact"
    } else if deltafin_kernels::approx::has_integer_spine() {
        "approximate (int8 activations for routed experts and prompt chunks' int8 spine products)"
    } else {
        "approximate (int8 activations for routed experts)"
    }
}
