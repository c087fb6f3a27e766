"""``spin bench``: benchmarks, each measured side by side in one run."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..zoo.specs import FAMILY_DIR
from .bench_gpu import add_gpu
from .bench_grid import add_dataset, add_grid, add_rates, add_trace
from .bench_learned import add_learned
from .bench_prefix import add_prefix
from .bench_prediction import add_prediction
from .bench_structured import add_structured
from .bench_suffix import add_suffix
from .flags import fail, policy_overrides, positive, write_json


def add_bench(sub: argparse._SubParsersAction) -> None:
    """``spin bench engine|attention|steps|services|api|policy|sweep|fit|ab|learned|dataset|
    grid|rates|trace|gpu|suffix|prefix|structured|prediction``."""
    bench = sub.add_parser("bench", help="benchmarks, measured side by side in one run")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for add in (_add_engine, _add_attention, _add_services, _add_api, _add_policy, _add_sweep,
                _add_fit, _add_ab, add_learned, add_dataset, add_grid, add_rates, add_trace,
                add_gpu, add_suffix, add_prefix, add_structured, add_prediction):
        add(bsub)


def _add_engine(bsub: argparse._SubParsersAction) -> None:
    be = bsub.add_parser("engine", help="engine vs transformers (generate, prompt lookup, "
                         "assisted), each chosen on tuning prompts and timed on evaluation ones")
    be.add_argument("--quick", action="store_true",
                    help="fewer prompts, k and grid values (about 2.5 min on 2 idle cores)")
    be.add_argument("--json", help="write the report as JSON to this file")
    be.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    be.set_defaults(func=_bench_engine)


def _add_attention(bsub: argparse._SubParsersAction) -> None:
    ba = bsub.add_parser("attention", help="attention over the paged KV cache: SDPA on a view, "
                         "on gathered blocks, FlexAttention (one layer, CPU)")
    ba.add_argument("--compile", action="store_true", help="time FlexAttention compiled")
    ba.add_argument("--json", help="write the rows as JSON to this file")
    ba.set_defaults(func=_bench_attention)
    bt = bsub.add_parser("steps", help="a decode step of each demo model: eager vs bucketed vs "
                         "compiled (CUDA graphs on CUDA)")
    bt.add_argument("--models", default="draft-general,target",
                    help="comma-separated demo family members")
    bt.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    bt.add_argument("--device", default="cpu")
    bt.add_argument("--json", help="write the rows as JSON to this file")
    bt.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bt.set_defaults(func=_bench_steps)


def _add_services(bsub: argparse._SubParsersAction) -> None:
    bs = bsub.add_parser("services", help="the engine in process vs through the gRPC services")
    bs.add_argument("--drafter", default=None,
                    help="a drafter of the family (default: its first draft model, by name)")
    bs.add_argument("--k", type=positive(int), default=4)
    bs.add_argument("--prompts", type=positive(int), default=6)
    bs.add_argument("--colocate", action="store_true",
                    help="also a deployment with the drafter inside the verifier (spin serve "
                         "--colocate), against the engine in process again")
    bs.add_argument("--json", help="write the report as JSON to this file")
    bs.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bs.set_defaults(func=_bench_services)


def _add_api(bsub: argparse._SubParsersAction) -> None:
    ba = bsub.add_parser("api", help="single streams through the gRPC API vs the HTTP API")
    ba.add_argument("--prompts", type=positive(int), default=8)
    ba.add_argument("--rounds", type=positive(int), default=3)
    ba.add_argument("--json", help="write the report as JSON to this file")
    ba.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    ba.set_defaults(func=_bench_api)


def _bench_api(args: argparse.Namespace) -> int:
    from ..bench.api import ApiBenchConfig, run_api_bench

    r = run_api_bench(ApiBenchConfig(family_dir=args.family_dir, prompts=args.prompts,
                                     rounds=args.rounds))
    print(f"{r['prompts']} prompts x {r['rounds']} rounds x {r['new_tokens']} tokens, single "
          f"stream, greedy, speculation auto")
    print(f"gRPC {r['tok_s_grpc']:.1f} tok/s | HTTP (SSE) {r['tok_s_http']:.1f} tok/s = "
          f"{r['ratio_http_vs_grpc']:.3f}x (median per prompt {r['ratio_median_per_prompt']:.3f}x)"
          f"; same tokens: {r['same_tokens']}")
    write_json(args.json, r)
    return 0 if r["same_tokens"] else 1


def _add_policy(bsub: argparse._SubParsersAction) -> None:
    bp = bsub.add_parser("policy", help="learned policy vs every fixed drafter and k, and off")
    bp.add_argument("--quick", action="store_true",
                    help="fewer requests, k values and rates (about 25 min on 2 cores)")
    bp.add_argument("--json", help="write the report here (and the latency plot beside it)")
    bp.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bp.set_defaults(func=_bench_policy)


def _add_sweep(bsub: argparse._SubParsersAction) -> None:
    bs = bsub.add_parser("sweep", help="spin bench policy's load sweep alone (auto vs off under "
                         "Poisson load), on the tuning split, with policy settings to try")
    bs.add_argument("--split", choices=("tuning", "evaluation"), default="tuning",
                    help="prompts to send (default tuning: evaluation is what spin bench policy "
                         "times)")
    bs.add_argument("--fractions", type=_fractions, default=None,
                    help="rates as fractions of the batched capacity of speculation off, comma "
                         "separated (default: spin bench policy --quick's 0.25,0.5,1,2)")
    bs.add_argument("--policy-config", default="{}",
                    help="JSON overrides of the learned policy (like spin serve's)")
    bs.add_argument("--json", help="write the report as JSON to this file")
    bs.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bs.set_defaults(func=_bench_sweep)


def _fractions(text: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text!r}") from None
    if not out or any(not 0 < f <= 10 for f in out):
        raise argparse.ArgumentTypeError(f"fractions must be in (0, 10], got {text!r}")
    return out


def _add_fit(bsub: argparse._SubParsersAction) -> None:
    bf = bsub.add_parser("fit", help="how well prompt agreement picks the drafter that fits a "
                         "request (the learned policy's prompt fit)")
    bf.add_argument("--prompts", type=positive(int), default=0,
                    help="held-out prompts, spread over the domains (default: all)")
    bf.add_argument("--new-tokens", type=positive(int), default=64)
    bf.add_argument("--cost-model", type=Path, default=None,
                    help="cost model file from `spin profile` (default: build/cost_model.json "
                         "when it exists): ranks by goodput and reports goodput lost")
    bf.add_argument("--json", help="write the report as JSON to this file")
    bf.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bf.set_defaults(func=_bench_fit)


def _add_ab(bsub: argparse._SubParsersAction) -> None:
    ab = bsub.add_parser("ab", help="two learned-policy settings side by side, request by request")
    ab.add_argument("--a", default="{}", help="setting A: JSON overrides (like --policy-config)")
    ab.add_argument("--b", default="{}", help="setting B: JSON overrides")
    ab.add_argument("--rounds", type=positive(int), default=3, help="passes (per-request medians)")
    ab.add_argument("--requests", type=positive(int), default=9, help="mixed workload size")
    ab.add_argument("--seed", type=int, default=0, help="seed of the mixed workload")
    ab.add_argument("--sampled", action="store_true",
                    help="the sampled workload (temperature 0.8, top-p 0.95, seeded) instead "
                         "of greedy")
    ab.add_argument("--json", help="write the report as JSON to this file")
    ab.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    ab.set_defaults(func=_bench_ab)


def _bench_engine(args: argparse.Namespace) -> int:
    from ..bench.engine import EngineBenchConfig, run_engine_bench

    cfg = (EngineBenchConfig.quick_preset(family_dir=args.family_dir) if args.quick
           else EngineBenchConfig(family_dir=args.family_dir))
    r = run_engine_bench(cfg)
    print(f"chosen on the tuning prompts, timed on the evaluation prompts (disjoint documents); "
          f"{r['new_tokens']} tokens each, greedy, batch 1")
    for domain, row in r["domains"].items():
        c, ev, x = row["chosen"], row["evaluation"], row["ratios"]
        a = c["hf_assisted"]
        print(f"{domain:6s} spin {ev['spin_tok_s']:7.1f} tok/s ({c['spin']['drafter']}, "
              f"k={c['spin']['k']}, tau {ev['spin_tau']:.2f}) = {x['vs_target_alone']:.2f}x "
              f"target alone ({ev['target_alone_tok_s']:.1f}), {x['vs_hf_generate']:.2f}x HF "
              f"generate ({ev['hf_generate_tok_s']:.1f}), {x['vs_hf_prompt_lookup']:.2f}x HF "
              f"prompt lookup ({ev['hf_prompt_lookup_tok_s']:.1f}, N="
              f"{c['hf_prompt_lookup']['prompt_lookup_num_tokens']}), {x['vs_hf_assisted']:.2f}x "
              f"HF assisted ({ev['hf_assisted_tok_s']:.1f}, {a['draft']} {a['name']})")
        t = row["tuning"]
        print(f"       tuning: target alone {t['target_alone_tok_s']:.1f}, HF generate "
              f"{t['hf_generate_tok_s']:.1f}; HF prompt lookup by N: "
              + ", ".join(f"{n} {v:.1f}" for n, v in t["hf_prompt_lookup"].items()))
        for name, by_k in t["spin"].items():
            print(f"         spin {name:17s} " + ", ".join(
                f"k={k} {v['tok_s']:.1f} (tau {v['tau']:.2f}, eff {v['efficiency']:.2f})"
                for k, v in by_k.items()))
        for name, by_setting in t["hf_assisted"].items():
            print(f"         HF assisted {name:17s} "
                  + ", ".join(f"{s} {v:.1f}" for s, v in by_setting.items()))
    for b, row in r["batch"].items():
        print(f"batch {b:>2s}: spec off {row['spec_off_tok_s']:7.1f} tok/s, on "
              f"{row['spec_on_tok_s']:7.1f} tok/s ({row['spec_on_tok_s'] / row['spec_off_tok_s']:.2f}x), "
              f"tau {row['tau']:.2f}, efficiency {row['efficiency']:.2f} "
              "(evaluation prompts, each request with its domain's chosen drafter and k)")
    if r["efficiency_b1"] is not None:
        print(f"efficiency at batch 1: {r['efficiency_b1']:.2f}")
    print(f"lossless: {r['lossless']}"
          + (f" (differed: {r['lossless_mismatches']})" if not r["lossless"] else "")
          + f"; HF lossless (prompt lookup and assisted = HF generate): {r['hf_lossless']}"
          + (f" (differed: {r['hf_mismatches']})" if not r["hf_lossless"] else ""))
    write_json(args.json, r)
    return 0 if r["lossless"] else 1


def _bench_steps(args: argparse.Namespace) -> int:
    from ..bench.steps import run_steps_bench

    rows = run_steps_bench(args.family_dir, tuple(args.models.split(",")),
                           tuple(int(b) for b in args.batches.split(",")), device=args.device)
    write_json(args.json, {"rows": rows, "device": args.device})
    return 0


def _bench_attention(args: argparse.Namespace) -> int:
    import warnings

    from ..bench.attention import run_attention_bench

    warnings.filterwarnings("ignore", module="torch.nn.attention.flex_attention")
    rows = run_attention_bench(compile_flex=args.compile)
    flex = "flex compiled" if args.compile else "flex eager"
    print(f"{'batch':>5} {'context':>7} {'new':>3} | {'contiguous':>10} {'paged view':>10} "
          f"{'paged gather':>12} {flex:>13} {'paged ' + flex:>19} (ms per layer, medians; "
          "flex's first call s; paged flex: plan ms per forward, max diff from gather)")
    for r in rows:
        view = f"{r['paged_view_ms']:10.3f}" if "paged_view_ms" in r else f"{'-':>10}"
        print(f"{r['batch']:5d} {r['context']:7d} {r['new_tokens']:3d} | {r['contiguous_ms']:10.3f} "
              f"{view} {r['paged_gather_ms']:12.3f} {r['flex_ms']:13.3f} "
              f"({r['flex_first_call_s']:.1f} s) {r['paged_flex_ms']:11.3f} "
              f"({r['paged_flex_first_call_s']:.1f} s; plan {r['paged_flex_plan_ms']:.2f} ms, "
              f"diff {r['paged_flex_err']:.1e})")
    write_json(args.json, {"rows": rows, "flex_compiled": args.compile})
    return 0


def _bench_services(args: argparse.Namespace) -> int:
    from ..bench.services import ServicesBenchConfig, run_services_bench, summary

    r = run_services_bench(ServicesBenchConfig(family_dir=args.family_dir, drafter=args.drafter,
                                               k=args.k, prompts=args.prompts,
                                               colocate=args.colocate))
    print(summary(r))
    write_json(args.json, r)
    return 0 if r["lossless"] and r.get("colocated", r)["lossless"] else 1


def _bench_policy(args: argparse.Namespace) -> int:
    from ..bench.policy import PolicyBenchConfig, run_policy_bench

    out = Path(args.json) if args.json else None
    r = run_policy_bench(PolicyBenchConfig(family_dir=args.family_dir, quick=args.quick), out)
    print(f"{r['requests']} requests of the evaluation split ({', '.join(r['domains'])}) x "
          f"{r['new_tokens']} tokens, one at a time")
    for name, cold in r["cold_start"].items():
        print(f"cold start, {name} (fresh deployment, empty Redis): learned "
              f"{cold['learned']:.1f} tok/s, off {cold['off']:.1f}"
              + (f"; {cold['cold_over_warm']:.2f}x of the learned policy warmed on tuning prompts"
                 if "cold_over_warm" in cold else ""))
    for name, g in r["goodput"].items():
        ks = g["ks"]
        print(f"goodput, {name} (temperature {g['temperature']}, top-p {g['top_p']}; fixed k "
              f"{ks[0]}..{ks[-1]} ({len(ks)} values) with the policy's early stopping): learned "
              f"{g['learned']:.1f} tok/s | best fixed {g['best_fixed']:.1f} "
              f"({g['best_fixed_config']}) | per-request best fixed "
              f"{g['per_request_best_fixed']:.1f} | off {g['off']:.1f}")
        print(f"  learned / best fixed = {g['learned_over_best_fixed']:.3f}x, learned / "
              f"per-request best fixed = {g['learned_over_per_request_best_fixed']:.3f}x, "
              f"learned / off = {g['learned'] / g['off']:.2f}x (the best configurations chosen "
              f"on other passes than they are timed on; on the same: "
              f"{g['learned'] / g['best_fixed_in_sample']:.3f}x and "
              f"{g['learned'] / g['per_request_best_fixed_in_sample']:.3f}x); its first pass "
              f"alone / best fixed = {g['learned_first_pass_over_best_fixed']:.3f}x")
    sw = r["sweep"]
    print(f"load: batched capacity of speculation off {sw['capacity_req_s']:.2f} req/s "
          f"({sw['capacity_tokens_s']:.0f} tok/s), {sw['requests_per_rate']} requests per rate")
    for row in sw["rates"]:
        print(f"  rate {row['rate']:6.2f}/s ({row['load_fraction']:.2f}x capacity): latency mean "
              f"auto {row['auto_mean_latency_s']:.2f} s / off {row['off_mean_latency_s']:.2f} s, "
              f"p99 auto {row['auto_p99_latency_s']:.2f} s / off {row['off_p99_latency_s']:.2f} s"
              f"{'' if row['auto_not_worse'] else '  (auto worse)'}")
    pl = r["pipeline"]
    if "skipped" in pl:
        print(f"pipeline: skipped ({pl['skipped']})")
    else:
        print(f"pipeline ({pl['requests']} concurrent requests, {pl['drafter']} k=4, verifier on cores "
              f"{pl['cpus']['verifier']}, drafter and routers on "
              f"{pl['cpus']['drafters_and_routers']}): step {1e3 * pl['step_s']:.1f} ms with two "
              f"micro-batches vs {1e3 * pl['step_s_unpipelined']:.1f} ms with one (draft "
              f"{1e3 * pl['draft_s']:.1f} ms, "
              f"verify {1e3 * pl['verify_s']:.1f} ms: step / max = "
              f"{pl['step_s'] / pl['max_draft_verify_s']:.2f}); {pl['tokens_per_s_on']:.1f} vs "
              f"{pl['tokens_per_s_off']:.1f} tok/s; on shared cores "
              f"{pl['tokens_per_s_shared_cores']['two']:.1f} vs "
              f"{pl['tokens_per_s_shared_cores']['one']:.1f} tok/s")
    dc = r["decomposition"]
    print(f"decomposition (15 decoding + 1 prefilling request): step {1e3 * dc['on']['step_s']:.1f} ms "
          f"in {dc['on']['forwards']} forwards, padding {100 * dc['on']['padded_fraction']:.0f}% vs "
          f"{1e3 * dc['off']['step_s']:.1f} ms in one, padding {100 * dc['off']['padded_fraction']:.0f}%")
    fit = r["cost_model_mape"] or {}
    serving = {n: g["cost_model_serving_mape"] for n, g in r["goodput"].items()
               if g["cost_model_serving_mape"] is not None}
    print("cost model error (MAPE): fit " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in fit.items())
          + "".join(f"; serving, {n} {100 * v:.1f}%" for n, v in serving.items()))
    print(f"lossless mismatches {r['lossless_mismatches']}")
    if out:
        print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if r["lossless_mismatches"] == 0 else 1


def _bench_fit(args: argparse.Namespace) -> int:
    from ..bench.fit import FitBenchConfig, run_fit_bench
    from ..bench.profile import DEFAULT_COST_MODEL

    cost = args.cost_model
    if cost is None and DEFAULT_COST_MODEL.exists():
        cost = DEFAULT_COST_MODEL
    r = run_fit_bench(FitBenchConfig(family_dir=args.family_dir, prompts=args.prompts,
                                     new_tokens=args.new_tokens, cost_model=cost))
    print(f"{r['prompts']} held-out prompts; which drafter has the best acceptance on the "
          f"target's output, picked by "
          + (f"(goodput lost: cost model {cost}):" if cost else "(no cost model):"))
    for signal, v in r["signals"].items():
        switched = f" ({v['switched']} switched)" if "switched" in v else ""
        if "scorers_per_prompt" in v:  # the replayed prompt fit: drafters that scored a prompt
            switched += f", {v['scorers_per_prompt']:.2f} scorers per prompt"
        good = (f", mean goodput lost {100 * v['mean_goodput_lost']:.1f}%"
                if "mean_goodput_lost" in v else "")
        print(f"  {signal:24s} {v['hits']:4d} hits, mean acceptance lost "
              f"{v['mean_acceptance_lost']:.3f}{good}{switched}")
    print("acceptance (greedy agreement with the target's output): all requests | requests the "
          "drafter fits best by prompt")
    for name, v in r["acceptance"].items():
        fit = "-" if v["best_fit"] is None else f"{v['best_fit']:.2f}"
        print(f"  {name:18s} {v['all']:.2f} | {fit} ({v['best_fit_requests']} requests)")
    dw = r["deficit_weight"]
    slope = "-" if dw["slope"] is None else f"{dw['slope']:.2f}"
    print(f"deficit weight: output acceptance lost per point of prompt agreement behind the best "
          f"fit {slope} (through the origin, {dw['points']} drafters < {dw['within']} behind); "
          "the prompt fit replayed at each weight:")
    for w, v in dw["replay"].items():
        good = (f", mean goodput lost {100 * v['mean_goodput_lost']:.2f}%"
                if "mean_goodput_lost" in v else "")
        print(f"  {w:>4s}: {v['hits']} hits, mean acceptance lost "
              f"{v['mean_acceptance_lost']:.3f}{good}")
    write_json(args.json, r)
    return 0


def _bench_sweep(args: argparse.Namespace) -> int:
    from ..bench.policy_config import PolicyBenchConfig
    from ..bench.policy_sweep import run_sweep_bench

    try:
        overrides = policy_overrides(args.policy_config)
    except ValueError as e:
        return fail("bench sweep", f"--policy-config: {e}")
    r = run_sweep_bench(PolicyBenchConfig(family_dir=args.family_dir, quick=True), args.split,
                        args.fractions, overrides)
    print(f"{r['split']} split, {r['requests_per_rate']} requests per rate, greedy; batched "
          f"capacity of speculation off {r['capacity_req_s']:.2f} req/s")
    for row in r["rates"]:
        print(f"{row['load_fraction']:4.2f}x ({row['rate']:5.2f} req/s): auto / off mean latency "
              f"{row['auto_mean_latency_s'] / row['off_mean_latency_s']:.3f} "
              f"({row['auto_mean_latency_s']:.2f} / {row['off_mean_latency_s']:.2f} s), p99 "
              f"{row['auto_p99_latency_s'] / row['off_p99_latency_s']:.3f} "
              f"({row['auto_p99_latency_s']:.2f} / {row['off_p99_latency_s']:.2f} s)")
    print(f"lossless mismatches: {r['lossless_mismatches']}")
    write_json(args.json, r)
    return 0 if r["lossless_mismatches"] == 0 else 1


def _bench_ab(args: argparse.Namespace) -> int:
    from ..bench.ab import ABConfig, run_ab
    from ..bench.policy_config import GREEDY, SAMPLED

    for flag, text in (("--a", args.a), ("--b", args.b)):
        try:
            policy_overrides(text)
        except ValueError as e:
            return fail("bench ab", f"{flag}: {e}")
    r = run_ab(ABConfig(a=args.a, b=args.b, rounds=args.rounds, requests=args.requests,
                        seed=args.seed, family_dir=args.family_dir,
                        sampling=SAMPLED if args.sampled else GREEDY))
    for row in r["requests"]:
        print(f"{row['domain']:10s}  A {row['a']:.3f} s  B {row['b']:.3f} s  "
              f"prompt lookup {row['prompt_lookup']:.3f} s")
    t = r["total_s"]
    print(f"total ({r['sampling']} workload, medians of {r['rounds']} rounds): A {t['a']:.2f} s, "
          f"B {t['b']:.2f} s, prompt lookup k=4 {t['prompt_lookup']:.2f} s; "
          f"B / A = {r['b_over_a']:.3f} (< 1: B faster); "
          f"prompt lookup / A = {r['prompt_lookup_over_a']:.3f}, "
          f"/ B = {r['prompt_lookup_over_b']:.3f}")
    write_json(args.json, r)
    return 0
