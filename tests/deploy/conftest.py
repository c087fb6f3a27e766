"""Shared helpers of the deployment tests: the real checkers from ``scripts/deploy-tools.sh``.

``make test`` installs them into ``build/tools`` first; a missing tool fails the test with the
command that installs it (the checks are the point of these tests, so they never skip).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "build" / "tools"
CHART = ROOT / "helm" / "spin"
K8S_VERSIONS = ("1.29.0", "1.32.0")
"""Kubernetes versions every rendered manifest must validate against (strictly)."""
MONITORING_APIS = ("monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PodMonitor",
                   "monitoring.coreos.com/v1/PrometheusRule")
"""``--api-versions`` that make the chart render its prometheus-operator objects."""


def tool(name: str) -> Path:
    path = TOOLS / "bin" / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `scripts/deploy-tools.sh` (make test does)")
    return path


def run(cmd: list[str | Path], **kw) -> subprocess.CompletedProcess:
    """Run a checker; on failure the assertion shows its whole output."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def helm_template(*args: str | Path, release: str = "spin", namespace: str = "serving",
                  check: bool = True) -> list[dict] | subprocess.CompletedProcess:
    """``helm template`` of the chart; the rendered objects (or, with check=False, the process)."""
    cmd = [tool("helm"), "template", release, CHART, "--namespace", namespace, *args]
    if not check:
        return subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    return [d for d in yaml.safe_load_all(run(cmd).stdout) if d]


def kubernetes_validate(docs: list[dict], tmp_path: Path, version: str) -> None:
    """Strict schema validation of plain Kubernetes objects (CRD objects are checked elsewhere)."""
    path = tmp_path / f"manifests-{version}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    run([Path(sys.executable).parent / "kubernetes-validate", "--strict", "--quiet",
         "-k", version, path])


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    """Objects of one kind by name."""
    return {d["metadata"]["name"]: d for d in docs if d.get("kind") == kind}
