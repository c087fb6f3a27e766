"""skaffold.yaml: valid against skaffold's v4beta13 schema, every file it names exists, and what
it hands the chart (the built image through setValueTemplates, each profile's values file, the
port-forward) renders into the objects it means, with the real helm."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.conftest import CHART, ROOT, by_kind, helm_template, run

SKAFFOLD = ROOT / "skaffold.yaml"
SHARED = ROOT.parent / "shared"
SCHEMA = SHARED / "schemas" / "skaffold-v4beta13.json"
PROFILES = {None: ("docker/Dockerfile.cpu", []),
            "dev": ("docker/Dockerfile.cpu", ["helm/spin/ci/cpu-demo-values.yaml"]),
            "gpu": ("docker/Dockerfile.cuda", ["helm/spin/ci/gpu-mps-values.yaml"])}
"""Profile: (Dockerfile, values files of the release)."""
BUILT = {"repo": "registry.test/spin", "tag": "abc1234",
         "digest": "sha256:" + "0" * 64}
"""What skaffold would report for the built artifact, to fill in the templates."""
SPIN_COMPONENTS = ("router", "verifier", "drafter")


def config() -> dict:
    return yaml.safe_load(SKAFFOLD.read_text())


def check_jsonschema() -> Path:
    path = Path(sys.executable).parent / "check-jsonschema"
    if not path.exists():
        pytest.fail(f"{path} is missing: pip install -e '.[test]' (check-jsonschema)")
    return path


def schema() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (skaffold's schema lives beside the project, not in it): "
                    "clone the project next to its shared/ folder to run this check")
    assert SCHEMA.exists(), f"{SCHEMA} is missing from {SHARED}"
    return SCHEMA


def sanitize(image: str) -> str:
    """How skaffold names an artifact in template keys ("/", "." and "-" become "_")."""
    return re.sub(r"[/.\-]", "_", image)


def with_profile(cfg: dict, name: str | None) -> dict:
    """The config with one profile's JSON patches applied (add/replace/remove)."""
    cfg = copy.deepcopy(cfg)
    if name is None:
        return cfg
    (profile,) = [p for p in cfg.get("profiles", []) if p["name"] == name]
    assert set(profile) <= {"name", "patches", "portForward"}, "only patches are understood here"
    for patch in profile.get("patches", []):
        *parents, last = [int(p) if p.isdigit() else p for p in patch["path"].strip("/").split("/")]
        node = cfg
        for key in parents:
            node = node[key]
        if patch["op"] == "remove":
            del node[last]
        else:
            assert patch["op"] in ("add", "replace"), patch
            if patch["op"] == "replace":
                assert last in node if isinstance(node, dict) else last < len(node), patch
            node[last] = patch["value"]
    return cfg


def template_values(image: str) -> dict[str, str]:
    """The template variables skaffold defines for one built artifact."""
    name = sanitize(image)
    domain, _, rest = BUILT["repo"].partition("/")
    return {f"IMAGE_REPO_{name}": BUILT["repo"], f"IMAGE_TAG_{name}": BUILT["tag"],
            f"IMAGE_DIGEST_{name}": BUILT["digest"], f"IMAGE_DOMAIN_{name}": domain,
            f"IMAGE_REPO_NO_DOMAIN_{name}": rest,
            f"IMAGE_FULLY_QUALIFIED_{name}": f"{BUILT['repo']}:{BUILT['tag']}@{BUILT['digest']}"}


def fill(template: str, values: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        assert m.group(1) in values, f"{{{{.{m.group(1)}}}}} is not defined for the built artifact"
        return values[m.group(1)]
    return re.sub(r"\{\{\s*\.(\w+)\s*\}\}", one, template)


def test_valid_against_the_skaffold_schema() -> None:
    run([check_jsonschema(), "--schemafile", schema(), SKAFFOLD])


def test_schema_check_rejects_a_misspelt_key(tmp_path: Path) -> None:
    """The schema check above is strict (unknown keys fail), so passing it means something."""
    cfg = config()
    cfg["deploy"]["helm"]["releases"][0]["valueFiles"] = ["x.yaml"]  # valuesFiles, misspelt
    bad = tmp_path / "skaffold.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([str(check_jsonschema()), "--schemafile", str(schema()), str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "valueFiles" in proc.stdout + proc.stderr, proc.stdout


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_builds_and_deploys_what_exists(profile: str | None) -> None:
    cfg = with_profile(config(), profile)
    assert cfg["apiVersion"] == "skaffold/v4beta13" and cfg["kind"] == "Config"
    dockerfile, values = PROFILES[profile]
    (artifact,) = cfg["build"]["artifacts"]
    assert artifact["docker"]["dockerfile"] == dockerfile
    assert (ROOT / artifact.get("context", ".") / dockerfile).is_file()
    (release,) = cfg["deploy"]["helm"]["releases"]
    assert release["name"] == "spin"
    assert (ROOT / release["chartPath"]).resolve() == CHART.resolve()
    assert (CHART / "Chart.yaml").is_file()
    assert release.get("valuesFiles", []) == values
    for path in values:
        assert (ROOT / path).is_file(), f"{path}: the chart's values file is missing"


def test_image_is_the_charts_and_the_manifests() -> None:
    (artifact,) = config()["build"]["artifacts"]
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert artifact["image"] == chart_values["image"]["repository"]
    kustomization = yaml.safe_load((ROOT / "k8s" / "base" / "kustomization.yaml").read_text())
    assert artifact["image"] in {i["name"] for i in kustomization["images"]}


@pytest.mark.parametrize("profile", PROFILES)
def test_chart_runs_the_built_image(profile: str | None) -> None:
    """helm template with the profile's values and the setValueTemplates skaffold passes:
    every SPIN container runs exactly the image skaffold built (by tag and digest)."""
    cfg = with_profile(config(), profile)
    (artifact,) = cfg["build"]["artifacts"]
    (release,) = cfg["deploy"]["helm"]["releases"]
    values = template_values(artifact["image"])
    sets = {k: fill(v, values) for k, v in release["setValueTemplates"].items()}
    args: list[str] = []
    for path in release.get("valuesFiles", []):
        args += ["-f", str(ROOT / path)]
    for key, value in sets.items():
        args += ["--set-string", f"{key}={value}"]
    docs = helm_template(*args, release=release["name"])
    images = {c["image"] for d in by_kind(docs, "Deployment").values()
              if d["metadata"]["labels"]["app.kubernetes.io/component"] in SPIN_COMPONENTS
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {f"{BUILT['repo']}:{BUILT['tag']}@{BUILT['digest']}"}


def test_dev_profile_forwards_the_routers_grpc_port() -> None:
    cfg = with_profile(config(), "dev")
    (dev,) = [p for p in config()["profiles"] if p["name"] == "dev"]
    (forward,) = dev["portForward"]
    assert forward["resourceType"] == "service" and forward["port"] == 50051
    assert forward["localPort"] == 50051
    (release,) = cfg["deploy"]["helm"]["releases"]
    args = [a for path in release["valuesFiles"] for a in ("-f", str(ROOT / path))]
    services = by_kind(helm_template(*args, release=release["name"]), "Service")
    svc = services[forward["resourceName"]]
    assert svc["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    assert {"name": "grpc", "port": 50051} in [
        {k: p[k] for k in ("name", "port")} for p in svc["spec"]["ports"]]


def test_gpu_profile_deploys_mps_drafters() -> None:
    cfg = with_profile(config(), "gpu")
    (release,) = cfg["deploy"]["helm"]["releases"]
    args = [a for path in release["valuesFiles"] for a in ("-f", str(ROOT / path))]
    docs = helm_template(*args, release=release["name"])
    drafters = [d for d in by_kind(docs, "Deployment").values()
                if d["metadata"]["labels"]["app.kubernetes.io/component"] == "drafter"]
    assert drafters
    gpu_drafters = [d for d in drafters if "nvidia.com/gpu" in
                    d["spec"]["template"]["spec"]["containers"][0]["resources"].get("limits", {})]
    assert gpu_drafters, "the gpu profile's values put no drafter on a GPU slice"
    configs = [d for d in by_kind(docs, "ConfigMap").values() if "mps" in d["metadata"]["name"]]
    assert configs, "the gpu profile's values render no MPS sharing config"
