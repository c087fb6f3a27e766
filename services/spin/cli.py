"""The ``spin`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .zoo.specs import BUILD_DIR, FAMILY_DIR


def _zoo_train(args: argparse.Namespace) -> int:
    from .zoo.build import STAGES, build_family
    from .zoo.specs import DEMO_FAMILY, scaled

    stages = tuple(args.stages.split(",")) if args.stages else STAGES
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        print(f"spin zoo train: unknown stages {unknown}; expected some of {list(STAGES)}",
              file=sys.stderr)
        return 2
    family = scaled(DEMO_FAMILY, args.scale) if args.scale != 1.0 else DEMO_FAMILY
    build_family(family, args.family_dir, args.build_dir, stages=stages, force=args.force)
    return 0


def _zoo_report(args: argparse.Namespace) -> int:
    from .zoo.report import ReportConfig, markdown, run_report, update_readme

    cfg = ReportConfig(family_dir=args.family_dir, prompts_per_domain=args.prompts, k=args.k,
                       new_tokens=args.new_tokens)
    report = run_report(cfg)
    table = markdown(report)
    print(table)
    _write_json(args.json, report)
    if args.readme:
        update_readme(Path(args.readme), table)
        print(f"updated {args.readme}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .client import GenerateArgs, generate

    if not args.prompt:
        print("spin generate: the prompt is empty", file=sys.stderr)
        return 2
    return generate(GenerateArgs(args.prompt, args.endpoint, args.max_tokens, args.temperature,
                                 args.top_p, args.top_k, args.seed, args.speculation, args.k,
                                 tuple(args.stop), args.steps))


def _server_config(args: argparse.Namespace):
    from .rpc.serving import ServerConfig

    return ServerConfig(host=args.host, port=args.port, metrics_port=args.metrics_port,
                        grace_s=args.grace)


def _threads(args: argparse.Namespace) -> None:
    """Pin the process to ``--cpus`` (if given), then set torch's threads: ``--threads``, else
    one per pinned core."""
    import torch

    _place(args)
    threads = args.threads or len(args.cpus or ())
    if threads:
        torch.set_num_threads(threads)


def _place(args: argparse.Namespace) -> None:
    """Pin the process to ``--cpus``, if given (before it starts threads of its own)."""
    from .cpus import pin

    if args.cpus is not None:
        pin(args.cpus)


def _runner_config(args: argparse.Namespace):
    """The model flags of ``spin verifier`` and ``spin drafter``."""
    from .engine.model_runner import RunnerConfig

    return RunnerConfig(device=args.device, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        max_model_len=args.max_model_len, max_seqs=args.max_seqs,
                        block_size=args.block_size, quantize=getattr(args, "quantize", "none"))


def _verifier(args: argparse.Namespace) -> int:
    from .verifier.server import run

    _threads(args)
    try:
        run(str(args.model), _server_config(args), _runner_config(args),
            decompose=not args.no_decompose)
    except ValueError as e:  # a device, dtype or memory budget that cannot work
        print(f"spin verifier: {e}", file=sys.stderr)
        return 2
    return 0


def _drafter(args: argparse.Namespace) -> int:
    from .drafter.server import run

    _threads(args)
    try:
        run(str(args.model), args.name, _server_config(args), _runner_config(args))
    except ValueError as e:
        print(f"spin drafter: {e}", file=sys.stderr)
        return 2
    return 0


def _router(args: argparse.Namespace) -> int:
    from .router.config import RouterConfig, SchedulerConfig
    from .router.server import run

    _place(args)
    drafters = {}
    for spec in args.drafter:
        name, sep, addr = spec.partition("=")
        if not sep or not name or not addr:
            print(f"spin router: --drafter wants NAME=HOST:PORT, got {spec!r}", file=sys.stderr)
            return 2
        drafters[name] = addr
    default = None if args.default_drafter in ("", "none", "off") else args.default_drafter
    kube = None
    if args.discovery == "kubernetes":
        from .router.discovery import KubernetesDiscoveryConfig

        if not args.label_selector:
            print("spin router: --discovery kubernetes needs --label-selector", file=sys.stderr)
            return 2
        kube = KubernetesDiscoveryConfig(args.label_selector, args.namespace, args.kube_api)
    elif not args.verifier:
        print("spin router: --verifier HOST:PORT is required (or --discovery kubernetes)",
              file=sys.stderr)
        return 2
    elif default is not None and default != "prompt-lookup" and default not in drafters:
        print(f"spin router: --default-drafter {default!r} is not one of the drafters "
              f"{sorted(drafters) + ['prompt-lookup']}", file=sys.stderr)
        return 2
    try:
        policy_config = _policy_config(args.policy_config)
    except ValueError as e:
        print(f"spin router: --policy-config: {e}", file=sys.stderr)
        return 2
    run(RouterConfig(args.verifier, str(args.tokenizer), drafters, default, args.default_k,
                     _redis_url(args.redis_url), args.policy, args.cost_model, kubernetes=kube,
                     policy_config=policy_config,
                     scheduler=SchedulerConfig(max_batch=args.max_batch, max_queue=args.max_queue,
                                     draft_timeout_s=args.draft_timeout,
                                     micro_batches=args.micro_batches,
                                     prompt_lookup=not args.no_prompt_lookup)),
        _server_config(args))
    return 0


def _policy_config(text: str | None) -> dict:
    """The JSON object of ``--policy-config``, checked against the learned policy's settings."""
    from .policy.learned import LearnedPolicy, learned_config

    if not text:
        return {}
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"needs a JSON object, got {text!r}")
    LearnedPolicy(learned_config(overrides))  # ValueError naming a bad setting or value
    return overrides


def _redis_url(url: str | None) -> str | None:
    """The statistics store URL, with $SPIN_REDIS_PASSWORD (a Kubernetes Secret) filled in."""
    from urllib.parse import quote, urlsplit, urlunsplit

    password = os.environ.get("SPIN_REDIS_PASSWORD")
    if not url or not password:
        return url
    parts = urlsplit(url)
    if parts.password:
        return url
    netloc = f"{quote(parts.username or '', safe='')}:{quote(password, safe='')}@{parts.netloc}"
    return urlunsplit(parts._replace(netloc=netloc))


def _named_models(specs: list[str], what: str) -> dict[str, str]:
    """NAME=PATH_OR_NAME flags -> {name: checkpoint} (ValueError naming the bad one)."""
    out = {}
    for spec in specs:
        name, sep, model = spec.partition("=")
        if not sep or not name or not model:
            raise ValueError(f"{what} wants NAME=PATH_OR_NAME, got {spec!r}")
        out[name] = model
    return out


def _serve(args: argparse.Namespace) -> int:
    from .serve import ServeConfig, serve

    try:
        _policy_config(args.policy_config)
        drafter_models = _named_models(args.drafter, "--drafter") if args.drafter else None
    except ValueError as e:
        print(f"spin serve: {e}", file=sys.stderr)
        return 2
    cfg = ServeConfig(family_dir=args.family_dir, host=args.host, port=args.port,
                      metrics_port=args.metrics_port,
                      drafters=args.drafters.split(",") if args.drafters else None,
                      default_drafter=args.default_drafter, default_k=args.default_k,
                      max_batch=args.max_batch, max_queue=args.max_queue,
                      redis=not args.no_redis, policy=args.policy,
                      micro_batches=args.micro_batches, cpus=args.cpus,
                      policy_config=args.policy_config,
                      drafter_quantize=args.drafter_quantize, target=args.target,
                      drafter_models=drafter_models, runner=_runner_config(args),
                      drafter_kv_cache_memory=args.drafter_kv_cache_memory)
    if args.dry_run:
        from .plan import plan_serve

        return plan_serve(cfg, args.gpu_memory)
    return serve(cfg)


def _plan(args: argparse.Namespace) -> int:
    from .plan import plan_command

    try:
        drafter_models = _named_models(args.drafter, "--drafter")
    except ValueError as e:
        print(f"spin plan: {e}", file=sys.stderr)
        return 2
    return plan_command(args.target, drafter_models, _runner_config(args),
                        args.drafter_kv_cache_memory, args.gpu_memory, args.json)


def _demo(args: argparse.Namespace) -> int:
    from .zoo.demo import demo

    demo(args.family_dir, max_tokens=args.max_tokens)
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from .bench.engine import EngineBenchConfig, run_engine_bench

    report = run_engine_bench(EngineBenchConfig(family_dir=args.family_dir, quick=args.quick))
    for domain, row in report["domains"].items():
        alone = row["target_alone_tok_s"]
        print(f"{domain:6s} target alone {alone:7.1f} tok/s | HF generate "
              f"{row['hf_generate_tok_s']:7.1f} | HF assisted best {row['hf_assisted_best_tok_s']:7.1f} "
              f"({row['hf_assisted_best_draft']}) | spec best {row['spec_best_tok_s']:7.1f} "
              f"({row['spec_best_drafter']}, k={row['spec_best_k']}, tau={row['tau']:.2f}) "
              f"= {row['spec_best_tok_s'] / alone:.2f}x alone, "
              f"{row['spec_best_tok_s'] / row['hf_generate_tok_s']:.2f}x HF generate, "
              f"{row['spec_best_tok_s'] / row['hf_assisted_best_tok_s']:.2f}x HF assisted")
        for name, best in row["spec_by_drafter"].items():
            print(f"         {name:17s} best k={best['k']} {best['tok_s']:7.1f} tok/s "
                  f"({best['tok_s'] / alone:.2f}x alone), tau {best['tau']:.2f}, "
                  f"efficiency {best['efficiency']:.2f}")
    for b, row in report["batch"].items():
        print(f"batch {b:>2s}: spec off {row['spec_off_tok_s']:7.1f} tok/s, on "
              f"{row['spec_on_tok_s']:7.1f} tok/s ({row['spec_on_tok_s'] / row['spec_off_tok_s']:.2f}x), "
              f"tau {row['tau']:.2f}, efficiency {row['efficiency']:.2f} "
              "(each request with its domain's best drafter and k)")
    print(f"efficiency at batch 1: {report['efficiency_b1']:.2f}; lossless: {report['lossless']}")
    _write_json(args.json, report)
    return 0 if report["lossless"] else 1


def _bench_attention(args: argparse.Namespace) -> int:
    import warnings

    from .bench.attention import run_attention_bench

    warnings.filterwarnings("ignore", module="torch.nn.attention.flex_attention")
    rows = run_attention_bench(compile_flex=args.compile)
    flex = "flex compiled" if args.compile else "flex eager"
    print(f"{'batch':>5} {'context':>7} {'new':>3} | {'contiguous':>10} {'paged view':>10} "
          f"{'paged gather':>12} {flex:>13} (ms per layer, medians; flex's first call s)")
    for r in rows:
        view = f"{r['paged_view_ms']:10.3f}" if "paged_view_ms" in r else f"{'-':>10}"
        print(f"{r['batch']:5d} {r['context']:7d} {r['new_tokens']:3d} | {r['contiguous_ms']:10.3f} "
              f"{view} {r['paged_gather_ms']:12.3f} {r['flex_ms']:13.3f} "
              f"({r['flex_first_call_s']:.1f} s)")
    _write_json(args.json, {"rows": rows, "flex_compiled": args.compile})
    return 0


def _bench_services(args: argparse.Namespace) -> int:
    from .bench.services import ServicesBenchConfig, run_services_bench

    r = run_services_bench(ServicesBenchConfig(family_dir=args.family_dir, drafter=args.drafter,
                                               k=args.k, prompts=args.prompts))
    t = r["tok_s"]
    print(f"{r['drafter']} k={r['k']}, {r['prompts']} prompts x {r['new_tokens']} tokens, "
          f"tau {r['tau']:.2f}")
    print(f"speculation on : in process {t['inproc_on']:7.1f} tok/s | services {t['rpc_on']:7.1f} "
          f"tok/s = {r['ratio_services_vs_inprocess']:.2f}x "
          f"(median per prompt {r['ratio_median_per_prompt']:.2f}x)")
    print(f"speculation off: in process {t['inproc_off']:7.1f} tok/s | services "
          f"{t['rpc_off']:7.1f} tok/s = {r['ratio_services_vs_inprocess_off']:.2f}x")
    for label, st in (("on", r["router_step_ms"]), ("off", r["router_step_ms_off"])):
        print(f"router step, speculation {label:3s} (mean of {st['steps']}): {st['step']:.2f} ms = "
              f"draft wait {st['draft_wait']:.2f} + verify wait {st['verify_wait']:.2f} "
              f"(+ bookkeeping); RPC overhead {st['rpc_overhead']:.2f} ms per step")
    print(f"in-process step with speculation: {r['inprocess_step_ms']:.2f} ms; "
          f"lossless: {r['lossless']}")
    _write_json(args.json, r)
    return 0 if r["lossless"] else 1


def _stats(args: argparse.Namespace) -> int:
    import redis

    from .stats import RedisStatsStore

    try:
        redis.Redis.from_url(args.redis_url, socket_connect_timeout=2, socket_timeout=2).ping()
    except (redis.RedisError, ValueError) as e:
        print(f"spin stats: cannot read {args.redis_url}: {e}", file=sys.stderr)
        return 2
    store = RedisStatsStore(args.redis_url, flush_interval_s=3600)
    try:
        pop = store.population()
    finally:
        store.close()
    if not pop:
        print("no statistics yet")
        return 0
    k_max = max((max(st.drafted_per_pos, default=0) for st in pop.values()), default=0)
    head = (f"{'drafter':18s} {'steps':>7s} {'drafted':>8s} {'accepted':>8s} {'rate':>5s} "
            f"{'tau':>5s} {'draft ms':>8s} {'verify ms':>9s}  acceptance by position 1..{k_max}")
    print(head)
    for name, st in sorted(pop.items()):
        per_pos = " ".join(f"{st.acceptance_at(i):.2f}" for i in range(1, k_max + 1)
                           if st.drafted_per_pos.get(i))
        print(f"{name:18s} {st.drafts:7d} {st.draft_tokens:8d} {st.accepted_tokens:8d} "
              f"{st.acceptance_rate:5.2f} {st.mean_accepted_length:5.2f} "
              f"{1e3 * st.draft_seconds / max(st.drafts, 1):8.2f} "
              f"{1e3 * st.verify_seconds / max(st.drafts, 1):9.2f}  {per_pos}")
    print("rate = accepted / drafted tokens; tau = 1 + accepted / steps (vLLM's mean acceptance "
          "length, bonus token included); times are means per step")
    return 0


def _profile(args: argparse.Namespace) -> int:
    from .bench.profile import ProfileConfig, run_profile
    from .engine.model_runner import RunnerConfig

    try:
        drafter_models = _named_models(args.drafter, "--drafter") if args.drafter else None
    except ValueError as e:
        print(f"spin profile: {e}", file=sys.stderr)
        return 2
    r = run_profile(ProfileConfig(family_dir=args.family_dir, quick=args.quick, out=args.out,
                                  drafters=args.drafters.split(",") if args.drafters else None,
                                  threads=args.threads, drafter_threads=args.drafter_threads,
                                  drafter_quantize=args.drafter_quantize, target=args.target,
                                  drafter_models=drafter_models,
                                  runner=RunnerConfig(device=args.device, dtype=args.dtype)))
    print(f"wrote {r['out']} ({r['verify_points']} verify and {r['draft_points']} draft points)")
    print("fit error (MAPE): " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in r["mape"].items()))
    print("batch size -> k at acceptance 0.7: " + ", ".join(
        f"{b}: {k}" for b, k in r["k_table_at_acceptance_0.7"].items()))
    return 0


def _bench_policy(args: argparse.Namespace) -> int:
    from .bench.policy import PolicyBenchConfig, run_policy_bench

    out = Path(args.json) if args.json else None
    r = run_policy_bench(PolicyBenchConfig(family_dir=args.family_dir, quick=args.quick), out)
    g = r["goodput"]
    print(f"goodput (tok/s, one request at a time, {r['requests']} mixed requests x "
          f"{r['new_tokens']} tokens): learned {g['learned']:.1f} | best fixed {g['best_fixed']:.1f} "
          f"({g['best_fixed_config']}) | oracle {g['oracle']:.1f} | off {g['off']:.1f}")
    print(f"learned / best fixed = {g['learned'] / g['best_fixed']:.2f}x, learned / oracle = "
          f"{g['learned'] / g['oracle']:.2f}x, learned / off = {g['learned'] / g['off']:.2f}x "
          f"(best fixed and oracle chosen on other passes than they are timed on; on the same: "
          f"{g['learned'] / g['best_fixed_in_sample']:.2f}x and "
          f"{g['learned'] / g['oracle_in_sample']:.2f}x)")
    for row in r["sweep"]:
        print(f"rate {row['rate']:6.2f}/s ({row['load_fraction']:.1f} of capacity): mean latency "
              f"auto {row['auto_mean_latency_s']:.2f} s, off {row['off_mean_latency_s']:.2f} s, "
              f"best fixed {row['best_fixed_mean_latency_s']:.2f} s; auto p99 "
              f"{row['auto_p99_latency_s']:.2f} s")
    pl = r["pipeline"]
    if "skipped" in pl:
        print(f"pipeline: skipped ({pl['skipped']})")
    else:
        print(f"pipeline ({pl['requests']} concurrent requests, draft-code k=4, verifier on cores "
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
    fit, serving = r["cost_model_mape"] or {}, r["cost_model_serving_mape"]
    print("cost model error (MAPE): fit " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in fit.items())
          + (f"; serving (learned steps) {100 * serving:.1f}%" if serving is not None else ""))
    print(f"lossless mismatches {r['lossless_mismatches']}")
    if out:
        print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if r["lossless_mismatches"] == 0 else 1


def _bench_fit(args: argparse.Namespace) -> int:
    from .bench.fit import FitBenchConfig, run_fit_bench
    from .bench.profile import DEFAULT_COST_MODEL

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
    _write_json(args.json, r)
    return 0


def _bench_ab(args: argparse.Namespace) -> int:
    from .bench.ab import ABConfig, run_ab

    for flag, text in (("--a", args.a), ("--b", args.b)):
        try:
            _policy_config(text)
        except ValueError as e:
            print(f"spin bench ab: {flag}: {e}", file=sys.stderr)
            return 2
    r = run_ab(ABConfig(a=args.a, b=args.b, rounds=args.rounds, requests=args.requests,
                        seed=args.seed, family_dir=args.family_dir))
    for row in r["requests"]:
        print(f"{row['domain']:10s}  A {row['a']:.3f} s  B {row['b']:.3f} s  "
              f"prompt lookup {row['prompt_lookup']:.3f} s")
    t = r["total_s"]
    print(f"total (medians of {r['rounds']} rounds): A {t['a']:.2f} s, B {t['b']:.2f} s, prompt "
          f"lookup k=4 {t['prompt_lookup']:.2f} s; B / A = {r['b_over_a']:.3f} "
          f"(< 1: B faster); prompt lookup / A = {r['prompt_lookup_over_a']:.3f}, "
          f"/ B = {r['prompt_lookup_over_b']:.3f}")
    _write_json(args.json, r)
    return 0


def _write_json(path: str | None, report: dict) -> None:
    """Write a command's report as JSON to ``path`` (if given) and say so."""
    if path:
        Path(path).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {path}")


def _cpu_list(text: str) -> list[int]:
    from .cpus import parse_cpus

    try:
        return parse_cpus(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(kind: type) -> callable:
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _size(text: str) -> int:
    from .engine.memory import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _device(text: str) -> str:
    import re

    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def model_flags(p: argparse.ArgumentParser) -> None:
    """Where a model runs and how much KV cache it gets (verifier, drafter, serve, plan)."""
    p.add_argument("--device", type=_device, default="auto",
                   help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weights and KV cache (auto: float32 on the CPU, the checkpoint's on CUDA)")
    p.add_argument("--kv-cache-memory", type=_size, metavar="SIZE",
                   help="KV cache budget, e.g. 64MiB or 20GiB (default: 512MiB on the CPU; on "
                        "CUDA what --gpu-memory-utilization leaves after weights and activations)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9, metavar="F",
                   help="share of the GPU this process may use (CUDA; default 0.9)")
    p.add_argument("--max-model-len", type=_positive(int), metavar="N",
                   help="longest request, prompt + output (default: the model's context, or what "
                        "the KV cache holds if that is less); longer requests are refused")
    p.add_argument("--max-seqs", "--slots", dest="max_seqs", type=_positive(int), default=64,
                   help="requests held at once (no memory is set aside for them)")
    p.add_argument("--block-size", type=_positive(int), default=16, help="tokens per KV block")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spin", description="SPIN serving: speculative decoding with "
                                "a pool of heterogeneous draft models.")
    sub = p.add_subparsers(dest="command", required=True)

    zoo = sub.add_parser("zoo", help="the demo model family: build it, measure it")
    zsub = zoo.add_subparsers(dest="zoo_command", required=True)
    train = zsub.add_parser("train", help="rebuild corpus, tokenizer and every model from scratch")
    train.add_argument("--stages", help="comma-separated subset of: corpus,tokenizer,target,"
                       "distill,drafts,prompts (default: all)")
    train.add_argument("--force", action="store_true", help="redo stages whose output exists")
    train.add_argument("--scale", type=_positive(float), default=1.0,
                       help="multiply every token budget (0.01 for a smoke run)")
    train.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    train.add_argument("--build-dir", type=Path, default=BUILD_DIR)
    train.set_defaults(func=_zoo_train)

    report = zsub.add_parser("report", help="measured acceptance table and forward costs")
    report.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    report.add_argument("--prompts", type=_positive(int), default=16, help="prompts per domain")
    report.add_argument("--k", type=_positive(int), default=4, help="speculation length")
    report.add_argument("--new-tokens", type=_positive(int), default=128)
    report.add_argument("--json", help="write the full report as JSON to this file")
    report.add_argument("--readme", help="replace the report section of this README")
    report.set_defaults(func=_zoo_report)

    gen = sub.add_parser("generate", help="stream one completion from a running router")
    gen.add_argument("prompt")
    gen.add_argument("--endpoint", default="127.0.0.1:50051", help="the router (host:port)")
    gen.add_argument("--max-tokens", type=_positive(int), default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--speculation", default="auto",
                     help="auto (the router's policy), off, or a drafter name")
    gen.add_argument("--k", type=int, default=0, help="k for a named drafter (0 = router's)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--steps", action="store_true",
                     help="then print every verification step: drafter, k, accepted, ms, and "
                          "the policy's predicted ms")
    gen.set_defaults(func=_generate)

    def service(name: str, help: str, port: int, metrics_port: int | None) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.add_argument("--host", default="127.0.0.1", help="interface (0.0.0.0 in a container)")
        sp.add_argument("--port", type=int, default=port, help="gRPC port (0 = a free one)")
        sp.add_argument("--metrics-port", type=int, default=metrics_port,
                        help="Prometheus port (0 = a free one; default: none)")
        sp.add_argument("--grace", type=float, default=30.0, help="seconds to drain on SIGTERM")
        sp.add_argument("--cpus", type=_cpu_list, metavar="LIST",
                        help="run on these cores only, e.g. 1 or 0,2-3 (Linux; default: all)")
        return sp

    for role, port in (("verifier", 50061), ("drafter", 50071)):
        sp = service(role, f"the {role} service ({'target' if role == 'verifier' else 'draft'} "
                     "model)", port, None)
        sp.add_argument("--model", type=Path, required=True, help="checkpoint directory")
        model_flags(sp)
        sp.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
        if role == "drafter":
            sp.add_argument("--name", help="drafter name (default: the directory name)")
            sp.add_argument("--quantize", choices=("none", "int8"), default="none",
                            help="int8: int8 weights on CPU (faster drafts; the output is the "
                                 "target's either way, the acceptance rate may change)")
        else:
            sp.add_argument("--no-decompose", action="store_true",
                            help="one forward per batch (no splitting into sub-batches)")
        sp.set_defaults(func=_verifier if role == "verifier" else _drafter)

    rt = service("router", "the client-facing router", 50051, None)
    rt.add_argument("--verifier", help="verifier address host:port (static discovery)")
    rt.add_argument("--discovery", choices=("static", "kubernetes"), default="static",
                    help="static: --verifier/--drafter addresses; kubernetes: watch EndpointSlices "
                    "of the drafter and verifier Services (labels spin.dev/role, spin.dev/drafter)")
    rt.add_argument("--label-selector",
                    help="kubernetes discovery: EndpointSlices of this release, e.g. "
                    "app.kubernetes.io/instance=spin")
    rt.add_argument("--namespace", help="kubernetes discovery: namespace (default: $POD_NAMESPACE)")
    rt.add_argument("--kube-api", help="kubernetes discovery: API URL without credentials, e.g. "
                    "`kubectl proxy`'s http://127.0.0.1:8001 (default: in-cluster config)")
    rt.add_argument("--no-prompt-lookup", action="store_true",
                    help="do not offer prompt lookup (drafts from the request's own context)")
    rt.add_argument("--tokenizer", required=True,
                    help="the target's tokenizer: its checkpoint directory or Hugging Face name")
    rt.add_argument("--drafter", action="append", default=[], help="NAME=HOST:PORT (repeatable)")
    rt.add_argument("--default-drafter", default="prompt-lookup",
                    help="drafter of requests in mode auto ('none' = no speculation)")
    rt.add_argument("--default-k", type=_positive(int), default=4)
    rt.add_argument("--max-batch", type=_positive(int), default=32)
    rt.add_argument("--max-queue", type=_positive(int), default=256)
    rt.add_argument("--draft-timeout", type=_positive(float), default=5.0)
    rt.add_argument("--micro-batches", type=_positive(int), default=1,
                    help="micro-batches in flight (2: draft one while verifying the other)")
    rt.add_argument("--redis-url", default=os.environ.get("SPIN_REDIS_URL"),
                    help="acceptance statistics (default: $SPIN_REDIS_URL, else in process); "
                    "$SPIN_REDIS_PASSWORD supplies a password the URL lacks")
    rt.add_argument("--policy", choices=("learned", "fixed"), default="learned",
                    help="learned: per-request drafter bandit + goodput-chosen k; fixed: "
                    "--default-drafter and --default-k for every request")
    rt.add_argument("--cost-model", help="cost model file from `spin profile` (learned policy)")
    rt.add_argument("--policy-config", help="JSON object overriding learned-policy settings, e.g. "
                    "'{\"score_rounds\": 2, \"selector\": {\"ucb_c\": 0.1}}'")
    rt.set_defaults(func=_router)

    sv = sub.add_parser("serve", help="the whole system on this machine (the embedded default)")
    sv.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=50051)
    sv.add_argument("--metrics-port", type=int, default=0)
    sv.add_argument("--drafters", help="comma-separated draft models (default: all)")
    sv.add_argument("--default-drafter", default="prompt-lookup")
    sv.add_argument("--default-k", type=_positive(int), default=4)
    sv.add_argument("--max-batch", type=_positive(int), default=32)
    sv.add_argument("--max-queue", type=_positive(int), default=256)
    sv.add_argument("--no-redis", action="store_true", help="keep statistics in the router")
    sv.add_argument("--drafter-quantize", choices=("auto", "none", "int8"), default="auto",
                    help="the draft models' weights: int8 drafts faster on CPU, and the output is "
                         "the target's either way (auto: int8 where this torch has the kernels)")
    sv.add_argument("--micro-batches", type=_positive(int), default=1,
                    help="micro-batches in flight in the router (2 = pipelined)")
    sv.add_argument("--cpus", choices=("shared", "split"), default="shared",
                    help="split: the verifier on cores of its own, the drafters and the router "
                         "on the others (for --micro-batches 2 on a CPU-only machine: drafting "
                         "and verification then run at once without slowing each other)")
    sv.add_argument("--policy", choices=("learned", "fixed"), default="learned",
                    help="the router's policy (learned profiles the machine on first start)")
    sv.add_argument("--policy-config", help="JSON overrides of the learned policy's settings "
                    "(see `spin router --help`)")
    sv.add_argument("--target", help="the target: a checkpoint directory or a Hugging Face name "
                    "in the local cache (default: the demo family's target)")
    sv.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH_OR_NAME",
                    help="a draft model (repeatable; default: the demo family's draft models)")
    model_flags(sv)
    sv.add_argument("--drafter-kv-cache-memory", type=_size, metavar="SIZE",
                    help="each drafter's KV cache budget (default: its device's default: "
                         "512MiB on the CPU, its share of the GPU on CUDA)")
    sv.add_argument("--dry-run", action="store_true",
                    help="print what each service would load and hold (weights, KV bytes per "
                         "token, blocks, concurrent tokens), then exit (1 if one cannot fit)")
    sv.add_argument("--gpu-memory", type=_size, metavar="SIZE",
                    help="with --dry-run: the GPU's memory, e.g. 80GiB (to plan CUDA here)")
    sv.set_defaults(func=_serve)

    pl = sub.add_parser("plan", help="memory plan of a deployment: per service its weights, KV "
                        "bytes per token, blocks and concurrent tokens (reads configs only)")
    pl.add_argument("--target", required=True, help="the target: checkpoint directory or name")
    pl.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH_OR_NAME",
                    help="a draft model (repeatable)")
    model_flags(pl)
    pl.add_argument("--drafter-kv-cache-memory", type=_size, metavar="SIZE",
                    help="each drafter's KV cache budget (default: its device's default)")
    pl.add_argument("--gpu-memory", type=_size, metavar="SIZE",
                    help="memory of one GPU, e.g. 80GiB (CUDA plans without a GPU here)")
    pl.add_argument("--json", help="write the plan as JSON to this file")
    pl.set_defaults(func=_plan)

    bench = sub.add_parser("bench", help="benchmarks, measured side by side in one run")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    be = bsub.add_parser("engine", help="engine vs transformers, speculation on vs off")
    be.add_argument("--quick", action="store_true", help="fewer prompts and k (<= 4 min on 2 cores)")
    be.add_argument("--json", help="write the report as JSON to this file")
    be.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    be.set_defaults(func=_bench_engine)

    ba = bsub.add_parser("attention", help="attention over the paged KV cache: SDPA on a view, "
                         "on gathered blocks, FlexAttention (one layer, CPU)")
    ba.add_argument("--compile", action="store_true", help="time FlexAttention compiled")
    ba.add_argument("--json", help="write the rows as JSON to this file")
    ba.set_defaults(func=_bench_attention)

    bs = bsub.add_parser("services", help="the engine in process vs through the gRPC services")
    bs.add_argument("--drafter", default="draft-code")
    bs.add_argument("--k", type=_positive(int), default=4)
    bs.add_argument("--prompts", type=_positive(int), default=6)
    bs.add_argument("--json", help="write the report as JSON to this file")
    bs.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bs.set_defaults(func=_bench_services)

    st = sub.add_parser("stats", help="acceptance statistics of the population (Redis) as a table")
    st.add_argument("--redis-url", required=True, help="e.g. redis://127.0.0.1:6379/0")
    st.set_defaults(func=_stats)

    pr = sub.add_parser("profile", help="measure step times and fit the cost model")
    pr.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    pr.add_argument("--quick", action="store_true", help="a smaller grid (about a minute)")
    pr.add_argument("--drafters", help="comma-separated draft models (default: all)")
    pr.add_argument("--out", type=Path, default=BUILD_DIR.parent / "cost_model.json")
    pr.add_argument("--threads", type=int, default=0,
                    help="torch threads when timing verification, as the verifier serves (0 = default)")
    pr.add_argument("--drafter-threads", type=int, default=0,
                    help="torch threads when timing drafters, as each drafter serves (0 = default)")
    pr.add_argument("--drafter-quantize", choices=("none", "int8"), default="none",
                    help="the draft models' weights, as the drafters serve them")
    pr.add_argument("--target", help="the target's checkpoint (default: the family's)")
    pr.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH_OR_NAME",
                    help="a draft model to profile (repeatable; default: the family's)")
    pr.add_argument("--device", type=_device, default="auto", help="as the services run")
    pr.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                    default="auto", help="as the services run")
    pr.set_defaults(func=_profile)

    bp = bsub.add_parser("policy", help="learned policy vs fixed drafters, off and the oracle")
    bp.add_argument("--quick", action="store_true", help="fewer requests and rates (<= 12 min)")
    bp.add_argument("--json", help="write the report here (and the latency plot beside it)")
    bp.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bp.set_defaults(func=_bench_policy)

    bf = bsub.add_parser("fit", help="how well prompt agreement picks the drafter that fits a "
                         "request (the learned policy's prompt fit)")
    bf.add_argument("--prompts", type=_positive(int), default=0,
                    help="held-out prompts, spread over the domains (default: all)")
    bf.add_argument("--new-tokens", type=_positive(int), default=64)
    bf.add_argument("--cost-model", type=Path, default=None,
                    help="cost model file from `spin profile` (default: build/cost_model.json "
                         "when it exists): ranks by goodput and reports goodput lost")
    bf.add_argument("--json", help="write the report as JSON to this file")
    bf.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bf.set_defaults(func=_bench_fit)

    ab = bsub.add_parser("ab", help="two learned-policy settings side by side, request by request")
    ab.add_argument("--a", default="{}", help="setting A: JSON overrides (like --policy-config)")
    ab.add_argument("--b", default="{}", help="setting B: JSON overrides")
    ab.add_argument("--rounds", type=_positive(int), default=3, help="passes (per-request medians)")
    ab.add_argument("--requests", type=_positive(int), default=9, help="mixed workload size")
    ab.add_argument("--seed", type=int, default=0, help="seed of the mixed workload")
    ab.add_argument("--json", help="write the report as JSON to this file")
    ab.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    ab.set_defaults(func=_bench_ab)

    demo = sub.add_parser("demo", help="the family on held-out prompts, with per-drafter acceptance")
    demo.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    demo.add_argument("--max-tokens", type=_positive(int), default=96)
    demo.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command in ("verifier", "drafter", "router"):  # a service: its log says what it runs
        import logging

        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "temperature", 0.0) < 0:
        parser().error("--temperature must be >= 0")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
