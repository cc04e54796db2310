//! The API's generation loop on the fixtures: greedy equals mlx-lm's greedy continuation,
//! seeded sampling is reproducible, forced tokens, stop strings and cancellation behave, and
//! log-probabilities are those of the model's distribution.

#[path = "../../engine/tests/common/mod.rs"]
mod common;

use common::*;
use deltafin_engine::experts::StoreExperts;
use deltafin_engine::k3::{K3Model, RunConfig};
use deltafin_store::{ExpertLayout, SpineDtype, Store};
use deltafin_text::chat::parse::OutputEvent;
use deltafin_text::sample::SamplingParams;
use deltafin_text::textgen::{Finish, PrefixCache, Sink, TextGenerator, TextRequest, TokenLogprob};
use deltafin_text::tokenizer::Tokenizer;

/// Records everything; cancels after `cancel_after` tokens when set.
#[derive(Default)]
struct Recorder {
    events: Vec<OutputEvent>,
    logprobs: Vec<TokenLogprob>,
    tokens: usize,
    cancel_after: Option<usize>,
}

impl Sink for Recorder {
    fn keep_going(&mut self) -> bool {
        self.cancel_after.is_none_or(|n| self.tokens < n)
    }

    fn token(&mut self, events: &[OutputEvent], logprob: Option<&TokenLogprob>) -> bool {
        self.tokens += 1;
        self.events.extend_from_slice(events);
        self.logprobs.extend(logprob.cloned());
        true
    }
}

impl Recorder {
    fn text(&self) -> String {
        self.events.iter().map(|e| if let OutputEvent::Content(s) = e { s.as_str() } else { "" }).collect()
    }
}

fn request(prompt: Vec<u32>, max_tokens: usize, temperature: f32, seed: u64) -> TextRequest {
    TextRequest {
        shared_prefix: None,
        prompt,
        max_tokens,
        sampling: SamplingParams { temperature, top_p: 1.0, top_k: 0, seed: Some(seed) },
        stop: Vec::new(),
        logprobs: Some(2),
        parse_chat: false,
        reasoning_open: false,
        ignore_eos: true,
        forced: None,
    }
}

#[test]
fn generation_loop_matches_the_reference_and_its_own_rules() {
    for name in FIXTURES {
        let dir = convert_fixture(name, SpineDtype::F32, 0, ExpertLayout::InPlace);
        let store = Store::open(dir.path(), None).unwrap();
        let model = K3Model::load(&store, &RunConfig::default()).unwrap();
        let tok = Tokenizer::load(&store.dir).unwrap();
        let generator = TextGenerator { model: &model, tokenizer: &tok, step_delay: Default::default() };
        let run = |req: &TextRequest, rec: &mut Recorder| {
            let mut src = StoreExperts::new(&store);
            generator.run(&mut src, req, rec).unwrap()
        };
        for p in reference(name).prompts.iter() {
            // Greedy (temperature 0): the reference continuation, whose tokens decode to the text.
            let req = request(p.tokens.clone(), p.greedy.len(), 0.0, 1);
            let mut rec = Recorder::default();
            let s = run(&req, &mut rec);
            assert_eq!(s.finish, Finish::Length);
            assert_eq!(s.completion_tokens, p.greedy.len());
            assert_eq!(rec.logprobs.iter().map(|l| l.id).collect::<Vec<_>>(), p.greedy, "{name}: greedy");
            assert_eq!(rec.text(), tok.decode(&p.greedy), "{name}: text of the greedy tokens");
            for l in &rec.logprobs {
                // The greedy pick is the most likely token; its log-probability is <= 0.
                assert_eq!(l.top[0].0, l.id);
                assert!(l.logprob <= 0.0 && (l.logprob - l.top[0].1).abs() < 1e-6);
            }
        }
        let prompt = reference(name).prompts[0].tokens.clone();
        // Seeded sampling: same seed, same tokens; another seed, other tokens.
        let sampled = |seed| {
            let mut rec = Recorder::default();
            run(&request(prompt.clone(), 24, 1.0, seed), &mut rec);
            rec.logprobs.iter().map(|l| l.id).collect::<Vec<_>>()
        };
        assert_eq!(sampled(7), sampled(7));
        assert_ne!(sampled(7), sampled(8));
        // A stop string cuts the text before it and ends generation.
        let mut full = Recorder::default();
        run(&request(prompt.clone(), 24, 0.0, 1), &mut full);
        let text = full.text();
        let chars: Vec<char> = text.chars().collect();
        let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
        let mut req = request(prompt.clone(), 24, 0.0, 1);
        req.stop = vec![stop.clone()];
        let mut rec = Recorder::default();
        let s = run(&req, &mut rec);
        assert_eq!(s.finish, Finish::Stop);
        assert_eq!(s.stop_string.as_deref(), Some(stop.as_str()));
        assert_eq!(rec.text(), text[..text.find(&stop).unwrap()]);
        // Forced tokens replace the sampled ones and end generation when they run out.
        let forced = tok.encode("forced words");
        let mut req = request(prompt.clone(), 100, 0.0, 1);
        req.forced = Some(forced.clone());
        let mut rec = Recorder::default();
        let s = run(&req, &mut rec);
        assert_eq!((s.finish, rec.text().as_str()), (Finish::Stop, "forced words"));
        assert_eq!(s.completion_tokens, forced.len());
        // Prefix reuse is exact: a prompt extending the cached one resumes from its state and
        // gives the same tokens and log-probabilities, bit for bit, as a fresh run.
        // The longest reference prompt (40 tokens) and it extended by 17 more: the two runs cut
        // their 32-token chunks at different places.
        let base = reference(name).prompts.iter().map(|p| p.tokens.clone()).max_by_key(|t| t.len()).unwrap();
        let long: Vec<u32> = base.iter().chain(&base[..17]).copied().collect();
        let tokens_and_lps =
            |rec: &Recorder| -> Vec<(u32, u32)> { rec.logprobs.iter().map(|l| (l.id, l.logprob.to_bits())).collect() };
        let mut fresh = Recorder::default();
        run(&request(long.clone(), 12, 0.0, 1), &mut fresh);
        let mut cache = PrefixCache::new(&model);
        let mut src = StoreExperts::new(&store);
        let first = generator
            .run_cached(&mut src, &request(base.clone(), 3, 0.0, 1), &mut Recorder::default(), Some(&mut cache))
            .unwrap();
        assert_eq!(first.cached_prompt_tokens, 0);
        let mut resumed = Recorder::default();
        let s =
            generator.run_cached(&mut src, &request(long.clone(), 12, 0.0, 1), &mut resumed, Some(&mut cache)).unwrap();
        assert_eq!(s.cached_prompt_tokens, base.len());
        assert!(base.len() >= 33, "the base prompt should span a chunk boundary");
        assert_eq!(tokens_and_lps(&resumed), tokens_and_lps(&fresh), "{name}: resumed prompt differs");
        // The same prompt again is all cached; an unrelated one is not.
        let mut again = Recorder::default();
        let s =
            generator.run_cached(&mut src, &request(long.clone(), 12, 0.0, 1), &mut again, Some(&mut cache)).unwrap();
        assert_eq!(s.cached_prompt_tokens, long.len());
        assert_eq!(tokens_and_lps(&again), tokens_and_lps(&fresh));
        let mut other = long.clone();
        other[0] ^= 1;
        let s = generator
            .run_cached(&mut src, &request(other, 2, 0.0, 1), &mut Recorder::default(), Some(&mut cache))
            .unwrap();
        assert_eq!(s.cached_prompt_tokens, 0);
        // Cancellation: the sink's refusal stops generation at once.
        let mut rec = Recorder { cancel_after: Some(3), ..Default::default() };
        let s = run(&request(prompt.clone(), 50, 0.0, 1), &mut rec);
        assert_eq!((s.finish, rec.tokens), (Finish::Cancelled, 3));
    }
}

/// Without a store on disk, a request's shared start (its tools and system messages) is kept in
/// the prefix cache's second memory slot: requests with the same start and each its own tail
/// resume from it, with the tokens and log-probabilities of a fresh run, bit for bit; the slot
/// of the last prompt still wins where it covers more.
#[test]
fn a_shared_start_is_kept_in_memory_and_resumed_exactly() {
    let name = FIXTURES[0];
    let dir = convert_fixture(name, SpineDtype::F32, 0, ExpertLayout::InPlace);
    let store = Store::open(dir.path(), None).unwrap();
    let model = K3Model::load(&store, &RunConfig::default()).unwrap();
    let tok = Tokenizer::load(&store.dir).unwrap();
    let generator = TextGenerator { model: &model, tokenizer: &tok, step_delay: Default::default() };
    let base = reference(name).prompts.iter().map(|p| p.tokens.clone()).max_by_key(|t| t.len()).unwrap();
    // A 35-token start (past the 32-token chunk boundary) and two different tails.
    let head = base[..35].to_vec();
    let with_tail = |tail: &[u32]| -> Vec<u32> { head.iter().chain(tail).copied().collect() };
    let (a, b) = (with_tail(&base[..6]), with_tail(&base[10..19]));
    let shared = |prompt: Vec<u32>| TextRequest { shared_prefix: Some(head.len()), ..request(prompt, 8, 0.0, 1) };
    let lps =
        |rec: &Recorder| -> Vec<(u32, u32)> { rec.logprobs.iter().map(|l| (l.id, l.logprob.to_bits())).collect() };
    let fresh = |prompt: &[u32]| {
        let mut rec = Recorder::default();
        generator.run(&mut StoreExperts::new(&store), &request(prompt.to_vec(), 8, 0.0, 1), &mut rec).unwrap();
        lps(&rec)
    };
    let mut cache = PrefixCache::new(&model);
    let mut src = StoreExperts::new(&store);
    let mut run = |req: &TextRequest| {
        let mut rec = Recorder::default();
        let s = generator.run_cached(&mut src, req, &mut rec, Some(&mut cache)).unwrap();
        (s.cached_prompt_tokens, lps(&rec))
    };
    let first = run(&shared(a.clone()));
    assert_eq!(first, (0, fresh(&a)), "nothing kept yet; the split run equals a fresh one");
    // Another tail after the same start resumes from the state after the start.
    assert_eq!(run(&shared(b.clone())), (head.len(), fresh(&b)));
    // A prompt extending the last one resumes from the last prompt's slot (longer).
    let longer: Vec<u32> = b.iter().chain(&base[..3]).copied().collect();
    assert_eq!(run(&shared(longer.clone())), (b.len(), fresh(&longer)));
    // After a failure both slots are forgotten.
    cache.clear();
    let mut src = StoreExperts::new(&store);
    let s = generator.run_cached(&mut src, &shared(a.clone()), &mut Recorder::default(), Some(&mut cache)).unwrap();
    assert_eq!(s.cached_prompt_tokens, 0);
}
