"""One ``spin bench gpu`` run's state (``Run``): device, dtype, the report so far and the time
budgets; the parts (``gpu.py``, ``gpu_serving.py``) record into it."""

from __future__ import annotations

import datetime as dt
import json
import time
import traceback
from collections.abc import Callable

import torch
import transformers

from ..engine.memory import format_size, resolve_device, resolve_dtype
from .gpu_config import GpuBenchConfig
from .gpu_report import bars
from .gpu_runner import RunnerSpec, release_memory
from .gpu_shapes import Budget

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class Run:
    """One run's state: device, dtype, the report so far and the whole run's budget."""

    def __init__(self, cfg: GpuBenchConfig, say: Callable[[str], None]) -> None:
        self.cfg, self.say = cfg, say
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device, torch.bfloat16)
        self.dtype_name = DTYPE_NAMES[self.dtype]
        self.total = Budget(cfg.budget_s)
        self.budgets: dict[str, Budget] = {}
        self.report: dict = {"meta": meta(self.device, self.dtype_name, cfg), "parts": {}}

    def part(self, name: str) -> dict:
        """The report entry of part ``name`` (created on first use)."""
        return self.report["parts"].setdefault(name, {"status": "ok", "wall_s": 0.0,
                                                      "errors": []})

    def budget(self, name: str) -> Budget:
        """Part ``name``'s budget, from its first use on (capped by what the run has left)."""
        if name not in self.budgets:
            self.budgets[name] = Budget(min(self.cfg.part_budgets_s[name], self.total.left()))
        return self.budgets[name]

    def timed(self, name: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` as (a section of) part ``name``: its wall time added, an exception
        recorded (the part marked ``error``), the report written."""
        entry = self.part(name)
        start = time.perf_counter()
        try:
            fn()
        except Exception as e:  # a part's failure is a result: record it and go on
            entry["status"] = "error"
            entry["errors"].append(f"{type(e).__name__}: {e}"[:4000])
            self.say(f"[{name}] error: {type(e).__name__}: {e}\n"
                     + "".join(traceback.format_exception(e)[-4:]))
        finally:
            entry["wall_s"] += time.perf_counter() - start
            release_memory()
            self.write()

    def skip(self, name: str, why: str) -> None:
        self.part(name).update(status="skipped", reason=why)
        self.say(f"[{name}] skipped: {why}")

    def runner_spec(self, kv: int, max_seqs: int = 64) -> RunnerSpec:
        return RunnerSpec(str(self.device), self.dtype_name, kv, self.cfg.max_model_len, max_seqs)

    def write(self) -> None:
        """The report with its bars so far, to ``cfg.json_path`` (if set)."""
        self.report["bars"] = bars(self.report)
        path = self.cfg.json_path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.report, indent=1, default=str))


def meta(device: torch.device, dtype: str, cfg: GpuBenchConfig) -> dict:
    """Where and when the run ran."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {"device": str(device), "device_name": name, "dtype": dtype,
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__,
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "config": cfg.as_dict()}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out["gpu_memory"] = {"total": format_size(total), "free_at_start": format_size(free)}
    return out


