"""The Helm chart (helm/spin) rendered by the real helm: lint, strict Kubernetes schemas, and what
the objects say (one Deployment + Service per draft model, probes, resources, MPS, NetworkPolicy
reachability, security contexts, selectors, RBAC, router args, tracing, values-schema errors).

Each distinct render runs once per module (``render`` is cached); tests must not mutate its docs.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import ipaddress
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from deploy.conftest import (CHART, K8S_VERSIONS, MONITORING_APIS, by_kind, helm_template,
                             kubernetes_validate, run, tool)

VALUE_SETS = ("default", "cpu-demo", "gpu-mps", "external-redis", "monitoring")
SPIN_IMAGE = "ghcr.io/spin-serving/spin"
GRPC_PORTS = {"router": 50051, "verifier": 50061, "drafter": 50071}
DEMO_DRAFTERS = ("draft-structured", "draft-code", "draft-prose", "draft-general")


def set_args(name: str) -> tuple[str, ...]:
    """helm args of a value set: ci/<name>-values.yaml (monitoring with its CRD APIs)."""
    if name == "default":
        return ()
    args: tuple[str, ...] = ("-f", str(CHART / "ci" / f"{name}-values.yaml"))
    if name == "monitoring":
        args += tuple(a for api in MONITORING_APIS for a in ("--api-versions", api))
    return args


@functools.cache
def render(*args: str, release: str = "spin") -> list[dict]:
    """``helm template`` of the chart, once per distinct argument list."""
    return helm_template(*args, release=release)


def render_set(name: str) -> list[dict]:
    return render(*set_args(name))


def rejected(*args: str) -> str:
    """helm's error output for values that must not render."""
    proc = helm_template(*args, check=False)
    assert proc.returncode != 0, f"helm template {' '.join(args)} rendered, expected an error"
    return proc.stderr


# --- object helpers ---------------------------------------------------------------------------

def workloads(docs: list[dict]) -> list[tuple[dict, dict, dict]]:
    """(object, pod labels, pod spec) of every Deployment, StatefulSet and bare Pod."""
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            tpl = d["spec"]["template"]
            out.append((d, tpl["metadata"]["labels"], tpl["spec"]))
        elif d["kind"] == "Pod":
            out.append((d, d["metadata"]["labels"], d["spec"]))
    return out


def containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def pod_spec(docs: list[dict], name: str) -> dict:
    """Pod spec of the Deployment ``name``."""
    return by_kind(docs, "Deployment")[name]["spec"]["template"]["spec"]


def main_container(docs: list[dict], name: str) -> dict:
    return pod_spec(docs, name)["containers"][0]


def flag(args: list[str], name: str) -> str | None:
    """Value of ``--name VALUE`` in a container's args (None when absent)."""
    return args[args.index(name) + 1] if name in args else None


def env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def component(labels: dict) -> str:
    return labels["app.kubernetes.io/component"]


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (or a plain matchLabels map) against labels."""
    match = selector.get("matchLabels", {}) if ("matchLabels" in selector or
                                                "matchExpressions" in selector) else selector
    if any(labels.get(k) != v for k, v in match.items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        if op == "In" and value not in expr["values"] or op == "NotIn" and value in expr["values"]:
            return False
        if op == "Exists" and value is None or op == "DoesNotExist" and value is not None:
            return False
    return True


# --- NetworkPolicy semantics (enough of them for these policies) -------------------------------

@dataclass(frozen=True)
class Peer:
    """A traffic end: a pod (labels, namespace) or an address outside the cluster (ip)."""
    labels: dict = field(default_factory=dict)
    namespace: str = "serving"
    ip: str = ""

    def ns_labels(self) -> dict:
        return {"kubernetes.io/metadata.name": self.namespace}


def peer_matches(rule_peer: dict, end: Peer, policy_ns: str) -> bool:
    if "ipBlock" in rule_peer:
        if not end.ip:
            return False
        ip, block = ipaddress.ip_address(end.ip), rule_peer["ipBlock"]
        return ip in ipaddress.ip_network(block["cidr"]) and \
            not any(ip in ipaddress.ip_network(e) for e in block.get("except", []))
    if end.ip:
        return False
    if "namespaceSelector" in rule_peer:
        ns_ok = selects(rule_peer["namespaceSelector"], end.ns_labels())
    else:
        ns_ok = end.namespace == policy_ns
    return ns_ok and selects(rule_peer.get("podSelector", {}), end.labels)


def rule_allows(rule: dict, peers_key: str, end: Peer, port: int, policy_ns: str) -> bool:
    ports = rule.get("ports") or []
    if ports and not any(p.get("port") in (None, port) for p in ports):
        return False
    peers = rule.get(peers_key) or []
    return not peers or any(peer_matches(p, end, policy_ns) for p in peers)


def reachable(policies: list[dict], src: Peer, dst: Peer, port: int) -> bool:
    """Whether NetworkPolicies let ``src`` open a TCP connection to ``dst``:``port``."""
    def applying(pod: Peer, kind: str) -> list[dict]:
        return [p for p in policies if not pod.ip and p["metadata"]["namespace"] == pod.namespace
                and kind in p["spec"]["policyTypes"]
                and selects(p["spec"]["podSelector"], pod.labels)]

    ingress = applying(dst, "Ingress")
    if ingress and not any(rule_allows(r, "from", src, port, p["metadata"]["namespace"])
                           for p in ingress for r in p["spec"].get("ingress", [])):
        return False
    egress = applying(src, "Egress")
    return not egress or any(rule_allows(r, "to", dst, port, p["metadata"]["namespace"])
                             for p in egress for r in p["spec"].get("egress", []))


def pods_by_name(docs: list[dict]) -> dict[str, Peer]:
    return {d["metadata"]["name"]: Peer(labels) for d, labels, _ in workloads(docs)}


# --- lint, schemas ------------------------------------------------------------------------------

@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_strict(value_set: str) -> None:
    args = [a for a in set_args(value_set) if a != "--api-versions" and a not in MONITORING_APIS]
    out = run([tool("helm"), "lint", "--strict", CHART, *args]).stdout
    assert "0 chart(s) failed" in out, out


# Renders beyond the value sets whose objects also go through the strict schema check.
VARIANTS = (
    ("--set", "redis.persistence.enabled=true", "--set", "redis.persistence.storageClass=fast",
     "--set", "router.autoscaling.enabled=true",
     "--set", "router.autoscaling.targetMemoryUtilizationPercentage=80",
     "--set-json", 'router.autoscaling.behavior={"scaleDown": {"stabilizationWindowSeconds": 300}}',
     "--set-json", 'router.topologySpreadConstraints=[{"maxSkew": 1, "whenUnsatisfiable": '
     '"ScheduleAnyway", "topologyKey": "topology.kubernetes.io/zone"}]',
     "--set", "verifier.podAntiAffinity=hard"),
    ("--set", "models.source=pvc", "--set", "models.init.enabled=true",
     "--set", "models.init.image=fetch:1", "--set-json", 'models.init.command=["sh", "-c", "true"]',
     "--set", "models.pvc.accessModes[0]=ReadWriteMany",
     "--set", "redis.external.url=redis://cache:6379/1", "--set", "redis.external.password=s3cret",
     "--set-json", 'imagePullSecrets=[{"name": "registry"}]', "--set", "tracing.enabled=true"),
    ("--set", "redis.enabled=false", "--set", "networkPolicy.egress.restrict=true",
     "--set", "router.pdb.minAvailable=50%"),
)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_value_set_validates_strictly(version: str, tmp_path: Path) -> None:
    """Every value set's objects (CRD objects aside) against the Kubernetes schemas, strictly."""
    renders = [render_set(name) for name in VALUE_SETS] + [render(*args) for args in VARIANTS]
    unique = {json.dumps(d, sort_keys=True): d for docs in renders for d in docs
              if not d["apiVersion"].startswith("monitoring.coreos.com/")}  # identical docs once
    assert len(unique) > 60
    kubernetes_validate(list(unique.values()), tmp_path, version)


def test_monitoring_value_set_renders_the_operator_objects() -> None:
    kinds = {d["kind"] for d in render_set("monitoring")}
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"} <= kinds


@pytest.mark.parametrize(("args", "field_name", "message"), [
    (("--set", "router.replicas=-1"), "router.replicas", "greater than or equal to 1"),
    (("--set", "drafterDefaults.replicas=-2"), "drafterDefaults.replicas",
     "greater than or equal to 0"),
    (("--set", "router.policy=greedy"), "router.policy", '"learned", "fixed"'),
    (("--set", "drafterDefaults.quantize=int4"), "drafterDefaults.quantize", '"none", "int8"'),
    (("--set-json", 'drafters=[{"name": "draft-x"}]'), "drafters.0", "model is required"),
    (("--set-json", 'drafters=[{"name": "Draft_X", "model": "x"}]'), "drafters.0.name",
     "Does not match pattern"),
    (("--set-json", 'drafters=[{"name": "prompt-lookup", "model": "x"}]'), "drafters.0.name",
     "Must not validate"),
    (("--set", "bogus=1"), "(root)", "Additional property bogus is not allowed"),
    (("--set", "models.source=s3"), "models.source", '"pvc", "image"'),
    (("--set", "router.pdbb.enabled=true"), "router", "Additional property pdbb"),
    (("--set", "monitoring.prometheusRule.thresholds.acceptanceRateMin=2"),
     "monitoring.prometheusRule.thresholds.acceptanceRateMin", "less than or equal to 1"),
    (("--set-json", "tracing.sampleRatio=1.5"), "tracing.sampleRatio", "less than or equal to 1"),
    (("--set", "mps.enabled=true"), "mps.enabled", "gpu.enabled"),
    (("--set-json", 'drafters=[{"name": "a", "model": "a"}, {"name": "a", "model": "b"}]'),
     "drafters", 'name "a" is used twice'),
    (("--set-json", 'verifier.heads=[{"name": "draft-code", "model": "h"}]'), "verifier.heads",
     'name "draft-code" is used twice'),
    (("--set-json", 'verifier.heads=[{"name": "Eagle Head", "model": "h"}]'),
     "verifier.heads.0.name", "Does not match pattern"),
    (("--set-json", 'verifier.colocated=[{"name": "eagle", "model": "d"}]'),
     "verifier.colocated", 'name "eagle" is used twice'),
    (("--set", "verifier.colocateQuantize=int4"), "verifier.colocateQuantize",
     '"auto", "none", "int8"'),
    (("--set", "router.promptLookup=false"), "router.defaultDrafter",
     "router.promptLookup is false"),
    (("--set", "router.defaultDrafter=draft-nope"), "router.defaultDrafter", "draft-nope"),
    (("--set", "gpu.enabled=true"), "models.source", "CPU image"),
    (("--set", "verifier.kvCacheMemory=20XB"), "verifier.kvCacheMemory", "Does not match pattern"),
    (("--set-json", 'drafters=[{"name": "a", "model": "a", "kvCacheMemory": "lots"}]'),
     "drafters.0.kvCacheMemory", "Does not match pattern"),
    (("--set", "gpu.memory=80 gigs"), "gpu.memory", "Does not match pattern"),
    (("--set-json", "verifier.gpuMemoryUtilization=1.5"), "verifier.gpuMemoryUtilization",
     "less than or equal to 1"),
    (("--set-json", "drafterDefaults.gpuMemoryUtilization=0"),
     "drafterDefaults.gpuMemoryUtilization", "greater than 0"),
    (("--set", "verifier.device=gpu"), "verifier.device", "Does not match pattern"),
    (("--set", "drafterDefaults.dtype=int8"), "drafterDefaults.dtype", '"auto", "float32"'),
    (("--set", "verifier.maxModelLen=1"), "verifier.maxModelLen", "greater than or equal to 2"),
    (("--set", "verifier.maxSeqs=0"), "verifier.maxSeqs", "greater than or equal to 1"),
    (("--set", "verifier.device=cuda"), "verifier.device", "gets no GPU"),
    (("--set", "drafterDefaults.device=cuda:1"), "drafters[draft-structured].device",
     "gets no GPU"),
])
def test_wrong_values_are_rejected_naming_the_field(args: tuple[str, ...], field_name: str,
                                                    message: str) -> None:
    err = rejected(*args)
    assert field_name in err and message in err, err


# --- draft-model pool ---------------------------------------------------------------------------

def drafter_objects(docs: list[dict]) -> tuple[dict[str, dict], dict[str, dict]]:
    deps = {n: d for n, d in by_kind(docs, "Deployment").items()
            if d["metadata"]["labels"]["app.kubernetes.io/component"] == "drafter"}
    svcs = {n: d for n, d in by_kind(docs, "Service").items()
            if d["metadata"]["labels"]["app.kubernetes.io/component"] == "drafter"}
    return deps, svcs


def test_one_deployment_and_service_per_default_draft_model() -> None:
    deps, svcs = drafter_objects(render_set("default"))
    expected = {f"spin-drafter-{n}" for n in DEMO_DRAFTERS}
    assert set(deps) == expected and set(svcs) == expected
    for name in DEMO_DRAFTERS:
        args = deps[f"spin-drafter-{name}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[0] == "drafter"
        assert flag(args, "--name") == name
        assert flag(args, "--model") == f"/opt/spin/models/demo/{name}"
        assert flag(args, "--port") == "50071" and flag(args, "--metrics-port") == "9090"
        labels = svcs[f"spin-drafter-{name}"]["metadata"]["labels"]
        assert labels["spin.dev/role"] == "drafter" and labels["spin.dev/drafter"] == name
        assert labels["app.kubernetes.io/instance"] == "spin"


def test_changing_the_drafter_list_changes_the_pool() -> None:
    pool = [{"name": "tiny", "model": "qwen-0.5b"},
            {"name": "coder", "model": "/weights/coder", "replicas": 3,
             "extraArgs": ["--threads", "2"], "quantize": "int8",
             "resources": {"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"memory": "3Gi"}}}]
    docs = render("--set-json", "drafters=" + json.dumps(pool))
    deps, svcs = drafter_objects(docs)
    assert set(deps) == set(svcs) == {"spin-drafter-tiny", "spin-drafter-coder"}
    coder = deps["spin-drafter-coder"]
    assert coder["spec"]["replicas"] == 3
    assert deps["spin-drafter-tiny"]["spec"]["replicas"] == 1  # drafterDefaults
    c = coder["spec"]["template"]["spec"]["containers"][0]
    assert flag(c["args"], "--model") == "/weights/coder"  # absolute path kept
    assert c["args"][-2:] == ["--threads", "2"]
    assert flag(c["args"], "--quantize") == "int8"
    assert c["resources"] == pool[1]["resources"]  # replaces the defaults, no merge
    tiny = deps["spin-drafter-tiny"]["spec"]["template"]["spec"]["containers"][0]
    assert flag(tiny["args"], "--model") == "/opt/spin/models/demo/qwen-0.5b"
    assert "--quantize" not in tiny["args"]  # drafterDefaults: weights as loaded
    assert tiny["resources"]["requests"] == {"cpu": "250m", "memory": "512Mi"}
    assert svcs["spin-drafter-coder"]["metadata"]["labels"]["spin.dev/drafter"] == "coder"


MODEL_FLAGS = ("--device", "--dtype", "--max-seqs", "--gpu-memory-utilization",
               "--kv-cache-memory", "--max-model-len")


def model_flags(args: list[str]) -> dict[str, str | None]:
    return {f: flag(args, f) for f in MODEL_FLAGS}


def test_model_flags_of_the_gpu_value_set() -> None:
    """Qwen2.5-7B in bf16 with 32k context and an explicit KV budget on a whole GPU; the drafters
    in bf16 with the same context and a budget that fits an MPS slice (tests/deploy/
    test_plan_values.py checks that these fit)."""
    docs = render_set("gpu-mps")
    assert model_flags(main_container(docs, "spin-verifier")["args"]) == {
        "--device": "cuda", "--dtype": "bfloat16", "--max-seqs": "128",
        "--gpu-memory-utilization": "0.9", "--kv-cache-memory": "48GiB",
        "--max-model-len": "32768"}
    deps, _ = drafter_objects(docs)
    assert len(deps) == 3
    for dep in deps.values():
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert model_flags(args) == {
            "--device": "cuda", "--dtype": "bfloat16", "--max-seqs": "64",
            "--gpu-memory-utilization": "0.9", "--kv-cache-memory": "8GiB",
            "--max-model-len": "32768"}
        assert "--slots" not in args


def test_model_flags_defaults_overrides_and_the_old_slots_name() -> None:
    docs = render_set("default")
    defaults = {"--device": "auto", "--dtype": "auto", "--max-seqs": "64",
                "--gpu-memory-utilization": "0.9", "--kv-cache-memory": None,
                "--max-model-len": None}  # null: no flag, the service's own default
    assert model_flags(main_container(docs, "spin-verifier")["args"]) == defaults
    for name in DEMO_DRAFTERS:
        assert model_flags(main_container(docs, f"spin-drafter-{name}")["args"]) == defaults
    assert model_flags(main_container(render_set("cpu-demo"), "spin-drafter-draft-code")[
        "args"])["--kv-cache-memory"] == "64MiB"
    pool = [{"name": "old", "model": "m", "slots": 8},
            {"name": "long", "model": "m", "maxModelLen": 4096, "kvCacheMemory": "1.5G",
             "dtype": "float16", "gpuMemoryUtilization": 0.5, "maxSeqs": 16}]
    docs = render("--set", "verifier.slots=32", "--set", "drafterDefaults.maxSeqs=24",
                  "--set", "verifier.kvCacheMemory=256Mi",
                  "--set-json", "drafters=" + json.dumps(pool))
    assert model_flags(main_container(docs, "spin-verifier")["args"]) == {
        **defaults, "--max-seqs": "32", "--kv-cache-memory": "256Mi"}
    assert flag(main_container(docs, "spin-drafter-old")["args"], "--max-seqs") == "8"
    assert model_flags(main_container(docs, "spin-drafter-long")["args"]) == {
        "--device": "auto", "--dtype": "float16", "--max-seqs": "16",
        "--gpu-memory-utilization": "0.5", "--kv-cache-memory": "1.5G", "--max-model-len": "4096"}


def _verifier_models(key: str, flag_name: str, models: list[dict]) -> tuple[list[str], str]:
    """The verifier's ``flag_name`` values with ``verifier.<key>`` set to ``models``, and its
    models root."""
    args = main_container(render("--set-json", f"verifier.{key}=" + json.dumps(models)),
                          "spin-verifier")["args"]
    return ([args[i + 1] for i, a in enumerate(args) if a == flag_name],
            flag(args, "--model").rsplit("/", 1)[0])


def test_colocated_drafters_become_colocate_flags() -> None:
    assert "--colocate" not in main_container(render_set("default"), "spin-verifier")["args"]
    models = [{"name": "draft-in", "model": "draft-code"}, {"name": "abs", "model": "/opt/d"}]
    got, root = _verifier_models("colocated", "--colocate", models)
    assert got == [f"draft-in={root}/draft-code", "abs=/opt/d"]
    quantize, _ = _verifier_models("colocated", "--colocate-quantize", models)
    assert quantize == ["auto"]


def test_verifier_heads_become_head_flags() -> None:
    default = main_container(render_set("default"), "spin-verifier")["args"]
    assert flag(default, "--head") == f"eagle={flag(default, '--model').rsplit('/', 1)[0]}/eagle"
    assert _verifier_models("heads", "--head", [])[0] == []
    heads = [{"name": "eagle", "model": "eagle"}, {"name": "abs", "model": "/opt/h"}]
    got, root = _verifier_models("heads", "--head", heads)
    assert got == [f"eagle={root}/eagle", "abs=/opt/h"]


def test_cuda_graphs_compile_and_attention_flags_have_defaults_and_follow_overrides() -> None:
    docs = render_set("default")
    args = main_container(docs, "spin-verifier")["args"]
    assert "--cuda-graphs" in args and "--no-compile" in args and "--prefix-caching" in args
    assert flag(args, "--attention") == "sdpa"
    pool = [{"name": "eager", "model": "m", "cudaGraphs": False, "compile": True,
             "attention": "flex", "prefixCaching": False}]
    docs = render("--set", "verifier.cudaGraphs=false", "--set-json", "drafters=" + json.dumps(pool))
    assert "--no-cuda-graphs" in main_container(docs, "spin-verifier")["args"]
    drafter = main_container(docs, "spin-drafter-eager")["args"]
    assert "--no-cuda-graphs" in drafter and "--compile" in drafter
    assert "--no-prefix-caching" in drafter
    assert flag(drafter, "--attention") == "flex"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_the_cli_accepts_every_rendered_command_line(value_set: str) -> None:
    """Each SPIN container's args parse with the real `spin` parser (chart and CLI agree)."""
    from spin.cli import parser

    commands = set()
    for obj, _, pod in workloads(render_set(value_set)):
        for c in pod["containers"]:
            if not c["image"].startswith(SPIN_IMAGE):
                continue
            try:
                parsed = parser().parse_args(c["args"])
            except SystemExit:
                pytest.fail(f"{obj['metadata']['name']}: `spin {' '.join(c['args'])}` "
                            "does not parse")
            commands.add(parsed.command)
            if parsed.command in GRPC_PORTS:
                assert (parsed.host, parsed.port, parsed.metrics_port) == \
                    ("0.0.0.0", GRPC_PORTS[parsed.command], 9090)
    assert commands == {"router", "verifier", "drafter", "generate"}


def test_prompt_lookup_drafter_in_the_router() -> None:
    default_args = main_container(render_set("default"), "spin-router")["args"]
    assert "--no-prompt-lookup" not in default_args
    assert flag(default_args, "--default-drafter") == "prompt-lookup"
    args = main_container(render_set("external-redis"), "spin-router")["args"]
    assert "--no-prompt-lookup" in args
    assert flag(args, "--policy") == "fixed" and flag(args, "--default-drafter") == "draft-code"
    assert flag(args, "--default-k") == "3"


def test_the_model_free_drafters_are_values() -> None:
    args = main_container(render_set("default"), "spin-router")["args"]
    off = ("--no-suffix-decoding", "--no-grammar-drafts", "--no-predicted-outputs")
    assert not set(off) & set(args)
    assert flag(args, "--suffix-store-tokens") == "65536"
    args = main_container(render("--set", "router.suffixDecoding=false", "--set",
                                 "router.grammarDrafts=false", "--set",
                                 "router.predictedOutputs=false", "--set",
                                 "router.suffixStoreTokens=4096"), "spin-router")["args"]
    assert set(off) <= set(args)
    assert flag(args, "--suffix-store-tokens") == "4096"
    assert "--suffix-share" not in args
    args = main_container(render("--set", "router.suffixShare=true", "--set",
                                 "router.suffixShareEntries=500"), "spin-router")["args"]
    assert "--suffix-share" in args and flag(args, "--suffix-share-entries") == "500"
    assert "router.suffixShare shares through Redis" in rejected(
        "--set", "router.suffixShare=true", "--set", "redis.enabled=false")


# --- probes, resources, security ----------------------------------------------------------------

@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_grpc_probes_and_named_ports(value_set: str) -> None:
    docs = render_set(value_set)
    seen = set()
    for obj, labels, pod in workloads(docs):
        role = component(labels)
        if role not in GRPC_PORTS:
            continue
        seen.add(role)
        c = pod["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        http = {"http": 8000} if role == "router" else {}  # the OpenAI-compatible API
        assert ports == {"grpc": GRPC_PORTS[role], "metrics": 9090, **http}, obj["metadata"]["name"]
        assert flag(c["args"], "--port") == str(GRPC_PORTS[role])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": GRPC_PORTS[role]}, (obj["metadata"]["name"], probe)
        startup = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
        assert startup >= {"router": 150, "drafter": 300, "verifier": 300}[role]
        if role == "verifier" and value_set in ("default", "gpu-mps"):
            assert startup >= 900, "the verifier must get minutes to load a large target"
    assert seen == set(GRPC_PORTS)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_container_has_requests_and_limits(value_set: str) -> None:
    for obj, _, pod in workloads(render_set(value_set)):
        for c in containers(pod):
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(part, {})), \
                    (obj["metadata"]["name"], c["name"], part)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_security_context_everywhere(value_set: str) -> None:
    for obj, labels, pod in workloads(render_set(value_set)):
        name = obj["metadata"]["name"]
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True, name
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in containers(pod):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True, (name, c["name"])
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])
        if pod["containers"][0]["image"].startswith(SPIN_IMAGE):
            assert psc["runAsUser"] == 10001 and psc["runAsGroup"] == 10001, name
            volumes = {v["name"]: v for v in pod["volumes"]}
            mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
            for path in ("/tmp", "/home/spin/.cache"):
                assert "emptyDir" in volumes[mounts[path]], (name, path)


def test_verifier_shared_memory_volume() -> None:
    for value_set, size in (("default", "1Gi"), ("gpu-mps", "8Gi")):
        pod = pod_spec(render_set(value_set), "spin-verifier")
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        shm = {v["name"]: v for v in pod["volumes"]}[mounts["/dev/shm"]]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": size}


# --- GPUs and MPS --------------------------------------------------------------------------------

def gpu_request(c: dict) -> int | None:
    return c["resources"].get("limits", {}).get("nvidia.com/gpu")


def test_mps_config_and_draft_pods_on_slices() -> None:
    docs = render_set("gpu-mps")
    cm = by_kind(docs, "ConfigMap")["spin-mps"]
    assert cm["metadata"]["namespace"] == "gpu-operator"
    assert yaml.safe_load(cm["data"]["spin-mps"]) == {"version": "v1", "sharing": {
        "mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}}}
    checksum = hashlib.sha256(cm["data"]["spin-mps"].rstrip("\n").encode()).hexdigest()
    deps, _ = drafter_objects(docs)
    assert len(deps) == 3
    for name, dep in deps.items():
        pod = dep["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert gpu_request(c) == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1, name
        assert pod["nodeSelector"]["nvidia.com/gpu.sharing-strategy"] == "mps", name
        assert {"key": "nvidia.com/gpu", "operator": "Exists",
                "effect": "NoSchedule"} in pod["tolerations"], name
        assert "/dev/shm" not in {m["mountPath"] for m in c["volumeMounts"]}, \
            "MPS brings its own /dev/shm"
        assert dep["spec"]["template"]["metadata"]["annotations"]["checksum/mps-config"] == checksum
        assert c["image"] == f"{SPIN_IMAGE}:0.1.0"  # the CUDA image
    verifier = pod_spec(docs, "spin-verifier")
    assert gpu_request(verifier["containers"][0]) == 1
    assert verifier["nodeSelector"] == {"nvidia.com/gpu.sharing-strategy": "none"}


def mps_configmaps(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-mps")]


def test_no_mps_and_no_gpu_when_off() -> None:
    cpu = render_set("default")
    assert not mps_configmaps(cpu)
    for obj, _, pod in workloads(cpu):
        name = obj["metadata"]["name"]
        assert all(gpu_request(c) is None for c in containers(pod)), name
        assert "nodeSelector" not in pod, name
        assert "nvidia.com/gpu" not in json.dumps(pod.get("tolerations", [])), name
        if pod["containers"][0]["image"].startswith(SPIN_IMAGE):
            assert pod["containers"][0]["image"] == f"{SPIN_IMAGE}:0.1.0-cpu"
    gpu = render("--set", "gpu.enabled=true", "--set", "models.source=pvc")
    assert not mps_configmaps(gpu)
    deps, _ = drafter_objects(gpu)
    for name, dep in deps.items():
        pod = dep["spec"]["template"]["spec"]
        assert gpu_request(pod["containers"][0]) == 1, name  # a whole GPU each without MPS
        assert "nodeSelector" not in pod, name
        assert "annotations" not in dep["spec"]["template"]["metadata"], name


def test_mps_allows_one_slice_per_pod_at_most() -> None:
    err = rejected(*set_args("gpu-mps"), "--set", "drafterDefaults.gpus=2")
    assert "one slice at most" in err, err


# --- models --------------------------------------------------------------------------------------

def test_models_volume_from_a_claim() -> None:
    docs = render("--set", "models.source=pvc", "--set", "models.pvc.size=20Gi")
    pvc = by_kind(docs, "PersistentVolumeClaim")["spin-models"]
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
    for obj, labels, pod in workloads(docs):
        if component(labels) not in GRPC_PORTS:
            continue
        mount = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}["models"]
        assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
        claim = {v["name"]: v for v in pod["volumes"]}["models"]["persistentVolumeClaim"]
        assert claim == {"claimName": "spin-models", "readOnly": True}
    assert flag(main_container(docs, "spin-verifier")["args"], "--model") == "/models/target"
    assert flag(main_container(docs, "spin-router")["args"], "--tokenizer") == "/models/target"
    assert "PersistentVolumeClaim" not in {d["kind"] for d in render_set("gpu-mps")}  # existing
    image_source = pod_spec(render_set("default"), "spin-verifier")
    assert "models" not in {v["name"] for v in image_source["volumes"]}


def test_models_init_container_fetches_into_the_volume() -> None:
    docs = render("--set", "models.source=pvc", "--set", "models.init.enabled=true",
                  "--set", "models.init.image=example.org/fetch:1",
                  "--set-json", 'models.init.command=["sh", "-c", "fetch \\"$SPIN_MODEL_PATH\\""]')
    pod = pod_spec(docs, "spin-drafter-draft-code")
    init = pod["initContainers"][0]
    assert init["image"] == "example.org/fetch:1"
    assert env(init)["SPIN_MODEL_PATH"]["value"] == "/models/draft-code"
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]  # writable
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in \
        pod["containers"][0]["volumeMounts"]
    err = rejected("--set", "models.init.enabled=true", "--set", "models.init.image=x",
                   "--set-json", 'models.init.command=["x"]')
    assert "models.source: pvc" in err, err


# --- labels, selectors, HPA, PDB -----------------------------------------------------------------

@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_selectors_match_exactly_their_own_pods(value_set: str) -> None:
    docs = render_set(value_set)
    pods = workloads(docs)

    def selected(selector: dict) -> list[str]:
        return [obj["metadata"]["name"] for obj, labels, _ in pods if selects(selector, labels)]

    common = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
              "app.kubernetes.io/managed-by", "helm.sh/chart", "app.kubernetes.io/component")
    for obj, labels, _ in pods:
        name = obj["metadata"]["name"]
        if obj["kind"] != "Pod":
            assert selects(obj["spec"]["selector"], labels), name
            assert selected(obj["spec"]["selector"]) == [name], name
        for key in common:
            assert key in labels and key in obj["metadata"]["labels"], (name, key)
    owners = {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}
    for name, svc in by_kind(docs, "Service").items():
        assert selected(svc["spec"]["selector"]) == [name], f"Service {name}"
        assert component(svc["metadata"]["labels"]) == component(owners[name]["metadata"]["labels"])
    for name, pdb in by_kind(docs, "PodDisruptionBudget").items():
        assert selected(pdb["spec"]["selector"]) == ["spin-router"], f"PDB {name}"


def test_router_hpa_and_pdb() -> None:
    docs = render_set("gpu-mps")
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["spin-router"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "spin-router"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 4)
    assert "replicas" not in by_kind(docs, "Deployment")["spin-router"]["spec"]  # the HPA owns it
    assert by_kind(docs, "PodDisruptionBudget")["spin-router"]["spec"]["minAvailable"] == 1
    default = render_set("default")
    assert "HorizontalPodAutoscaler" not in {d["kind"] for d in default}
    assert by_kind(default, "PodDisruptionBudget")["spin-router"]["spec"] == {
        "maxUnavailable": 1, "selector": {"matchLabels": {
            "app.kubernetes.io/name": "spin", "app.kubernetes.io/instance": "spin",
            "app.kubernetes.io/component": "router"}}}


# --- RBAC and service accounts -------------------------------------------------------------------

@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_router_rbac_is_least_privilege(value_set: str) -> None:
    docs = render_set(value_set)
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}
    roles, bindings = by_kind(docs, "Role"), by_kind(docs, "RoleBinding")
    assert list(roles) == ["spin-router"]
    assert roles["spin-router"]["rules"] == [{"apiGroups": ["discovery.k8s.io"],
                                              "resources": ["endpointslices"],
                                              "verbs": ["list", "watch"]}]
    assert list(bindings) == ["spin-router"]
    assert bindings["spin-router"]["roleRef"]["name"] == "spin-router"
    assert bindings["spin-router"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "spin-router", "namespace": "serving"}]
    accounts = by_kind(docs, "ServiceAccount")
    assert accounts["spin-router"]["automountServiceAccountToken"] is True
    assert accounts["spin"]["automountServiceAccountToken"] is False
    for obj, labels, pod in workloads(docs):
        is_router = component(labels) == "router"
        name = obj["metadata"]["name"]
        assert pod["serviceAccountName"] == ("spin-router" if is_router else "spin"), name
        assert pod["automountServiceAccountToken"] is is_router, name


# --- router args: discovery, Redis, tracing ------------------------------------------------------

def test_router_discovery_args() -> None:
    docs = render(release="prod")
    c = main_container(docs, "prod-spin-router")
    args = c["args"]
    assert args[0] == "router"
    assert flag(args, "--discovery") == "kubernetes"
    assert flag(args, "--label-selector") == "app.kubernetes.io/instance=prod"
    assert flag(args, "--host") == "0.0.0.0" and flag(args, "--port") == "50051"
    assert flag(args, "--metrics-port") == "9090"
    assert flag(args, "--tokenizer") == "/opt/spin/models/demo/target"
    assert flag(args, "--max-queue") == "256" and flag(args, "--policy") == "learned"
    assert "--verifier" not in args and "--drafter" not in args
    assert env(c)["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    services = by_kind(docs, "Service")
    for name in ("prod-spin-verifier", *(f"prod-spin-drafter-{n}" for n in DEMO_DRAFTERS)):
        assert services[name]["metadata"]["labels"]["app.kubernetes.io/instance"] == "prod"


def test_redis_in_chart() -> None:
    docs = render_set("default")
    c = main_container(docs, "spin-router")
    assert flag(c["args"], "--redis-url") == "redis://spin-redis:6379/0"
    assert "SPIN_REDIS_PASSWORD" not in env(c)
    redis = by_kind(docs, "StatefulSet")["spin-redis"]
    pod = redis["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"].startswith("redis:7")
    assert pod["securityContext"]["runAsUser"] != 0
    assert {"readinessProbe", "livenessProbe"} <= set(pod["containers"][0])
    assert by_kind(docs, "Service")["spin-redis"]["spec"]["ports"][0]["port"] == 6379


def test_redis_external_with_existing_secret() -> None:
    docs = render_set("external-redis")
    c = main_container(docs, "spin-router")
    assert flag(c["args"], "--redis-url") == "rediss://spin-stats.cache.example.internal:6380/2"
    assert env(c)["SPIN_REDIS_PASSWORD"]["valueFrom"] == {
        "secretKeyRef": {"name": "spin-redis-auth", "key": "redis-password"}}
    assert "StatefulSet" not in {d["kind"] for d in docs}
    assert "Secret" not in {d["kind"] for d in docs}


def test_redis_external_with_chart_secret() -> None:
    docs = render("--set", "redis.external.url=redis://cache:6379/1", "--set",
                  "redis.external.password=s3cret")
    secret = by_kind(docs, "Secret")["spin-redis-password"]
    assert base64.b64decode(secret["data"]["password"]) == b"s3cret"
    dep = by_kind(docs, "Deployment")["spin-router"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert flag(c["args"], "--redis-url") == "redis://cache:6379/1"
    assert env(c)["SPIN_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "spin-redis-password", "key": "password"}
    assert "checksum/redis-secret" in dep["spec"]["template"]["metadata"]["annotations"]
    assert "StatefulSet" not in {d["kind"] for d in docs}


def test_no_redis_keeps_statistics_in_process() -> None:
    docs = render("--set", "redis.enabled=false")
    c = main_container(docs, "spin-router")
    assert "--redis-url" not in c["args"] and "SPIN_REDIS_PASSWORD" not in env(c)
    assert not [d for d in docs if d["metadata"]["name"].startswith("spin-redis")]


def test_tracing_env_on_every_spin_container() -> None:
    docs = render_set("monitoring")
    expected = {"spin-router": "spin-router", "spin-verifier": "spin-verifier",
                **{f"spin-drafter-{n}": f"spin-drafter-{n}" for n in DEMO_DRAFTERS}}
    for name, service in expected.items():
        e = env(main_container(docs, name))
        assert e["OTEL_SERVICE_NAME"]["value"] == service
        assert e["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == \
            "http://otel-collector.observability:4317"
        assert e["OTEL_TRACES_SAMPLER"]["value"] == "parentbased_traceidratio"
        assert e["OTEL_TRACES_SAMPLER_ARG"]["value"] == "0.25"
    for obj, _, pod in workloads(render_set("default")):
        for c in containers(pod):
            assert not [k for k in env(c) if k.startswith("OTEL_")], obj["metadata"]["name"]


# --- NetworkPolicy ------------------------------------------------------------------------------

def test_network_policy_default_reachability() -> None:
    docs = render_set("default")
    policies = list(by_kind(docs, "NetworkPolicy").values())
    pods = pods_by_name(docs)
    router, verifier, redis = pods["spin-router"], pods["spin-verifier"], pods["spin-redis"]
    drafters = [pods[f"spin-drafter-{n}"] for n in DEMO_DRAFTERS]
    outside, stranger = Peer(ip="203.0.113.7"), Peer({"app": "other"}, namespace="default")
    prometheus = Peer({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")

    def ok(src: Peer, dst: Peer, port: int) -> bool:
        return reachable(policies, src, dst, port)

    assert ok(outside, router, 50051) and ok(stranger, router, 50051)
    assert all(ok(router, d, 50071) for d in drafters) and ok(router, verifier, 50061)
    assert ok(router, redis, 6379)
    for target in (router, verifier, *drafters):
        assert ok(prometheus, target, 9090) and not ok(outside, target, 9090)
    # nothing else
    assert not ok(outside, verifier, 50061) and not ok(stranger, verifier, 50061)
    assert not any(ok(outside, d, 50071) or ok(stranger, d, 50071) for d in drafters)
    assert not ok(drafters[0], verifier, 50061) and not ok(drafters[0], drafters[1], 50071)
    assert not ok(verifier, redis, 6379) and not ok(stranger, redis, 6379)
    assert not ok(router, verifier, 22) and not ok(outside, router, 6379)
    assert not ok(router, redis, 9090)
    assert not ok(outside, pods["spin-test-generate"], 8080)  # the default-deny covers every pod
    # egress is unrestricted by default
    assert ok(verifier, outside, 443) and ok(drafters[0], verifier, 9090)


def test_network_policy_restricted_ingress_and_egress() -> None:
    docs = render_set("gpu-mps")
    policies = list(by_kind(docs, "NetworkPolicy").values())
    pods = pods_by_name(docs)
    router, verifier, redis = pods["spin-router"], pods["spin-verifier"], pods["spin-redis"]
    drafter = pods["spin-drafter-qwen-0-5b"]
    gateway = Peer({"app": "envoy"}, namespace="gateway")
    outside, api = Peer(ip="203.0.113.7"), Peer(ip="10.0.0.1")

    def ok(src: Peer, dst: Peer, port: int) -> bool:
        return reachable(policies, src, dst, port)

    assert ok(gateway, router, 50051) and not ok(outside, router, 50051)
    assert not ok(Peer({"app": "x"}, namespace="serving"), router, 50051)
    assert ok(router, drafter, 50071) and ok(router, verifier, 50061) and ok(router, redis, 6379)
    assert ok(router, api, 443) and not ok(router, api, 80)
    assert not ok(router, Peer(ip="10.0.0.2"), 443)  # only the API server's address
    dns = Peer({"k8s-app": "kube-dns"}, namespace="kube-system")
    assert ok(drafter, dns, 53) and ok(router, dns, 53)
    assert not ok(drafter, verifier, 50061) and not ok(drafter, outside, 443)
    assert not ok(verifier, outside, 443) and not ok(redis, dns, 53)


def test_network_policy_metrics_from_monitoring_only() -> None:
    docs = render_set("monitoring")
    policies = list(by_kind(docs, "NetworkPolicy").values())
    pods = pods_by_name(docs)
    prometheus = Peer({"app": "prometheus"}, namespace="monitoring")
    elsewhere = Peer({"app": "prometheus"}, namespace="default")
    for name in ("spin-router", "spin-verifier", "spin-drafter-draft-code"):
        assert reachable(policies, prometheus, pods[name], 9090)
        assert not reachable(policies, elsewhere, pods[name], 9090)


def test_network_policy_off() -> None:
    docs = render("--set", "networkPolicy.enabled=false")
    assert "NetworkPolicy" not in {d["kind"] for d in docs}


# --- NOTES --------------------------------------------------------------------------------------

def test_notes_render(tmp_path: Path) -> None:
    """NOTES.txt renders (only `helm install` shows it, so render a copy as a template)."""
    chart = tmp_path / "spin"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
    (chart / "templates" / "notes-check.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        "  notes: {{ tpl (.Files.Get \"notes.txt\") . | quote }}\n")
    out = run([tool("helm"), "template", "spin", chart, "--namespace", "serving",
               "--show-only", "templates/notes-check.yaml"]).stdout
    notes = yaml.safe_load(out)["data"]["notes"]
    assert "kubectl -n serving port-forward svc/spin-router 50051:50051" in notes
    assert 'spin generate --endpoint 127.0.0.1:50051' in notes
    assert "grpcurl -plaintext" in notes and "spin.v1.Generation/Generate" in notes


# --- documentation ------------------------------------------------------------------------------

def leaf_paths(value: object, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(value, dict) and value:
        return [p for k, v in value.items() for p in leaf_paths(v, path + (k,))]
    return [path]


def test_readme_documents_every_value() -> None:
    """Every key of values.yaml (or a parent of it) has a row in README's values table, and every
    row names a real key."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    table = (CHART / "README.md").read_text().split("\n## Values\n", 1)[1]
    rows = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert len(rows) > 100
    for path in leaf_paths(values):
        prefixes = {".".join(path[:i]) for i in range(1, len(path) + 1)}
        assert prefixes & rows, f"README.md does not document {'.'.join(path)}"
    for row in rows:
        node: object = values
        for part in row.split("."):
            assert isinstance(node, dict) and part in node, f"README.md documents unknown key {row}"
            node = node[part]


# --- the OpenAI-compatible API, its key and TLS -------------------------------------------------

def test_the_router_serves_http_with_a_key_from_a_secret_and_tls() -> None:
    docs = render("--set", "router.apiKey.existingSecret=spin-api", "--set",
                  "router.tls.secretName=spin-tls")
    c = main_container(docs, "spin-router")
    assert flag(c["args"], "--http-port") == "8000"
    assert env(c)["SPIN_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "spin-api",
                                                                    "key": "api-key"}
    assert not any("spin-api" in a or "api-key" in a for a in c["args"])  # never on the command line
    assert (flag(c["args"], "--tls-cert"), flag(c["args"], "--tls-key")) == (
        "/etc/spin/tls/tls.crt", "/etc/spin/tls/tls.key")
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(docs, "spin-router")["volumes"]}
    assert mounts["tls"] == "/etc/spin/tls" and volumes["tls"]["secret"]["secretName"] == "spin-tls"
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "spin-router")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["http"] == 8000


def test_without_http_the_router_gets_no_http_port() -> None:
    docs = render("--set", "router.http.enabled=false")
    c = main_container(docs, "spin-router")
    assert "--no-http" in c["args"] and "SPIN_API_KEY" not in env(c)
    assert "http" not in {p["name"] for p in c["ports"]}
