#!/usr/bin/env python3
"""Check tools/demo/k3_torch.py against the mlx-lm 0.32.2 reference outputs of the K3 fixtures.

    .venv-demo/bin/python tools/demo/check_parity.py            # both fixtures, both KDA forms, self-tests
    .venv-demo/bin/python tools/demo/check_parity.py --quick    # skip the self-tests

For each fixture (fixtures/NAME/hf loaded with load_hf, float32 on CPU) and each KDA form (recurrent, chunk):
every reference prompt's last-position logits, all 17 positions of the 17-token prompt, and the 5-token prompt's
logits as mlx-lm produced them one token at a time (stepwise_5), each as
    rel = max |torch - mlx| / max |mlx|
plus whether the greedy argmax agrees. Then self-tests of the pieces the fixtures cannot reach: the chunked KDA
against the recurrent one over several chunks (values and gradients, both gate types, strong decay, a carried
state), the MXFP4 round trip, save_hf -> load_hf, and the router-bias update.

Exits 1 if any relative difference exceeds 1e-4 or any argmax disagrees.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import k3_torch as k3  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4
failures = []


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


def report(label: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    """ours, ref [..., V]: relative difference over everything, argmax agreement per row."""
    r = rel(ours, ref)
    agree = bool((ours.argmax(-1) == ref.argmax(-1)).all())
    ok = r <= tol and agree
    if not ok:
        failures.append(label)
    print(f"  {label:<40s} rel {r:.3e}  argmax {'agree' if agree else 'DISAGREE'}  {'ok' if ok else 'FAIL'}")


def check_fixture(name: str) -> None:
    fdir = REPO / "fixtures" / name
    ref = json.loads((fdir / "reference.json").read_text())
    t0 = time.perf_counter()
    model = k3.load_hf(fdir / "hf").eval()
    print(f"{name}: loaded in {time.perf_counter() - t0:.2f} s, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters (experts dequantised)")
    for mode in ("recurrent", "chunk"):
        model.set_kda_mode(mode)
        with torch.no_grad():
            for p in ref["prompts"]:
                ids = torch.tensor([p["tokens"]])  # [1, T]
                logits = model(ids)[0]  # [T, V]
                want = torch.tensor(p["last_logits"])  # [V]
                report(f"{mode:9s} prompt len {len(p['tokens']):2d} last", logits[-1], want)
                if len(p["tokens"]) == 17:
                    report(f"{mode:9s} prompt len 17 all_logits_17", logits, torch.tensor(ref["all_logits_17"]))
                if p["tokens"] == ref["stepwise_5"]["tokens"]:
                    report(f"{mode:9s} stepwise_5 (mlx cached decode)", logits[-1],
                           torch.tensor(ref["stepwise_5"]["last_logits"]))
            # greedy continuation of the longest prompt, re-running the whole sequence each step
            p = ref["prompts"][-1]
            ids = list(p["tokens"])
            for _ in range(len(p["greedy"])):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            same = ids[len(p["tokens"]):] == p["greedy"]
            if not same:
                failures.append(f"{name} {mode} greedy")
            print(f"  {mode:9s} greedy {len(p['greedy'])} tokens after len {len(p['tokens'])}: "
                  f"{'match' if same else 'MISMATCH'}")

    # Context, not a pass/fail: the same 17-token prompt with the port in float64. How far each float32 result
    # (mlx's and ours) lies from it shows how much of the float32 difference is the fixture's own conditioning.
    m64 = k3.load_hf(fdir / "hf", dtype=torch.float64).eval()
    p17 = next(p for p in ref["prompts"] if len(p["tokens"]) == 17)
    ids = torch.tensor([p17["tokens"]])  # [1, 17]
    with torch.no_grad():
        m64.set_kda_mode("recurrent")
        l64 = m64(ids)[0]  # [17, V]
        m64.set_kda_mode("chunk")
        l64c = m64(ids)[0]  # [17, V]
        model.set_kda_mode("recurrent")
        l32 = model(ids)[0].double()  # [17, V]
    mlx = torch.tensor(ref["all_logits_17"], dtype=torch.float64)  # [17, V]
    print(f"  float64 port, all_logits_17 (info): mlx-f32 vs it {rel(mlx, l64):.2e}, torch-f32 vs it "
          f"{rel(l32, l64):.2e}; chunk vs recurrent in float64 {rel(l64c, l64):.2e}")


# ----------------------------------------------------------------------------------------------------------------
# Self-tests
# ----------------------------------------------------------------------------------------------------------------


def kda_inputs(B, T, H, D, lower_bound, a_scale=1.0, seed=0):
    """Inputs shaped like a KDA layer's (normalised q, k; decay from the model's own formula)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1) * D**-0.5  # [B, T, H, D]
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)  # [B, T, H, D]
    v = torch.randn(B, T, H, D, generator=g)  # [B, T, H, D]
    a = a_scale * torch.randn(B, T, H, D, generator=g)  # [B, T, H, D]
    A = torch.exp(torch.log(torch.empty(H).uniform_(1.0, 16.0, generator=g))).view(H, 1)  # [H, 1]
    dt = 0.1 * torch.randn(H, D, generator=g)  # [H, D]
    if lower_bound is None:
        log_g = -A * torch.nn.functional.softplus(a + dt)  # [B, T, H, D]
    else:
        log_g = lower_bound * torch.sigmoid(A * (a + dt))  # [B, T, H, D]
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))  # [B, T, H]
    return q, k, v, log_g, beta


def check_kda_forms() -> None:
    print("self-test: chunked KDA vs recurrent (float32)")
    cases = [
        ("lower bound -5, T=300 (5 chunks, padded)", dict(B=2, T=300, H=4, D=32, lower_bound=-5.0)),
        ("softplus gate, T=256", dict(B=2, T=256, H=4, D=32, lower_bound=None)),
        ("softplus gate, strong decay, T=200", dict(B=1, T=200, H=2, D=16, lower_bound=None, a_scale=4.0)),
        ("almost no decay (log g / 1000), T=256", dict(B=1, T=256, H=2, D=32, lower_bound=None, a_scale=0.0)),
    ]
    for label, kw in cases:
        q, k, v, log_g, beta = kda_inputs(**kw)
        if kw.get("a_scale") == 0.0:
            log_g = log_g * 1e-3  # almost no decay: the delta rule alone has to stay stable
        o_r, s_r = k3.kda_recurrent(q, k, v, log_g, beta)
        o_c, s_c = k3.kda_chunk(q, k, v, log_g, beta)
        r_o, r_s = rel(o_c, o_r), rel(s_c, s_r)
        ok = r_o <= TOL and r_s <= TOL
        if not ok:
            failures.append(f"kda {label}")
        print(f"  {label:<42s} out rel {r_o:.2e}  state rel {r_s:.2e}  {'ok' if ok else 'FAIL'}")

    # a carried state: two halves through kda_chunk == the whole
    q, k, v, log_g, beta = kda_inputs(B=2, T=192, H=4, D=32, lower_bound=-5.0, seed=3)
    o_w, s_w = k3.kda_chunk(q, k, v, log_g, beta)
    o_1, s_1 = k3.kda_chunk(q[:, :100], k[:, :100], v[:, :100], log_g[:, :100], beta[:, :100])
    o_2, s_2 = k3.kda_chunk(q[:, 100:], k[:, 100:], v[:, 100:], log_g[:, 100:], beta[:, 100:], initial_state=s_1)
    r = max(rel(torch.cat([o_1, o_2], 1), o_w), rel(s_2, s_w))
    if r > TOL:
        failures.append("kda carried state")
    print(f"  {'initial_state: halves vs whole':<42s} rel {r:.2e}  {'ok' if r <= TOL else 'FAIL'}")

    # Gradients of a scalar loss with respect to every input. The lower-bound gate saturates in float32 (log g of
    # exactly -5, and of -1e-16 where the sigmoid vanishes, which leaves the cumulative decay exactly flat): the
    # case that once broke the chunk form's log_g gradient.
    for lb in (-5.0, None):
        for T in (64, 150):
            q, k, v, log_g, beta = kda_inputs(B=1, T=T, H=2, D=16, lower_bound=lb, seed=5)
            w = torch.randn(1, T, 2, 16, generator=torch.Generator().manual_seed(9))  # [B, T, H, D]
            grads = {}
            for form, fn in (("recurrent", k3.kda_recurrent), ("chunk", k3.kda_chunk)):
                ins = [t.clone().requires_grad_(True) for t in (q, k, v, log_g, beta)]
                o, s = fn(*ins)
                ((o * w).sum() + s.pow(2).sum()).backward()
                grads[form] = [t.grad for t in ins]
            rels = [rel(gc, gr) for gc, gr in zip(grads["chunk"], grads["recurrent"])]
            worst = max(rels)
            if worst > TOL:
                failures.append(f"kda gradients lb={lb} T={T}")
            label = f"gradients, {'lower bound -5' if lb else 'softplus gate'}, T={T}"
            print(f"  {label:<42s} worst rel {worst:.2e} (q k v log_g beta: "
                  f"{' '.join(f'{r:.0e}' for r in rels)})  {'ok' if worst <= TOL else 'FAIL'}")


def check_mxfp4_and_save() -> None:
    print("self-test: MXFP4 round trip, save_hf -> load_hf, router bias update")
    raw = k3._read_safetensors(REPO / "fixtures" / "k3-small" / "hf")
    n, exact = 0, True
    for name in raw:
        if name.endswith("weight_packed"):
            base = name[: -len("weight_packed")]
            w = k3.mxfp4_dequantize(raw[name], raw[base + "weight_scale"])  # [R, C]
            w2 = k3.mxfp4_dequantize(*k3.mxfp4_quantize(w))  # [R, C]
            exact &= torch.equal(w, w2)
            n += 1
    # random weights: the quantisation error stays within half a step of the group's scale
    w = torch.randn(64, 128)
    wq = k3.mxfp4_dequantize(*k3.mxfp4_quantize(w))
    step = torch.exp2(k3.mxfp4_scale_exponent(w.view(64, 4, 32).abs().amax(-1)))  # [64, 4]
    err = ((w - wq).view(64, 4, 32).abs() / step[..., None]).max().item()
    ok = exact and err <= 1.0 + 1e-6
    if not ok:
        failures.append("mxfp4")
    print(f"  mxfp4: {n} fixture expert matrices re-quantise exactly: {exact}; random max err {err:.3f} x scale "
          f"(<= 1: half the widest E2M1 gap)  {'ok' if ok else 'FAIL'}")

    model = k3.load_hf(REPO / "fixtures" / "k3-small" / "hf").eval()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(1))  # [2, 70]
    with torch.no_grad():
        before = model(ids)  # [2, 70, V]
    with tempfile.TemporaryDirectory() as tmp:
        k3.save_hf(model, tmp, mxfp4_experts=True)
        again = k3.load_hf(tmp).eval()
        with torch.no_grad():
            after = again(ids)
    r = rel(after, before)
    # bf16/f32 values written as they were read and MXFP4 re-quantising exactly: the logits are identical
    ok = r == 0.0
    if not ok:
        failures.append("save_hf round trip")
    print(f"  save_hf (bf16 + MXFP4 experts) -> load_hf: rel {r:.2e}  {'ok' if ok else 'FAIL'}")

    # Batch of 2 at T=70: the rows must equal single-sequence runs (no leak across the batch). In float64, where
    # rounding cannot hide a small leak (in float32 this random model amplifies rounding to ~1e-5 on its own).
    m64 = k3.load_hf(REPO / "fixtures" / "k3-small" / "hf", dtype=torch.float64).eval()
    with torch.no_grad():
        both = m64(ids)  # [2, 70, V]
        r_b = max(rel(m64(ids[i : i + 1])[0], both[i]) for i in range(2))
    ok = r_b <= 1e-10
    if not ok:
        failures.append("batch independence")
    print(f"  batch rows vs single runs (float64): rel {r_b:.2e}  {'ok' if ok else 'FAIL'}")

    # router choices and the bias update
    model.train()
    with torch.no_grad():
        model(ids)
    choices = model.router_choices()
    moe = model.moe_layers()
    i0 = min(moe)
    bias0 = moe[i0].gate.e_score_correction_bias.clone()
    loads = model.update_router_bias(u=1e-3)
    load = loads[i0]
    expect = bias0 + 1e-3 * torch.sign(load.mean() - load)
    ok = (choices[i0].shape == (2, 70, model.cfg.num_experts_per_token)
          and float(load.sum()) == 2 * 70 * model.cfg.num_experts_per_token
          and torch.allclose(moe[i0].gate.e_score_correction_bias, expect)
          and float(moe[i0].expert_load.sum()) == 0.0)
    if not ok:
        failures.append("router bias update")
    print(f"  router choices {tuple(choices[i0].shape)} per layer, {len(choices)} MoE layers; bias update "
          f"{'ok' if ok else 'FAIL'}")

    # one training step runs end to end (gradients reach every trained parameter)
    model.zero_grad()
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    # an expert that no token picked in its layer gets no gradient, rightly
    unused = {f"language_model.model.layers.{i}.block_sparse_moe.experts.{e}."
              for i, m in moe.items() for e in range(model.cfg.num_experts) if e not in set(m.last_topk.flatten().tolist())}
    # Layer 0's attention-residual mix sees no stored block yet (mlx-lm returns the partial sum unmixed), so
    # self_attention_res_proj/norm of layer 0 never enter the computation: dead parameters in K3 itself.
    unused |= {"language_model.model.layers.0.self_attention_res_"}
    missing = [n for n, p in model.named_parameters()
               if p.grad is None and not any(n.startswith(u) for u in unused)]
    if missing or not torch.isfinite(loss):
        failures.append("training step")
    print(f"  backward: loss {loss.item():.3f}, parameters without a gradient: {missing or 'none'}")


def check_config_variants() -> None:
    """Config branches the fixtures do not take, on models built from a config with init_weights: each runs
    forward and backward, and its chunked KDA agrees with the recurrent one."""
    print("self-test: config variants (built from config, init_weights)")
    base = json.loads((REPO / "fixtures" / "k3-tiny" / "hf" / "config.json").read_text())["text_config"]
    variants = {
        "low-rank KDA gate, no q_lora, no attn-res": dict(
            linear_attn_config={**base["linear_attn_config"], "use_full_rank_gate": False},
            q_lora_rank=None, attn_res_block_size=None),
        "grouped top-k (4 groups, keep 2), tied embeddings": dict(
            num_expert_group=4, topk_group=2, tie_word_embeddings=True),
        "no latent, no shared experts, 2 dense layers": dict(
            routed_expert_hidden_size=None, latent_moe_use_norm=False, num_shared_experts=0,
            first_k_dense_replace=2),
    }
    ids = torch.randint(0, base["vocab_size"], (2, 130), generator=torch.Generator().manual_seed(4))  # [2, 130]
    for label, over in variants.items():
        cfg = k3.K3Config.from_dict({**base, **over})
        model = k3.K3ForCausalLM(cfg)
        k3.init_weights(model, seed=0)
        model.eval()
        with torch.no_grad():
            model.set_kda_mode("recurrent")
            l_r = model(ids)  # [2, 130, V]
            model.set_kda_mode("chunk")
            l_c = model(ids)  # [2, 130, V]
        model.train()
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        r = rel(l_c, l_r)
        ok = r <= TOL and bool(torch.isfinite(loss))
        if not ok:
            failures.append(f"variant {label}")
        print(f"  {label:<52s} chunk vs recurrent rel {r:.2e}, loss {loss.item():.3f}  {'ok' if ok else 'FAIL'}")

    # bf16 autocast (how the GPU training runs; the KDA core and the router stay float32 inside it). On a freshly
    # initialised model: the random fixtures are chaotic on purpose (sharp router and head gains), so bf16 rounding
    # flips their routing layer after layer and their logits say nothing about the autocast path.
    cfg = k3.K3Config.from_dict(base)
    model = k3.K3ForCausalLM(cfg)
    k3.init_weights(model, seed=1)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids[:, :-1])  # [2, 129, V]
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    with torch.no_grad():
        ref = model.eval()(ids[:, :-1])  # [2, 129, V]
    r = rel(logits.detach().float(), ref)
    ok = bool(torch.isfinite(loss)) and r < 5e-2
    if not ok:
        failures.append("bf16 autocast")
    print(f"  bf16 autocast forward + backward: loss {loss.item():.3f}, logits vs float32 rel {r:.2e} "
          f"(bf16 rounding)  {'ok' if ok else 'FAIL'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reference prompts only")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for name in ("k3-tiny", "k3-small"):
        check_fixture(name)
    if not args.quick:
        check_kda_forms()
        check_mxfp4_and_save()
        check_config_variants()
    if failures:
        print(f"FAILED: {', '.join(failures)}")
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
