//! Continuous batching: several sequences in one step (`K3Model::forward_batch`), joining and
//! leaving between steps, a joining sequence's prompt chunks riding beside the others' decode
//! tokens. Per sequence the logits after every step are those of the same sequence alone, bit
//! for bit, for every spine dtype, with the spine resident or streamed, through plain and
//! streamed expert reads; and a step reads each distinct expert once for all its sequences.

mod common;

use common::*;
use deltafin_engine::experts::{ExpertSource, StoreExperts};
use deltafin_engine::generate::argmax;
use deltafin_engine::k3::{BatchBuffers, K3Model, K3State, RunConfig, SeqStep};
use deltafin_engine::stream::cache::Policy;
use deltafin_engine::stream::streaming::{StreamOptions, StreamingExperts};
use deltafin_store::{ExpertLayout, SpineDtype, Store};

/// One sequence of a schedule: it joins at step `join`, feeds its prompt in chunks of `chunk`,
/// then decodes `decode` greedy tokens and leaves.
struct Seq {
    prompt: Vec<u32>,
    join: usize,
    chunk: usize,
    decode: usize,
}

/// A sequence while the schedule runs: what it has fed, and its logits after every step.
struct Live {
    state: deltafin_engine::k3::K3State,
    fed: usize,
    decoded: usize,
    next: u32,
    logits: Vec<f32>,
    history: Vec<Vec<f32>>,
}

/// What a sequence feeds next: its next prompt chunk, its last greedy token, or nothing (done).
fn step_tokens(s: &Seq, l: &Live) -> Option<Vec<u32>> {
    if l.fed < s.prompt.len() {
        Some(s.prompt[l.fed..(l.fed + s.chunk).min(s.prompt.len())].to_vec())
    } else if l.decoded < s.decode {
        Some(vec![l.next])
    } else {
        None
    }
}

fn advance(s: &Seq, l: &mut Live, fed: usize) {
    if l.fed < s.prompt.len() {
        l.fed += fed;
    } else {
        l.decoded += 1;
    }
    l.history.push(l.logits.clone());
    l.next = argmax(&l.logits);
}

/// Run `seqs` together as a continuous batch; every sequence's logits after each of its steps,
/// and the largest batch that ran.
fn run_batched(model: &K3Model, src: &mut dyn ExpertSource, seqs: &[Seq]) -> (Vec<Vec<Vec<f32>>>, usize) {
    let v = model.config.vocab_size;
    let mut live: Vec<Option<Live>> = seqs.iter().map(|_| None).collect();
    let mut done = vec![false; seqs.len()];
    let mut bufs = BatchBuffers::default();
    let (mut step, mut widest) = (0, 0);
    let mut out: Vec<Vec<Vec<f32>>> = seqs.iter().map(|_| Vec::new()).collect();
    while done.iter().any(|d| !d) {
        for (i, s) in seqs.iter().enumerate() {
            if s.join == step && live[i].is_none() && !done[i] {
                live[i] = Some(Live {
                    state: model.new_state(),
                    fed: 0,
                    decoded: 0,
                    next: 0,
                    logits: vec![0f32; v],
                    history: Vec::new(),
                });
            }
        }
        let feeds: Vec<(usize, Vec<u32>)> = live
            .iter()
            .enumerate()
            .filter_map(|(i, l)| l.as_ref().and_then(|l| step_tokens(&seqs[i], l)).map(|t| (i, t)))
            .collect();
        if !feeds.is_empty() {
            let mut taken: Vec<(usize, Live)> = feeds.iter().map(|(i, _)| (*i, live[*i].take().unwrap())).collect();
            let mut steps: Vec<SeqStep<'_>> = taken
                .iter_mut()
                .zip(&feeds)
                .map(|((_, l), (_, t))| SeqStep { state: &mut l.state, tokens: t, logits: &mut l.logits })
                .collect();
            widest = widest.max(steps.len());
            model.forward_batch(&mut steps, src, &mut bufs).unwrap();
            drop(steps);
            for ((i, mut l), (_, t)) in taken.into_iter().zip(&feeds) {
                advance(&seqs[i], &mut l, t.len());
                live[i] = Some(l);
            }
        }
        // Who has fed everything leaves between steps.
        for (i, s) in seqs.iter().enumerate() {
            if let Some(l) = &live[i]
                && step_tokens(s, l).is_none()
            {
                out[i] = live[i].take().unwrap().history;
                done[i] = true;
            }
        }
        step += 1;
        assert!(step < 1000, "the schedule does not end");
    }
    (out, widest)
}

/// The same sequence alone, with the same chunks: its logits after each step.
fn run_alone(model: &K3Model, src: &mut dyn ExpertSource, s: &Seq) -> Vec<Vec<f32>> {
    let v = model.config.vocab_size;
    let mut l =
        Live { state: model.new_state(), fed: 0, decoded: 0, next: 0, logits: vec![0f32; v], history: Vec::new() };
    while let Some(t) = step_tokens(s, &l) {
        model.forward_chunk(&mut l.state, src, &t, &mut l.logits).unwrap();
        advance(s, &mut l, t.len());
    }
    l.history
}

/// Four sequences over the fixture's prompts: two start together (one prompt whole, one in
/// chunks of 3), a third joins while they decode (its chunks ride beside their tokens), a
/// fourth joins late with a one-token prompt; each leaves when it is done.
fn schedule(name: &str) -> Vec<Seq> {
    let prompts: Vec<Vec<u32>> = reference(name).prompts.into_iter().map(|p| p.tokens).collect();
    let p = |i: usize| prompts[i % prompts.len()].clone();
    vec![
        Seq { prompt: p(0), join: 0, chunk: 64, decode: 6 },
        Seq { prompt: p(1), join: 0, chunk: 3, decode: 4 },
        Seq { prompt: p(2), join: 2, chunk: 5, decode: 7 },
        Seq { prompt: vec![p(0)[0]], join: 5, chunk: 1, decode: 3 },
    ]
}

fn check(model: &K3Model, store: &Store, what: &str, name: &str, batched_src: &mut dyn ExpertSource) {
    let seqs = schedule(name);
    let (got, widest) = run_batched(model, batched_src, &seqs);
    assert!(widest >= 3, "{what}: the schedule must run three sequences at once (ran {widest})");
    for (i, s) in seqs.iter().enumerate() {
        let want = run_alone(model, &mut StoreExperts::new(store), s);
        assert_eq!(got[i].len(), want.len(), "{what}: sequence {i} ran {} steps, alone {}", got[i].len(), want.len());
        for (k, (a, b)) in got[i].iter().zip(&want).enumerate() {
            assert!(same(a, b), "{what}: sequence {i}'s logits after step {k} differ from the sequence alone");
        }
    }
}

#[test]
fn a_batched_step_gives_each_sequence_its_logits_alone() {
    for name in FIXTURES {
        for dtype in [SpineDtype::Int8, SpineDtype::Bf16, SpineDtype::F32] {
            let dir = convert_fixture(name, dtype, 0, ExpertLayout::Pack);
            let store = Store::open(dir.path(), None).unwrap();
            for resident in [None, Some(1)] {
                let model =
                    K3Model::load(&store, &RunConfig { resident_layers: resident, ..Default::default() }).unwrap();
                let what = format!("{name} {dtype:?} resident {resident:?}");
                check(&model, &store, &what, name, &mut StoreExperts::new(&store));
            }
        }
    }
}

/// Through the streaming source (a cache of one slot per layer, fewer I/O buffers than a
/// step's distinct experts), on every read back-end, and on a pool of three threads.
#[test]
fn a_batched_step_streams_bit_identically() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for name in FIXTURES {
        let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::InPlace);
        let store = Store::open(dir.path(), None).unwrap();
        let model = K3Model::load(&store, &RunConfig::default()).unwrap();
        for backend in backends() {
            let o = StreamOptions {
                cache_slots_per_layer: 1,
                policy: Policy::Slru,
                backend: Some(backend),
                direct: true,
                queue_depth: 8,
                io_buffers: 6,
                prefetch_buffers: 0,
            };
            let mut src = StreamingExperts::new(&store, o).unwrap();
            pool.install(|| check(&model, &store, &format!("{name} {backend:?}"), name, &mut src));
        }
    }
}

/// A step reads each distinct expert once for all its sequences: two sequences decoding
/// together read no more than the union of their experts, which is less than their reads alone
/// whenever they share one.
#[test]
fn a_batched_step_reads_the_union_of_its_sequences_experts_once() {
    let name = FIXTURES[1];
    let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig::default()).unwrap();
    let v = model.config.vocab_size;
    let record = store.manifest.experts.record_bytes;
    let prompts: Vec<Vec<u32>> = reference(name).prompts.into_iter().map(|p| p.tokens).collect();
    let (mut a, mut b) = (model.new_state(), model.new_state());
    let (mut la, mut lb) = (vec![0f32; v], vec![0f32; v]);
    let mut src = StoreExperts::new(&store);
    model.forward_chunk(&mut a, &mut src, &prompts[0], &mut la).unwrap();
    model.forward_chunk(&mut b, &mut src, &prompts[1], &mut lb).unwrap();
    let mut bufs = BatchBuffers::default();
    let (mut shared_steps, mut alone_bytes, mut batched_bytes) = (0, 0, 0);
    for _ in 0..8 {
        let (ta, tb) = ([argmax(&la)], [argmax(&lb)]);
        // What each would read alone: its own experts, from copies of the states.
        let mut solo = 0;
        for (st, t) in [(&a, ta[0]), (&b, tb[0])] {
            let mut copy = model.new_state();
            copy.copy_sequence_from(st);
            let mut s = StoreExperts::new(&store);
            model.forward(&mut copy, &mut s, t, &mut vec![0f32; v]).unwrap();
            solo += s.bytes_read();
        }
        let before = src.bytes_read();
        let mut steps = [
            SeqStep { state: &mut a, tokens: &ta, logits: &mut la },
            SeqStep { state: &mut b, tokens: &tb, logits: &mut lb },
        ];
        model.forward_batch(&mut steps, &mut src, &mut bufs).unwrap();
        let got = src.bytes_read() - before;
        // The union of the two sequences' picks, layer by layer.
        let union: u64 = (0..model.layers.len())
            .map(|l| {
                let mut e: Vec<usize> = a.routing[l].experts.iter().chain(&b.routing[l].experts).copied().collect();
                e.sort_unstable();
                e.dedup();
                e.len() as u64
            })
            .sum();
        assert_eq!(got, union * record, "a step reads each distinct expert of its sequences once");
        assert!(got <= solo);
        shared_steps += usize::from(got < solo);
        alone_bytes += solo;
        batched_bytes += got;
    }
    assert!(
        shared_steps > 0,
        "no step shared an expert: the check proves nothing ({batched_bytes} of {alone_bytes} bytes)"
    );
}

/// A step refuses what it cannot run, before it changes any state: an empty batch, a sequence
/// with no tokens, a token outside the vocabulary, a logits buffer of the wrong size, and a
/// state left part-way by an earlier failure; the other sequences' states are untouched.
#[test]
fn a_batched_step_refuses_bad_input_without_touching_any_state() {
    let name = FIXTURES[0];
    let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig::default()).unwrap();
    let v = model.config.vocab_size;
    let mut src = StoreExperts::new(&store);
    let mut bufs = BatchBuffers::default();
    assert!(model.forward_batch(&mut [], &mut src, &mut bufs).is_err());
    let (mut a, mut b) = (model.new_state(), model.new_state());
    let (mut la, mut lb) = (vec![0f32; v], vec![0f32; v]);
    let bad_token = [v as u32];
    let mut short = vec![0f32; v - 1];
    let cases: [(&[u32], bool); 3] = [(&[], false), (&bad_token, false), (&[1], true)];
    for (tokens, short_logits) in cases {
        let logits: &mut [f32] = if short_logits { &mut short } else { &mut lb };
        let mut steps =
            [SeqStep { state: &mut a, tokens: &[1, 2], logits: &mut la }, SeqStep { state: &mut b, tokens, logits }];
        assert!(model.forward_batch(&mut steps, &mut src, &mut bufs).is_err());
        assert_eq!((a.position, b.position), (0, 0));
        assert!(!a.is_part_way() && !b.is_part_way(), "a refused step leaves no state part-way");
    }
    // A sequence left part-way (a stopped chunk) is refused, and takes no other down with it.
    model.forward_chunk_with(&mut b, &mut src, &[1, 2], &mut lb, &mut |_| false).unwrap();
    assert!(b.is_part_way());
    let mut steps = [
        SeqStep { state: &mut a, tokens: &[3], logits: &mut la },
        SeqStep { state: &mut b, tokens: &[3], logits: &mut lb },
    ];
    assert!(model.forward_batch(&mut steps, &mut src, &mut bufs).is_err());
    assert!(!a.is_part_way() && a.position == 0);
    let mut alone = [SeqStep { state: &mut a, tokens: &[3], logits: &mut la }];
    model.forward_batch(&mut alone, &mut src, &mut bufs).unwrap();
    assert_eq!(a.position, 1);
}

/// The scheduler (`batch::Batcher`): sequences queue beyond `max_batch`, join as others leave,
/// a joining prompt goes through in chunks inside steps that also decode the running sequences,
/// a sequence taken out mid-way (a cancelled request) changes no other; each sequence's greedy
/// tokens are those of `generate_greedy` alone.
#[test]
fn the_batcher_gives_each_sequence_its_tokens_alone() {
    use deltafin_engine::batch::{Batcher, Next, SeqId};
    use deltafin_engine::generate::generate_greedy;
    use std::collections::HashMap;
    let name = FIXTURES[1];
    let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig { prefill_chunk: 4, ..Default::default() }).unwrap();
    let prompts: Vec<Vec<u32>> = reference(name).prompts.into_iter().map(|p| p.tokens).collect();
    let want_tokens = [5usize, 9, 3, 6, 4];
    let mut src = StoreExperts::new(&store);
    let mut b = Batcher::new(&model, 3);
    let mut ids: Vec<SeqId> = Vec::new();
    for i in 0..4 {
        ids.push(b.join(prompts[i % prompts.len()].clone()).unwrap());
    }
    assert_eq!(b.len(), (0, 4));
    let mut got: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut mixed_steps = 0;
    let mut step = 0;
    let cancelled = ids[2];
    while !b.is_empty() {
        if step == 3 {
            // A late arrival, and a cancellation.
            ids.push(b.join(prompts[4 % prompts.len()].clone()).unwrap());
            b.leave(cancelled);
        }
        let r = b
            .step(&mut src, &mut |id, _state, logits| {
                let i = ids.iter().position(|&x| x == id).unwrap();
                let toks = got.entry(id).or_default();
                toks.push(argmax(logits));
                if toks.len() >= want_tokens[i] { Next::Leave } else { Next::Token(*toks.last().unwrap()) }
            })
            .unwrap();
        assert!(r.sequences <= 3 && b.len().0 <= 3, "at most max_batch sequences run");
        assert!(r.prompt_tokens <= 4, "a step feeds at most the plan's prompt chunk");
        mixed_steps += usize::from(r.prompt_tokens > 0 && r.decode_tokens > 0);
        step += 1;
        assert!(step < 200);
    }
    assert!(mixed_steps > 0, "a joining prompt rode beside decode tokens");
    for (i, id) in ids.iter().enumerate() {
        if *id == cancelled {
            continue;
        }
        let alone =
            generate_greedy(&model, &mut StoreExperts::new(&store), &prompts[i % prompts.len()], want_tokens[i], None)
                .unwrap();
        assert_eq!(got[id], alone.tokens, "sequence {i}'s tokens in the batch differ from alone");
    }
}

/// An expert source that fails its `fail_at`-th `begin` (a read fault), then works.
struct FailOnce<'a> {
    inner: StoreExperts<'a>,
    begins: usize,
    fail_at: usize,
    resets: usize,
}

impl ExpertSource for FailOnce<'_> {
    fn begin(&mut self, layer: usize, experts: &[usize]) -> anyhow::Result<()> {
        self.begins += 1;
        anyhow::ensure!(self.begins != self.fail_at, "injected read fault");
        self.inner.begin(layer, experts)
    }
    fn drain(&mut self, f: &mut dyn FnMut(usize, &[u8]) -> anyhow::Result<()>) -> anyhow::Result<()> {
        self.inner.drain(f)
    }
    fn bytes_read(&self) -> u64 {
        self.inner.bytes_read()
    }
    fn reset(&mut self) {
        self.resets += 1;
        self.inner.reset()
    }
}

/// A failed step fails the sequences in it and no other: they leave the batch with the error,
/// the source is reset, a sequence still waiting for room runs on and gets its tokens alone.
#[test]
fn a_failed_step_fails_its_sequences_and_the_batch_goes_on() {
    use deltafin_engine::batch::{Batcher, Next};
    use deltafin_engine::generate::generate_greedy;
    let name = FIXTURES[0];
    let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig::default()).unwrap();
    let prompts: Vec<Vec<u32>> = reference(name).prompts.into_iter().map(|p| p.tokens).collect();
    let mut src = FailOnce { inner: StoreExperts::new(&store), begins: 0, fail_at: 1, resets: 0 };
    let mut b = Batcher::new(&model, 2);
    let (a, c) = (b.join(prompts[0].clone()).unwrap(), b.join(prompts[1].clone()).unwrap());
    let waiting = b.join(prompts[0].clone()).unwrap();
    let mut tokens = Vec::new();
    let mut pick = |id, _: &K3State, logits: &[f32]| {
        assert_eq!(id, waiting, "only the waiting sequence runs after the failure");
        tokens.push(argmax(logits));
        if tokens.len() == 4 { Next::Leave } else { Next::Token(*tokens.last().unwrap()) }
    };
    let e = b.step(&mut src, &mut pick).unwrap_err();
    assert_eq!(e.failed, vec![a, c]);
    assert_eq!(e.blamed, vec![a, c], "an error that names no expert record is everybody's");
    assert!(format!("{e}").contains("injected read fault"));
    assert_eq!(src.resets, 1, "the source is reset after a failed step");
    assert_eq!(b.len(), (0, 1), "the failed sequences left; the waiting one stays queued");
    while !b.is_empty() {
        b.step(&mut src, &mut pick).unwrap();
    }
    let alone = generate_greedy(&model, &mut StoreExperts::new(&store), &prompts[0], 4, None).unwrap();
    assert_eq!(tokens, alone.tokens);
}

/// Records the experts each `begin` asks for, by layer.
struct Record<'a> {
    inner: StoreExperts<'a>,
    begins: Vec<(usize, Vec<usize>)>,
}

impl ExpertSource for Record<'_> {
    fn begin(&mut self, layer: usize, experts: &[usize]) -> anyhow::Result<()> {
        self.begins.push((layer, experts.to_vec()));
        self.inner.begin(layer, experts)
    }
    fn drain(&mut self, f: &mut dyn FnMut(usize, &[u8]) -> anyhow::Result<()>) -> anyhow::Result<()> {
        self.inner.drain(f)
    }
    fn bytes_read(&self) -> u64 {
        self.inner.bytes_read()
    }
}

/// A source whose record of `expert` in `layer` fails its checksum once (a real [`ReadFault`],
/// as the store's reads report one after their retry), or with `fetch` cannot be fetched once
/// (a [`FetchFault`], as a streaming store offline reports one), then reads as usual.
struct CorruptOnce<'a> {
    inner: StoreExperts<'a>,
    target: (usize, usize),
    asked: Vec<usize>,
    layer: usize,
    armed: bool,
    fetch: bool,
}

impl ExpertSource for CorruptOnce<'_> {
    fn begin(&mut self, layer: usize, experts: &[usize]) -> anyhow::Result<()> {
        (self.layer, self.asked) = (layer, experts.to_vec());
        if self.armed && self.fetch && (layer, true) == (self.target.0, experts.contains(&self.target.1)) {
            self.armed = false;
            return Err(deltafin_engine::fault::FetchFault {
                layer,
                expert: self.target.1,
                count: 1,
                experts: vec![self.target.1],
                offline: true,
                detail: "injected by the test".into(),
            }
            .into());
        }
        self.inner.begin(layer, experts)
    }
    fn drain(&mut self, f: &mut dyn FnMut(usize, &[u8]) -> anyhow::Result<()>) -> anyhow::Result<()> {
        let (asked, layer, target, armed) = (&self.asked, self.layer, self.target, &mut self.armed);
        self.inner.drain(&mut |u, record| {
            if *armed && (layer, asked[u]) == target {
                *armed = false;
                return Err(deltafin_engine::fault::ReadFault {
                    layer,
                    expert: asked[u],
                    kind: deltafin_engine::fault::FaultKind::Checksum,
                    detail: "injected by the test".into(),
                }
                .into());
            }
            f(u, record)
        })
    }
    fn bytes_read(&self) -> u64 {
        self.inner.bytes_read()
    }
}

/// A routed expert's read fault (or fetch fault) in a shared step is the fault of the sequences
/// that chose that expert only: the step names them apart from the others it took out, and
/// those others, computed again from their tokens, end with the tokens they have alone. A fault
/// that is not a routed expert's is everybody's.
#[test]
fn a_read_fault_is_blamed_on_the_sequences_that_chose_the_expert() {
    use deltafin_engine::batch::{Batcher, Next};
    use deltafin_engine::generate::generate_greedy;
    let name = FIXTURES[0];
    let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    // Chunks large enough that each prompt goes in one, and both in the first step.
    let model = K3Model::load(&store, &RunConfig { prefill_chunk: 256, ..Default::default() }).unwrap();
    // A whole prompt beside a one-token one (a handful of picks per layer).
    let mut prompts: Vec<Vec<u32>> = reference(name).prompts.into_iter().map(|p| p.tokens).collect();
    prompts[1].truncate(1);
    // Each prompt's picks at the first MoE layer, alone (one chunk each).
    let picks = |p: &[u32]| {
        let mut rec = Record { inner: StoreExperts::new(&store), begins: Vec::new() };
        generate_greedy(&model, &mut rec, p, 1, None).unwrap();
        rec.begins.swap_remove(0)
    };
    let ((layer, pa), (_, pc)) = (picks(&prompts[0]), picks(&prompts[1]));
    let only_a = *pa.iter().find(|e| !pc.contains(e)).expect("an expert the first prompt picks and the second not");
    for fetch in [false, true] {
        let mut src = CorruptOnce {
            inner: StoreExperts::new(&store),
            target: (layer, only_a),
            asked: Vec::new(),
            layer: 0,
            armed: true,
            fetch,
        };
        let mut b = Batcher::new(&model, 2);
        let (a, c) = (b.join(prompts[0].clone()).unwrap(), b.join(prompts[1].clone()).unwrap());
        let e = b.step(&mut src, &mut |_, _: &K3State, _: &[f32]| unreachable!("the step failed")).unwrap_err();
        assert_eq!(e.failed, vec![a, c], "both were in the failed step");
        assert_eq!(e.blamed, vec![a], "only the first chose layer {layer} expert {only_a}: {e}");
        assert!(!src.armed, "the fault was injected");
        // The other is computed again from its prompt and goes on as alone.
        let again = b.join(prompts[1].clone()).unwrap();
        let mut tokens = Vec::new();
        while !b.is_empty() {
            b.step(&mut src, &mut |id, _: &K3State, logits: &[f32]| {
                assert_eq!(id, again);
                tokens.push(argmax(logits));
                if tokens.len() == 4 { Next::Leave } else { Next::Token(*tokens.last().unwrap()) }
            })
            .unwrap();
        }
        assert_eq!(
            tokens,
            generate_greedy(&model, &mut StoreExperts::new(&store), &prompts[1], 4, None).unwrap().tokens
        );
    }
}

/// Sequences that resume from stored states (a shared system prompt: one state, copied into
/// each) give the tokens of their whole prompts alone; a state that holds the whole prompt
/// feeds the token its logits give without computing the prompt again.
#[test]
fn sequences_resume_from_one_stored_prefix_state() {
    use deltafin_engine::batch::{Batcher, Next};
    use deltafin_engine::generate::generate_greedy;
    let name = FIXTURES[1];
    let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig { prefill_chunk: 4, ..Default::default() }).unwrap();
    let vocab = model.config.vocab_size;
    let base: Vec<u32> = reference(name).prompts.into_iter().map(|p| p.tokens).max_by_key(|t| t.len()).unwrap();
    assert!(base.len() >= 3, "a prompt of at least 3 tokens: {base:?}");
    // The shared prefix, computed once.
    let prefix = &base[..base.len() - 1];
    let mut src = StoreExperts::new(&store);
    let mut stored = model.new_state();
    let mut stored_logits = vec![0f32; vocab];
    model.forward_chunk(&mut stored, &mut src, prefix, &mut stored_logits).unwrap();
    // Three requests: the prefix and a token of their own each, and the prefix alone.
    let prompts: Vec<Vec<u32>> =
        vec![base.clone(), [prefix, &[(base[base.len() - 1] + 1) % vocab as u32]].concat(), prefix.to_vec()];
    let mut b = Batcher::new(&model, 3);
    let mut ids = Vec::new();
    for p in &prompts {
        let mut st = model.new_state();
        st.copy_sequence_from(&stored);
        ids.push(b.join_from(st, stored_logits.clone(), p[prefix.len()..].to_vec()).unwrap());
    }
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); 3];
    let mut prompt_tokens = 0;
    while !b.is_empty() {
        let r = b
            .step(&mut src, &mut |id, _: &K3State, logits| {
                let i = ids.iter().position(|&x| x == id).unwrap();
                got[i].push(argmax(logits));
                if got[i].len() >= 5 { Next::Leave } else { Next::Token(*got[i].last().unwrap()) }
            })
            .unwrap();
        prompt_tokens += r.prompt_tokens;
    }
    assert_eq!(prompt_tokens, 2, "only the tokens after the stored prefix were computed");
    for (p, g) in prompts.iter().zip(&got) {
        let alone = generate_greedy(&model, &mut StoreExperts::new(&store), p, 5, None).unwrap();
        assert_eq!(g, &alone.tokens, "resumed from the stored prefix against the whole prompt alone");
    }
    // Refused: logits of another size, a token outside the vocabulary, nothing at all.
    assert!(b.join_from(model.new_state(), vec![0.0; vocab - 1], vec![1]).is_err());
    assert!(b.join_from(model.new_state(), vec![0.0; vocab], vec![vocab as u32]).is_err());
    assert!(b.join_from(model.new_state(), vec![0.0; vocab], vec![]).is_err());
    assert!(b.is_empty());
}

/// A sequence computed again from its tokens (after a failed step) goes on with the token it
/// was about to feed, without asking for it, and ends with the tokens it has alone.
#[test]
fn a_rejoined_sequence_goes_on_as_before() {
    use deltafin_engine::batch::{Batcher, Next};
    use deltafin_engine::generate::generate_greedy;
    let name = FIXTURES[1];
    let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig { prefill_chunk: 4, ..Default::default() }).unwrap();
    let prompt: Vec<u32> = reference(name).prompts.into_iter().map(|p| p.tokens).max_by_key(|t| t.len()).unwrap();
    let alone = generate_greedy(&model, &mut StoreExperts::new(&store), &prompt, 7, None).unwrap().tokens;
    // It had fed its prompt and three tokens and was about to feed the fourth.
    let tokens = [prompt.as_slice(), &alone[..3]].concat();
    let mut b = Batcher::new(&model, 2);
    let id = b.rejoin(tokens, alone[3]).unwrap();
    let other = b.join(prompt.clone()).unwrap();
    let (mut got, mut got_other) = (alone[..4].to_vec(), Vec::new());
    let mut src = StoreExperts::new(&store);
    let mut chunked = Vec::new();
    while !b.is_empty() {
        let report = b
            .step(&mut src, &mut |i, _: &K3State, logits| {
                let v = if i == id { &mut got } else { &mut got_other };
                assert!(i == id || i == other);
                v.push(argmax(logits));
                if v.len() >= 7 { Next::Leave } else { Next::Token(*v.last().unwrap()) }
            })
            .unwrap();
        chunked.extend(report.chunked);
    }
    assert_eq!(got, alone, "the rejoined sequence");
    // The joined prompt's chunks are reported as it goes (a prompt-state store keeps each); the
    // rejoined sequence's are not (its tokens are not a prompt).
    let fed: Vec<usize> = chunked.iter().map(|&(i, n)| if i == other { n } else { usize::MAX }).collect();
    assert!(!fed.is_empty() && fed.windows(2).all(|w| w[0] < w[1]) && *fed.last().unwrap() < prompt.len(), "{fed:?}");
    assert_eq!(got_other, alone, "the sequence beside it");
    assert!(b.rejoin(prompt.clone(), model.config.vocab_size as u32).is_err());
    assert!(b.is_empty(), "a refused rejoin queues nothing");
}

/// A prompt chunk ends where `stop_at` says (a shared start): the step lists the sequence, its
/// state then holds exactly those tokens with the logits after them, and its tokens are still
/// those it has alone.
#[test]
fn a_prompt_stops_where_its_shared_start_ends() {
    use deltafin_engine::batch::{Batcher, Next};
    use deltafin_engine::generate::generate_greedy;
    let name = FIXTURES[1];
    let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig { prefill_chunk: 8, ..Default::default() }).unwrap();
    let prompt: Vec<u32> = reference(name).prompts.into_iter().map(|p| p.tokens).max_by_key(|t| t.len()).unwrap();
    let at = prompt.len() / 2;
    assert!(at >= 1 && at < prompt.len());
    let mut src = StoreExperts::new(&store);
    let mut want_state = model.new_state();
    let mut want_logits = vec![0f32; model.config.vocab_size];
    model.forward_chunk(&mut want_state, &mut src, &prompt[..at], &mut want_logits).unwrap();
    let mut b = Batcher::new(&model, 2);
    let id = b.join(prompt.clone()).unwrap();
    b.stop_at(id, at);
    let mut got = Vec::new();
    let mut stopped_steps = 0;
    while !b.is_empty() {
        let r = b
            .step(&mut src, &mut |_, _: &K3State, logits| {
                got.push(argmax(logits));
                if got.len() >= 4 { Next::Leave } else { Next::Token(*got.last().unwrap()) }
            })
            .unwrap();
        if r.stopped.contains(&id) {
            stopped_steps += 1;
            let (state, logits) = b.seq(id).unwrap();
            assert_eq!(state.position, at);
            assert_eq!(logits, want_logits.as_slice(), "the logits after the shared start");
        }
    }
    assert_eq!(stopped_steps, 1);
    let alone = generate_greedy(&model, &mut StoreExperts::new(&store), &prompt, 4, None).unwrap();
    assert_eq!(got, alone.tokens);
}

/// A step whose sequences are all let go stops between layers (as a prompt alone does when its
/// client leaves): they leave the batch unasked; one sequence still wanted keeps the step going.
#[test]
fn a_step_nobody_wants_stops_between_layers() {
    use deltafin_engine::batch::{Batcher, Next};
    let name = FIXTURES[0];
    let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig { prefill_chunk: 256, ..Default::default() }).unwrap();
    let prompts: Vec<Vec<u32>> = reference(name).prompts.into_iter().map(|p| p.tokens).collect();
    let mut src = StoreExperts::new(&store);
    let mut b = Batcher::new(&model, 2);
    let (a, c) = (b.join(prompts[0].clone()).unwrap(), b.join(prompts[1].clone()).unwrap());
    assert!(model.config.num_hidden_layers > 1);
    let mut asked = 0;
    let report = b
        .step_while(&mut src, &mut |_, _: &K3State, _: &[f32]| unreachable!("nobody is asked"), &mut |_| {
            asked += 1;
            false
        })
        .unwrap();
    assert_eq!(asked, 2, "asked of each sequence after the first layer, then stopped");
    assert_eq!(report.dropped, vec![a, c]);
    assert!(b.is_empty(), "both left the batch");
    // One still wanted: the step completes for both.
    let (a, c) = (b.join(prompts[0].clone()).unwrap(), b.join(prompts[1].clone()).unwrap());
    let mut got = Vec::new();
    let report = b
        .step_while(
            &mut src,
            &mut |id, _: &K3State, _: &[f32]| {
                got.push(id);
                Next::Leave
            },
            &mut |id| id == c,
        )
        .unwrap();
    assert!(report.dropped.is_empty());
    assert_eq!(got, vec![a, c]);
}

/// An expert source that lends at most `cap` bytes of what is asked (the cache's memory for a
/// long prompt's chunk), counts the lending and the giving back, and can fail its `fail_at`-th
/// `begin` or panic at its `panic_at`-th.
struct Lender<'a> {
    inner: StoreExperts<'a>,
    cap: u64,
    asked: Vec<u64>,
    lent: Vec<u64>,
    taken_back: usize,
    begins: usize,
    fail_at: usize,
    panic_at: usize,
}

impl<'a> Lender<'a> {
    fn new(store: &'a Store, cap: u64) -> Self {
        Lender {
            inner: StoreExperts::new(store),
            cap,
            asked: Vec::new(),
            lent: Vec::new(),
            taken_back: 0,
            begins: 0,
            fail_at: 0,
            panic_at: 0,
        }
    }
}

impl ExpertSource for Lender<'_> {
    fn begin(&mut self, layer: usize, experts: &[usize]) -> anyhow::Result<()> {
        self.begins += 1;
        assert!(self.begins != self.panic_at, "injected panic");
        anyhow::ensure!(self.begins != self.fail_at, "injected read fault");
        self.inner.begin(layer, experts)
    }
    fn drain(&mut self, f: &mut dyn FnMut(usize, &[u8]) -> anyhow::Result<()>) -> anyhow::Result<()> {
        self.inner.drain(f)
    }
    fn bytes_read(&self) -> u64 {
        self.inner.bytes_read()
    }
    fn lend(&mut self, bytes: u64) -> u64 {
        assert_eq!(self.lent.len(), self.taken_back, "lent again before the last loan came back");
        self.asked.push(bytes);
        self.lent.push(bytes.min(self.cap));
        bytes.min(self.cap)
    }
    fn take_back(&mut self) {
        self.taken_back += 1;
    }
}

/// A long prompt that no decoding sequence waits on borrows the expert cache for larger chunks,
/// as it does alone: as few chunks of one size as the loan allows, each step's loan given back
/// at its end. While a sequence decodes, a joining prompt keeps the plan's chunk (its
/// neighbour's pauses stay one chunk long) and borrows nothing; once it is alone again, it
/// borrows. Part of a loan refused: chunks as large as what was lent. Tokens are those of each
/// sequence alone. A step that fails or panics with the cache lent gives it back.
#[test]
fn a_long_prompt_with_nobody_decoding_borrows_the_cache() {
    use deltafin_engine::batch::{Batcher, Next, SeqId};
    use deltafin_engine::generate::generate_greedy;
    use deltafin_engine::k3::PromptBorrowing;
    let name = FIXTURES[0];
    let dir = convert_fixture(name, SpineDtype::Int8, 0, ExpertLayout::Pack);
    let store = Store::open(dir.path(), None).unwrap();
    let per = 1000;
    let run = RunConfig {
        prefill_chunk: 2,
        prompt_borrowing: Some(PromptBorrowing { max_chunk: 8, token_bytes: per }),
        ..Default::default()
    };
    let model = K3Model::load(&store, &run).unwrap();
    let prompts: Vec<Vec<u32>> = reference(name).prompts.into_iter().map(|p| p.tokens).collect();
    let long: Vec<u32> = prompts.iter().flatten().copied().take(20).collect();
    assert_eq!(long.len(), 20, "the fixture's prompts make a 20-token prompt");
    let second: Vec<u32> = long.iter().rev().copied().take(12).collect();
    // (cap on a loan, the first prompt's chunks, the bytes each of its steps asks for)
    let cases = [(u64::MAX, vec![7usize, 7, 6], vec![5000u64, 5000, 4000]), (2000, vec![4; 5], vec![])];
    for (cap, chunks, asked) in cases {
        let what = format!("loans capped at {cap} bytes");
        let mut src = Lender::new(&store, cap);
        let mut b = Batcher::new(&model, 2);
        let first = b.join(long.clone()).unwrap();
        let mut got: Vec<(SeqId, Vec<u32>)> = vec![(first, Vec::new())];
        let mut second_id = None;
        // (prompt tokens, decode tokens, bytes borrowed) of every step
        let mut steps: Vec<(usize, usize, u64)> = Vec::new();
        while !b.is_empty() {
            let r = b
                .step(&mut src, &mut |id, _: &K3State, logits: &[f32]| {
                    let t = argmax(logits);
                    let toks = &mut got.iter_mut().find(|(i, _)| *i == id).unwrap().1;
                    toks.push(t);
                    if toks.len() >= 6 { Next::Leave } else { Next::Token(t) }
                })
                .unwrap();
            assert_eq!(src.lent.len(), src.taken_back, "{what}: step {}'s loan was not given back", steps.len());
            if r.decode_tokens > 0 {
                assert_eq!(r.borrowed_bytes, 0, "{what}: a step with a decoding sequence borrows nothing");
                assert!(r.prompt_tokens <= 2, "{what}: beside a decoding sequence, the plan's chunk");
            } else if r.prompt_tokens > 2 {
                assert_eq!(r.borrowed_bytes, *src.lent.last().unwrap(), "{what}: the report says what was lent");
            }
            steps.push((r.prompt_tokens, r.decode_tokens, r.borrowed_bytes));
            // The second prompt joins once the first decodes.
            if r.decode_tokens == 1 && second_id.is_none() {
                let id = b.join(second.clone()).unwrap();
                got.push((id, Vec::new()));
                second_id = Some(id);
            }
            assert!(steps.len() < 100);
        }
        let firsts: Vec<usize> = steps[..chunks.len()].iter().map(|s| s.0).collect();
        assert_eq!(firsts, chunks, "{what}: the long prompt's chunks");
        assert!(steps[..chunks.len()].iter().all(|s| s.1 == 0 && s.2 > 0), "{what}: each borrowed");
        if !asked.is_empty() {
            assert_eq!(src.asked[..asked.len()], asked[..], "{what}: each step asks for its chunk's memory");
        }
        assert!(src.lent.iter().all(|&l| l <= cap));
        let beside = steps.iter().filter(|s| s.0 > 0 && s.1 > 0).count();
        assert_eq!(beside, 4, "{what}: the second prompt rode in chunks of 2 beside the first's tokens");
        let after = steps.iter().position(|s| s.0 > 0 && s.1 > 0).unwrap() + beside;
        assert_eq!(steps[after], (4, 0, 2000), "{what}: the second's last 4 tokens borrowed once alone");
        for (id, prompt) in [(first, &long), (second_id.unwrap(), &second)] {
            let alone = generate_greedy(&model, &mut StoreExperts::new(&store), prompt, 6, None).unwrap();
            let toks = &got.iter().find(|(i, _)| *i == id).unwrap().1;
            assert_eq!(toks, &alone.tokens, "{what}: tokens differ from the sequence alone");
        }
    }
    // The streaming source lends real cache slots: the long prompt's tokens are still those
    // alone, and afterwards every layer holds its slots again.
    let o = StreamOptions {
        cache_slots_per_layer: 4,
        // Plain LRU: four experts read last are the four cached (SLRU would keep reused ones).
        policy: Policy::Lru,
        backend: None,
        direct: true,
        queue_depth: 8,
        io_buffers: 6,
        prefetch_buffers: 0,
    };
    let mut src = StreamingExperts::new(&store, o).unwrap();
    let slot = src.slot_bytes as u64;
    let lending = RunConfig {
        prefill_chunk: 2,
        prompt_borrowing: Some(PromptBorrowing { max_chunk: 8, token_bytes: slot }),
        ..Default::default()
    };
    let model_lending = K3Model::load(&store, &lending).unwrap();
    let mut b = Batcher::new(&model_lending, 2);
    let id = b.join(long.clone()).unwrap();
    let (mut toks, mut borrowed) = (Vec::new(), 0);
    while !b.is_empty() {
        let r = b
            .step(&mut src, &mut |_, _: &K3State, logits: &[f32]| {
                toks.push(argmax(logits));
                if toks.len() >= 6 { Next::Leave } else { Next::Token(*toks.last().unwrap()) }
            })
            .unwrap();
        borrowed = borrowed.max(r.borrowed_bytes);
    }
    assert!(borrowed >= slot, "the streaming source lent no slot");
    let alone = generate_greedy(&model_lending, &mut StoreExperts::new(&store), &long, 6, None).unwrap();
    assert_eq!(toks, alone.tokens, "{id:?}: tokens with real cache slots lent differ from alone");
    let layer = model.config.moe_layers()[0];
    src.begin(layer, &[0, 1, 2, 3]).unwrap();
    src.drain(&mut |_, _| Ok(())).unwrap();
    assert!((0..4).all(|e| src.is_cached(layer, e)), "the cache did not get its slots back");

    let mut src = Lender::new(&store, u64::MAX);
    src.fail_at = 1;
    let mut b = Batcher::new(&model, 2);
    b.join(long.clone()).unwrap();
    let e = b.step(&mut src, &mut |_, _: &K3State, _: &[f32]| unreachable!()).unwrap_err();
    assert!(format!("{e}").contains("injected read fault"));
    assert_eq!((src.lent.len(), src.taken_back), (1, 1), "a failed step gives the loan back");
    let mut src = Lender::new(&store, u64::MAX);
    src.panic_at = 1;
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut b = Batcher::new(&model, 2);
        b.join(long.clone()).unwrap();
        let _ = b.step(&mut src, &mut |_, _: &K3State, _: &[f32]| unreachable!());
    }));
    assert!(outcome.is_err(), "the injected panic did not happen");
    assert_eq!((src.lent.len(), src.taken_back), (1, 1), "a panic inside the step gives the loan back");
}
