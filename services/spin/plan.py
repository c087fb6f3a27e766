"""Memory plans: what each service of a deployment would load and hold, from model configs alone.

``spin plan`` and ``spin serve --dry-run`` print one; ``plan_chart`` checks a Helm value set. A
plan reads ``config.json`` only, never weights, and applies the rules the model runner applies
when it loads (``engine/memory.py``), so it says what each service will do:

- weights: the model built on the meta device, every parameter once (tied embeddings once), at
  the service's dtype;
- KV cache: ``memory.kv_budget`` (blocks, concurrent tokens, max model length), or the reason
  it has none;
- GPU memory: weights + KV cache + activation reserve, which must fit
  ``gpu_memory_utilization`` x the GPU memory the service has (its GPU, or its MPS slice);
- host memory: ``HOST_OVERHEAD`` + the weights (they are loaded on the host before they move to
  the GPU), and on the CPU also the KV cache and activations. ``plan_chart`` compares it with the
  pod's memory limit.

The device is taken literally (planning for CUDA works without a GPU): ``auto`` is CUDA when the
GPU's memory is given (``--gpu-memory``), else the CPU. On one GPU shared by every service (``spin
plan``, ``spin serve``) the verifier's budget comes from ``VERIFIER_GPU_SHARE`` of
``--gpu-memory-utilization`` and each drafter's from an equal part of the rest, as ``spin serve``
passes them.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .engine.memory import ModelShape, format_size, kv_budget, parse_size, resolve_dtype
from .engine.model_runner import SUPPORTED, RunnerConfig
from .engine.quant import resolve as resolve_quantization
from .serve import (VERIFIER_GPU_SHARE, ServeConfig, colocated_names, drafter_quantization,
                    models, service_runner)

HOST_OVERHEAD = {"cpu": 512 << 20, "cuda": 2 << 30}
"""Host memory of a service process besides its model (bytes): Python, torch, gRPC, and on CUDA
the driver's and libraries' host side. Measured on the CPU: 254 MiB after the imports, 390 MiB
with the demo target loaded (less its weights); CUDA adds about a GiB of libraries."""


@dataclass
class ServicePlan:
    """One service's memory (bytes), or why it cannot run (``error``)."""

    service: str
    """'verifier' or 'drafter-<name>'."""
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    quantize: str = "none"
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    kv_cache_bytes: int = 0
    num_blocks: int = 0
    block_size: int = 0
    max_model_len: int = 0
    max_seqs: int = 0
    activation_bytes: int = 0
    """Reserve for the largest forward's activations (``ModelShape.activation_bytes``)."""
    device_bytes: int = 0
    """GPU memory it needs (0 on the CPU)."""
    device_limit_bytes: int | None = None
    """GPU memory it may use: its utilization x its GPU memory (its GPU or MPS slice)."""
    gpu_share: str = ""
    """How it got its GPU memory, in words."""
    host_bytes: int = 0
    host_limit_bytes: int | None = None
    """The pod's memory limit (``plan_chart``), None when there is none."""
    error: str | None = None

    @property
    def tokens(self) -> int:
        """Token positions its KV cache holds at once (blocks x block size)."""
        return self.num_blocks * self.block_size

    @property
    def fits(self) -> bool:
        return self.error is None

    def to_json(self) -> dict:
        return {**asdict(self), "tokens": self.tokens, "fits": self.fits}


def plan_device(choice: str, gpu_memory: int | None) -> torch.device:
    """A plan's device, taken literally: 'auto' is cuda when the GPU's memory is known."""
    if choice == "auto":
        return torch.device("cuda" if gpu_memory else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", choice):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {choice!r}")
    return torch.device(choice)


def load_config(model: str | Path):
    """A checkpoint's config (a directory, its config.json, or a name in the local Hugging Face
    cache)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model))


_PARAMETERS: dict[str, int] = {}


def parameter_count(cfg) -> int:
    """Parameters of the model ``cfg`` describes (built on the meta device: no memory, no
    weights read); tied embeddings count once."""
    from transformers import AutoModelForCausalLM

    key = cfg.to_json_string(use_diff=False)
    if key not in _PARAMETERS:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
        _PARAMETERS[key] = sum(p.numel() for p in model.parameters())  # shared ones once
    return _PARAMETERS[key]


def plan_model(service: str, model: str, runner: RunnerConfig, gpu_memory: int | None = None,
               device_memory: int | None = None, host_limit: int | None = None,
               gpu_share: str = "", config: str | Path | None = None) -> ServicePlan:
    """The plan of one service loading ``model`` with ``runner``'s model flags.

    ``gpu_memory``: the GPU's memory as the process sees it (its KV budget without
    ``kv_cache_memory`` comes from it). ``device_memory``: the GPU memory the service has (its
    GPU, or its MPS slice; default ``gpu_memory``); it may use ``gpu_memory_utilization`` of it.
    ``host_limit``: the pod's memory limit. ``config``: where its config is (default: ``model``)."""
    p = ServicePlan(service, model, device=runner.device, dtype=runner.dtype,
                    quantize=runner.quantize, block_size=runner.block_size,
                    max_seqs=runner.max_seqs, host_limit_bytes=host_limit, gpu_share=gpu_share)
    try:
        device = plan_device(runner.device, gpu_memory)
        p.device = str(device)
        try:
            cfg = load_config(config or model)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read its config: {e}") from None
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"model type {cfg.model_type!r} is not supported (expected one of "
                             f"{SUPPORTED})")
        dtype = resolve_dtype(runner.dtype, device, getattr(cfg, "dtype", None))
        p.dtype = str(dtype).removeprefix("torch.")
        if runner.quantize == "int8":
            resolve_quantization("int8", device, dtype)  # the runner's rule: ValueError
        shape = ModelShape.of(cfg)
        p.weight_bytes = parameter_count(cfg) * torch.empty((), dtype=dtype).element_size()
        p.kv_bytes_per_token = shape.kv_bytes_per_token(dtype)
        p.activation_bytes = shape.activation_bytes(dtype)
        p.host_bytes = HOST_OVERHEAD[device.type] + p.weight_bytes
        if device.type == "cuda" and not gpu_memory:
            raise ValueError("planning for CUDA needs the GPU's memory (--gpu-memory SIZE)")
        budget = kv_budget(shape, dtype, device, runner.block_size, runner.kv_cache_memory,
                           p.weight_bytes, gpu_memory, runner.gpu_memory_utilization,
                           runner.max_model_len)
        p.kv_cache_bytes, p.num_blocks = budget.bytes, budget.num_blocks
        p.max_model_len = budget.max_model_len
        window = getattr(cfg, "sliding_window", None)  # the runner's rule
        if window and getattr(cfg, "use_sliding_window", True) and window < p.max_model_len:
            raise ValueError(f"sliding-window attention ({window}) shorter than the context "
                             f"({p.max_model_len}) is not supported; use --max-model-len "
                             f"{window} or less")
        if device.type == "cuda":
            p.device_bytes = p.weight_bytes + p.kv_cache_bytes + p.activation_bytes
            have = device_memory or gpu_memory
            p.device_limit_bytes = int(have * runner.gpu_memory_utilization)
            if p.device_bytes > p.device_limit_bytes:
                raise ValueError(
                    f"needs {format_size(p.device_bytes)} of GPU memory (weights, KV cache, "
                    f"activations) but may use {format_size(p.device_limit_bytes)} "
                    f"({runner.gpu_memory_utilization:g} of {format_size(have)}); give it a "
                    f"smaller KV cache")
        else:
            p.host_bytes += p.kv_cache_bytes + p.activation_bytes
        if host_limit is not None and p.host_bytes > host_limit:
            raise ValueError(f"needs {format_size(p.host_bytes)} of host memory but its memory "
                             f"limit is {format_size(host_limit)}")
    except (ValueError, OSError) as e:
        p.error = str(e)
    return p


def plan_deployment(target: str, drafter_models: dict[str, str], runner: RunnerConfig,
                    drafter_kv_cache_memory: int | None = None, gpu_memory: int | None = None,
                    drafter_quantize: str = "none") -> list[ServicePlan]:
    """The verifier and every drafter on one machine (one GPU on CUDA), with the model flags
    ``spin serve`` passes them (``serve.service_runner``): shares of ``--gpu-memory-utilization``."""
    shares = VERIFIER_GPU_SHARE, (1 - VERIFIER_GPU_SHARE) / max(1, len(drafter_models))
    out = []
    roles = [("verifier", target, shares[0], runner.kv_cache_memory, "none")]
    roles += [(f"drafter-{name}", model, shares[1], drafter_kv_cache_memory, drafter_quantize)
              for name, model in drafter_models.items()]
    for service, model, share, kv, quantize in roles:
        r = service_runner(runner, kv, share, quantize)  # as serve passes it
        utilization = r.gpu_memory_utilization
        note = ""
        if gpu_memory and plan_device(runner.device, gpu_memory).type == "cuda":
            note = (f"GPU share {utilization:g} of {format_size(gpu_memory)} "
                    f"({share:g} x --gpu-memory-utilization {runner.gpu_memory_utilization:g})")
        out.append(plan_model(service, model, r, gpu_memory, gpu_share=note))
    return out


def plan_colocated(name: str, model: str, verifier: ServicePlan, runner: RunnerConfig,
                   quantize: str, gpu_memory: int | None) -> ServicePlan:
    """A draft model inside the verifier's process (``engine/colocated.load_colocated``): a
    KV cache of as many positions as the verifier's, on its device; no process of its own."""
    r = replace(service_runner(runner, None, VERIFIER_GPU_SHARE, quantize),
                max_model_len=None, kv_cache_memory=1 << 30)
    service = f"verifier, colocated {name}"
    probe = plan_model(service, model, r, gpu_memory)
    if probe.error or not verifier.tokens:
        return probe
    p = plan_model(service, model, replace(
        r, kv_cache_memory=probe.kv_bytes_per_token * verifier.tokens,
        max_model_len=min(verifier.max_model_len, probe.max_model_len)), gpu_memory)
    p.host_bytes -= HOST_OVERHEAD[plan_device(runner.device, gpu_memory).type]
    return p


def format_plan(plans: list[ServicePlan], one_machine: bool = False) -> str:
    """The plan as text: a few lines per service, then whether everything fits (and with
    ``one_machine`` what all the services need together)."""
    lines = []
    for p in plans:
        lines.append(f"{p.service}: {p.model}")
        if p.weight_bytes or p.kv_bytes_per_token:
            quant = ", int8 weights" if p.quantize == "int8" else ""
            share = f"; {p.gpu_share}" if p.gpu_share else ""
            lines.append(f"  on {p.device} in {p.dtype}{quant}{share}")
            lines.append(f"  weights {format_size(p.weight_bytes)}; KV {p.kv_bytes_per_token} "
                         f"B/token; activation reserve {format_size(p.activation_bytes)}")
        if p.num_blocks:
            lines.append(f"  KV cache {format_size(p.kv_cache_bytes)} = {p.num_blocks} blocks x "
                         f"{p.block_size} = {p.tokens} concurrent tokens; max model len "
                         f"{p.max_model_len} ({p.tokens // p.max_model_len} requests at it, "
                         f"up to {p.max_seqs} requests held)")
            host = f"host {format_size(p.host_bytes)}" + (
                f" of its {format_size(p.host_limit_bytes)} limit" if p.host_limit_bytes else "")
            if p.device_limit_bytes:
                lines.append(f"  needs GPU {format_size(p.device_bytes)} of the "
                             f"{format_size(p.device_limit_bytes)} it may use, {host}")
            else:
                lines.append(f"  needs {host} (KV cache and activations included), no GPU")
        if p.error:
            lines.append(f"  CANNOT FIT: {p.error}")
    bad = [p.service for p in plans if not p.fits]
    if one_machine and not bad:
        gpu = sum(p.device_bytes for p in plans)
        lines.append(f"together: host {format_size(sum(p.host_bytes for p in plans))}"
                     + (f", GPU {format_size(gpu)}" if gpu else ""))
    lines.append(f"{len(plans) - len(bad)} of {len(plans)} services fit"
                 + (f"; cannot fit: {', '.join(bad)}" if bad else ""))
    return "\n".join(lines)


def plan_command(target: str, drafter_models: dict[str, str], runner: RunnerConfig,
                 drafter_kv_cache_memory: int | None, gpu_memory: int | None,
                 json_path: str | None) -> int:
    """``spin plan``: print the plan (and write it as JSON); 0 when every service fits, else 1."""
    plans = plan_deployment(target, drafter_models, runner, drafter_kv_cache_memory, gpu_memory)
    print(format_plan(plans, one_machine=True))
    if json_path:
        doc = {"fits": all(p.fits for p in plans), "gpu_memory": gpu_memory,
               "services": [p.to_json() for p in plans]}
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(p.fits for p in plans) else 1


def plan_serve(cfg: ServeConfig, gpu_memory: int | None = None) -> int:
    """``spin serve --dry-run``: print the plan of the services ``cfg`` would start; 0 when
    every service fits, else 1. ValueError for drafter weights that cannot run on the planned
    device (``serve.drafter_quantization``)."""
    target, drafter_models = models(cfg)
    quantize = drafter_quantization(cfg, plan_device(cfg.runner.device, gpu_memory))
    colocated = {n: drafter_models.pop(n) for n in colocated_names(cfg)}
    plans = plan_deployment(target, drafter_models, cfg.runner, cfg.drafter_kv_cache_memory,
                            gpu_memory, quantize)
    plans[1:1] = [plan_colocated(name, model, plans[0], cfg.runner, quantize, gpu_memory)
                  for name, model in colocated.items()]
    print(format_plan(plans, one_machine=True))
    return 0 if all(p.fits for p in plans) else 1


def plan_chart(values: dict, configs: dict[str, Path | str],
               gpu_memory: int | None = None) -> list[ServicePlan]:
    """Plans of a Helm value set's verifier and drafters (merged over ``drafterDefaults`` as the
    chart merges them) against their pods: a GPU pod has one GPU of ``gpu_memory`` (default the
    values' ``gpu.memory``), an MPS draft pod a ``1/mps.replicas`` slice of one (a process under
    MPS may see the whole GPU's memory, so its KV budget without ``kvCacheMemory`` is planned
    from the whole GPU), and every pod its ``resources.limits.memory`` of host memory.
    ``configs``: config.json (or its directory) per model, by the value's model path or its
    last component. ``extraArgs`` are not read."""
    gpu = values.get("gpu") or {}
    if gpu_memory is None and gpu.get("memory"):
        gpu_memory = parse_size(gpu["memory"])
    mps = values.get("mps") or {}
    slices = int(mps.get("replicas", 1)) if gpu.get("enabled") and mps.get("enabled") else 1
    defaults = values.get("drafterDefaults") or {}
    roles = [("verifier", values["verifier"], 1)]
    roles += [(f"drafter-{d['name']}", {**defaults, **d}, slices) for d in values["drafters"]]
    out = []
    for service, v, role_slices in roles:
        on_gpu = bool(gpu.get("enabled")) and int(v.get("gpus", 1)) > 0
        device = v.get("device") or "auto"
        if device == "auto":
            device = "cuda" if on_gpu else "cpu"
        kv, slots = v.get("kvCacheMemory"), v.get("slots")  # slots: maxSeqs' old name
        runner = RunnerConfig(device=device, dtype=v.get("dtype") or "auto",
                              kv_cache_memory=parse_size(kv) if kv else None,
                              gpu_memory_utilization=float(v.get("gpuMemoryUtilization", 0.9)),
                              max_model_len=v.get("maxModelLen"),
                              max_seqs=int(slots or v.get("maxSeqs", 64)),
                              quantize="none" if service == "verifier"
                              else v.get("quantize") or "none")
        limit = ((v.get("resources") or {}).get("limits") or {}).get("memory")
        model = str(v["model"])
        path = configs.get(model) or configs.get(Path(model).name)
        slice_memory = gpu_memory // role_slices if gpu_memory and on_gpu else None
        share = "" if not slice_memory else (
            f"an MPS slice: {format_size(slice_memory)} of a {format_size(gpu_memory)} GPU"
            if role_slices > 1 else f"a whole GPU of {format_size(gpu_memory)}")
        if path is None or (runner.device != "cpu" and not on_gpu):
            why = (f"no config given for model {model!r}" if path is None
                   else f"device {runner.device} but the pod requests no GPU")
            out.append(ServicePlan(service, model, error=why))
            continue
        p = plan_model(service, model, runner, gpu_memory if on_gpu else None, slice_memory,
                       parse_size(limit) if limit else None, share, path)
        if p.error and role_slices > 1 and kv is None and "GPU memory" in p.error:
            p.error += " (under MPS the process may see the whole GPU: set kvCacheMemory)"
        out.append(p)
    return out
