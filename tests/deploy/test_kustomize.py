"""The plain manifests (``k8s/``): each kustomization renders, validates strictly against the
Kubernetes API of every supported version, and wires the system the way the processes expect
(discovery labels, model paths, probes, security, GPUs, network policy)."""

from __future__ import annotations

import re
import shutil
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml

from deploy.conftest import K8S_VERSIONS, ROOT, by_kind, kubernetes_validate, run

K8S = ROOT / "k8s"
TARGETS = {"base": K8S / "base", "cpu-demo": K8S / "overlays" / "cpu-demo",
           "gpu": K8S / "overlays" / "gpu"}
IMAGE = "ghcr.io/spin-serving/spin"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
FAMILY = ROOT / "models" / "demo"
DEMO_MODELS_IN_IMAGE = "/opt/spin/models/demo"
"""Where docker/Dockerfile.cpu puts ``models/demo``."""
DEMO_DRAFTERS = sorted(p.name for p in FAMILY.iterdir()
                       if p.is_dir() and p.name.startswith("draft-") and (p / "config.json").exists())
EXPECTED = {
    # overlay: (drafters, image tag, models dir)
    "base": (["draft-code", "draft-prose"], f"{VERSION}-cpu", DEMO_MODELS_IN_IMAGE),
    "cpu-demo": (DEMO_DRAFTERS, f"{VERSION}-cpu", DEMO_MODELS_IN_IMAGE),
    "gpu": (["draft-code", "draft-prose"], VERSION, "/models"),
}
GRPC_PORTS = {"router": 50051, "verifier": 50061, "drafter": 50071}
COMMON_LABELS = {"app.kubernetes.io/name": "spin", "app.kubernetes.io/instance": "spin",
                 "app.kubernetes.io/version": VERSION, "app.kubernetes.io/managed-by": "kustomize"}
RELEASE_SELECTOR = "app.kubernetes.io/instance=spin"


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl (>= 1.27, with kustomize built in) is missing: install it from "
                    "https://kubernetes.io/docs/tasks/tools/ (Debian: the kubernetes apt repository)")
    return path


@cache
def rendered(target: str) -> tuple[dict, ...]:
    """``kubectl kustomize`` of one kustomization, as objects."""
    out = run([kubectl(), "kustomize", TARGETS[target]]).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


def docs_of(target: str) -> list[dict]:
    return list(rendered(target))


def workloads(docs: list[dict]) -> dict[str, dict]:
    return {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def container(workload: dict, name: str | None = None) -> dict:
    containers = pod_spec(workload)["containers"]
    if name is None:
        assert len(containers) == 1, [c["name"] for c in containers]
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def spin_workloads(docs: list[dict]) -> dict[str, dict]:
    """Workloads running the spin image (router, verifier, drafters)."""
    return {n: w for n, w in workloads(docs).items() if component(w) in GRPC_PORTS}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def environment(docs: list[dict], workload: dict, c: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it (envFrom ConfigMaps, then env with
    literal values, label/namespace field refs and $(VAR) references to earlier variables)."""
    configmaps = by_kind(docs, "ConfigMap")
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(configmaps[src["configMapRef"]["name"]]["data"])
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        path = var["valueFrom"]["fieldRef"]["fieldPath"]
        label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
        if label:
            env[var["name"]] = pod_labels(workload)[label.group(1)]
        else:
            assert path == "metadata.namespace", path
            env[var["name"]] = "<namespace>"
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion; an undefined variable stays as written (and fails below)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def effective_args(docs: list[dict], workload: dict, c: dict) -> dict[str, str]:
    """``--flag value`` / ``--flag=value`` options after variable expansion (flags without a
    value map to "")."""
    env = environment(docs, workload, c)
    args = [expand(a, env) for a in c["args"]]
    for a in args:
        assert "$(" not in a, f"{workload['metadata']['name']}: undefined variable in {a!r}"
    opts: dict[str, str] = {"": args[0]}
    i = 1
    while i < len(args):
        flag, sep, value = args[i].partition("=")
        assert flag.startswith("--"), args
        if not sep and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        opts[flag] = value
        i += 1
    return opts


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_renders_and_validates_strictly(target: str, version: str, tmp_path: Path) -> None:
    docs = docs_of(target)
    assert {"Deployment", "StatefulSet", "Service", "NetworkPolicy", "ServiceAccount", "Role",
            "RoleBinding", "PodDisruptionBudget", "ConfigMap"} <= {d["kind"] for d in docs}
    kubernetes_validate(docs, tmp_path, version)


@pytest.mark.parametrize("target", TARGETS)
def test_release_labels_and_no_namespace(target: str) -> None:
    for d in docs_of(target):
        meta = d["metadata"]
        assert COMMON_LABELS.items() <= meta["labels"].items(), (d["kind"], meta["name"])
        if d["kind"] == "ConfigMap" and "spin-mps" in d.get("data", {}):
            # The device plugin reads its config from its own namespace.
            assert target == "gpu" and meta["namespace"] == "nvidia-device-plugin"
        else:
            assert "namespace" not in meta, (d["kind"], meta["name"])
    for name, w in workloads(docs_of(target)).items():
        assert COMMON_LABELS.items() <= pod_labels(w).items(), name
        assert component(w) == pod_labels(w)["app.kubernetes.io/component"]
        assert component(w) in {"router", "verifier", "drafter", "redis"}


@pytest.mark.parametrize("target", TARGETS)
def test_one_deployment_and_discoverable_service_per_drafter(target: str) -> None:
    docs = docs_of(target)
    drafters, _, models = EXPECTED[target]
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    found = sorted(w["metadata"]["labels"]["spin.dev/drafter"] for w in deployments.values()
                   if component(w) == "drafter")
    assert found == drafters
    for name in drafters:
        dep, svc = deployments[f"spin-drafter-{name}"], services[f"spin-drafter-{name}"]
        assert pod_labels(dep)["spin.dev/drafter"] == name
        assert dep["spec"]["selector"]["matchLabels"]["spin.dev/drafter"] == name
        # What the router's discovery reads (copied from the Service to its EndpointSlices).
        labels = svc["metadata"]["labels"]
        assert labels["spin.dev/role"] == "drafter" and labels["spin.dev/drafter"] == name
        assert labels["app.kubernetes.io/instance"] == "spin"
        # The Service selects this drafter's pods and no other drafter's.
        selected = [n for n, w in deployments.items() if selects(svc["spec"]["selector"], pod_labels(w))]
        assert selected == [f"spin-drafter-{name}"]
        c = container(dep)
        opts = effective_args(docs, dep, c)
        assert opts[""] == "drafter" and opts["--name"] == name
        assert opts["--model"] == f"{models}/{name}"
        assert opts["--host"] == "0.0.0.0" and opts["--port"] == "50071"
        assert opts["--metrics-port"] == "9090"
        assert environment(docs, dep, c)["OTEL_SERVICE_NAME"] == f"spin-drafter-{name}"
        grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert grpc["port"] == 50071 and grpc["targetPort"] == "grpc"
        assert {"name": "grpc", "containerPort": 50071, "protocol": "TCP"} in c["ports"]


@pytest.mark.parametrize("target", TARGETS)
def test_verifier_router_and_redis_wiring(target: str) -> None:
    docs = docs_of(target)
    _, _, models = EXPECTED[target]
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    verifier = deployments["spin-verifier"]
    opts = effective_args(docs, verifier, container(verifier))
    assert opts[""] == "verifier" and opts["--model"] == f"{models}/target"
    assert opts["--port"] == "50061" and opts["--host"] == "0.0.0.0"
    vsvc = services["spin-verifier"]
    assert vsvc["metadata"]["labels"]["spin.dev/role"] == "verifier"
    assert "spin.dev/drafter" not in vsvc["metadata"]["labels"]

    router = deployments["spin-router"]
    c = container(router)
    opts = effective_args(docs, router, c)
    assert opts[""] == "router"
    assert opts["--discovery"] == "kubernetes" and opts["--label-selector"] == RELEASE_SELECTOR
    assert opts["--tokenizer"] == f"{models}/target"
    redis_svc = services["spin-redis"]
    assert opts["--redis-url"] == f"redis://{redis_svc['metadata']['name']}:" \
                                  f"{redis_svc['spec']['ports'][0]['port']}/0"
    namespace = next(e for e in c["env"] if e["name"] == "POD_NAMESPACE")
    assert namespace["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # The router finds only drafters and verifiers: no other Service claims a role.
    roles = {n: s["metadata"]["labels"].get("spin.dev/role") for n, s in services.items()}
    assert {n for n, r in roles.items() if r} == {n for n in services if n.startswith(
        ("spin-drafter-", "spin-verifier"))}
    # The release selector the router watches with matches every Service of the release.
    key, value = RELEASE_SELECTOR.split("=")
    assert all(s["metadata"]["labels"][key] == value for s in services.values())

    if target != "gpu":  # the demo family baked into the CPU image is the repository's
        for path in (f"{models}/target", *(f"{models}/{d}" for d in EXPECTED[target][0])):
            local = FAMILY / Path(path).relative_to(DEMO_MODELS_IN_IMAGE)
            assert (local / "config.json").exists(), f"{path}: not in models/demo"


@pytest.mark.parametrize("target", TARGETS)
def test_router_rbac_is_list_watch_endpointslices_only(target: str) -> None:
    docs = docs_of(target)
    router = by_kind(docs, "Deployment")["spin-router"]
    sa = pod_spec(router)["serviceAccountName"]
    assert sa in by_kind(docs, "ServiceAccount")
    (role,) = by_kind(docs, "Role").values()
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["list", "watch"]}]
    (binding,) = by_kind(docs, "RoleBinding").values()
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    for name, w in workloads(docs).items():  # no API token where no API is used
        if name != "spin-router":
            assert pod_spec(w)["automountServiceAccountToken"] is False, name


@pytest.mark.parametrize("target", TARGETS)
def test_selectors_match_pod_labels(target: str) -> None:
    docs = docs_of(target)
    ws = workloads(docs)
    for name, w in ws.items():
        assert selects(w["spec"]["selector"]["matchLabels"], pod_labels(w)), name
    for name, svc in by_kind(docs, "Service").items():
        selected = [n for n, w in ws.items() if selects(svc["spec"]["selector"], pod_labels(w))]
        assert len(selected) == 1, (name, selected)
        c = pod_spec(ws[selected[0]])["containers"][0]
        port_names = {p["name"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names, name
    for name, pdb in by_kind(docs, "PodDisruptionBudget").items():
        selected = [n for n, w in ws.items() if selects(pdb["spec"]["selector"]["matchLabels"],
                                                         pod_labels(w))]
        assert selected == ["spin-router"], name
    redis = by_kind(docs, "StatefulSet")["spin-redis"]
    governing = by_kind(docs, "Service")[redis["spec"]["serviceName"]]
    assert governing["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("target", TARGETS)
def test_probes_resources_and_security(target: str) -> None:
    docs = docs_of(target)
    for name, w in workloads(docs).items():
        spec = pod_spec(w)
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            where = f"{name}/{c['name']}"
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= c["resources"][kind].keys(), where
            sc = {**spec["securityContext"], **c["securityContext"]}
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 10001, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            if component(w) not in GRPC_PORTS:
                continue
            # The only writable places of the image under a read-only root filesystem.
            for path in ("/tmp", "/home/spin/.cache"):
                assert "emptyDir" in volumes[mounts[path]], (where, path)
            port = GRPC_PORTS[component(w)]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["grpc"] == {"port": port}, (where, probe)
            assert next(p for p in c["ports"] if p["name"] == "metrics")["containerPort"] == 9090
            if component(w) == "verifier":
                startup = c["startupProbe"]
                assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, \
                    "the verifier's startup probe must allow minutes of model loading"
                assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def allowed(docs: list[dict], dest: dict[str, str], port: str, source: dict[str, str]) -> bool:
    """NetworkPolicy ingress semantics (one namespace, pod selectors, named ports): may a pod
    with labels ``source`` reach the container port named ``port`` of a pod with labels
    ``dest``? ``source`` {} stands for a client outside the release."""
    policies = [p for p in by_kind(docs, "NetworkPolicy").values()
                if "Ingress" in p["spec"]["policyTypes"]
                and selects(p["spec"]["podSelector"].get("matchLabels", {}), dest)]
    if not policies:
        return True
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(x["port"] == port for x in ports):
                continue
            peers = rule.get("from")
            if peers is None or any(selects(peer["podSelector"].get("matchLabels", {}), source)
                                    for peer in peers if "podSelector" in peer):
                return True
    return False


@pytest.mark.parametrize("target", TARGETS)
def test_network_policies(target: str) -> None:
    docs = docs_of(target)
    ws = workloads(docs)
    pods = {name: pod_labels(w) for name, w in ws.items()}
    router, verifier, redis = pods["spin-router"], pods["spin-verifier"], pods["spin-redis"]
    drafters = [pods[n] for n in pods if n.startswith("spin-drafter-")]
    outside: dict[str, str] = {}
    for name, w in ws.items():  # policies name ports that exist on the pods they select
        named = {p["name"] for c in pod_spec(w)["containers"] for p in c["ports"]}
        for p in by_kind(docs, "NetworkPolicy").values():
            if selects(p["spec"]["podSelector"].get("matchLabels", {}), pod_labels(w)):
                for rule in p["spec"].get("ingress", []):
                    assert {x["port"] for x in rule.get("ports", [])} <= named, (name, rule)
    assert allowed(docs, router, "grpc", outside)
    for backend in (verifier, *drafters):
        assert allowed(docs, backend, "grpc", router)
        assert not allowed(docs, backend, "grpc", outside)
        assert not allowed(docs, backend, "grpc", drafters[0] if backend is verifier else verifier)
    for pod in (router, verifier, *drafters):  # Prometheus, wherever it runs
        assert allowed(docs, pod, "metrics", outside)
    assert allowed(docs, redis, "redis", router)
    assert not allowed(docs, redis, "redis", outside)
    assert not allowed(docs, redis, "redis", verifier)


@pytest.mark.parametrize("target", TARGETS)
def test_images(target: str) -> None:
    _, tag, _ = EXPECTED[target]
    for name, w in spin_workloads(docs_of(target)).items():
        assert container(w)["image"] == f"{IMAGE}:{tag}", name


def test_cpu_demo_runs_every_demo_drafter_small() -> None:
    docs = docs_of("cpu-demo")
    assert len(DEMO_DRAFTERS) == 4
    for name, w in workloads(docs).items():
        assert w["spec"]["replicas"] == 1, name
        limits = container(w)["resources"]["limits"]
        assert not any(k.startswith("nvidia.com/") for k in limits), name
        assert _bytes(limits["memory"]) <= 2 * 2**30, name
        assert _cores(limits["cpu"]) <= 2, name
    base_limits = {n: container(w)["resources"]["requests"]["cpu"] for n, w in workloads(
        docs_of("base")).items()}
    smaller = [n for n, w in workloads(docs).items() if n in base_limits
               and _cores(container(w)["resources"]["requests"]["cpu"]) < _cores(base_limits[n])]
    assert set(smaller) == set(base_limits), "cpu-demo should shrink every request"


def test_gpu_overlay() -> None:
    docs = docs_of("gpu")
    deployments = by_kind(docs, "Deployment")
    verifier = deployments["spin-verifier"]
    res = container(verifier)["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "1"
    assert pod_spec(verifier)["nodeSelector"] == {"nvidia.com/gpu.sharing-strategy": "none"}
    drafters = [w for w in deployments.values() if component(w) == "drafter"]
    assert drafters
    for w in drafters:  # one MPS slice each, on MPS nodes
        res = container(w)["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "1"
        assert pod_spec(w)["nodeSelector"] == {"nvidia.com/gpu.sharing-strategy": "mps"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
            pod_spec(w)["tolerations"]
    router = deployments["spin-router"]
    assert "nvidia.com/gpu" not in container(router)["resources"]["limits"]
    assert "nvidia.com/gpu" not in container(by_kind(docs, "StatefulSet")["spin-redis"])[
        "resources"]["limits"]

    (mps,) = [d for d in by_kind(docs, "ConfigMap").values() if "spin-mps" in d.get("data", {})]
    assert yaml.safe_load(mps["data"]["spin-mps"]) == {
        "version": "v1",
        "sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}}}

    (pvc,) = by_kind(docs, "PersistentVolumeClaim").values()
    assert "ReadWriteMany" in pvc["spec"]["accessModes"] or "ReadOnlyMany" in pvc["spec"]["accessModes"]
    for w in (router, verifier, *drafters):  # every pod that loads a model or tokenizer
        volumes = {v["name"]: v for v in pod_spec(w)["volumes"]}
        (mount,) = [m for m in container(w)["volumeMounts"] if m["mountPath"] == "/models"]
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    for target in ("base", "cpu-demo"):
        for name, w in workloads(docs_of(target)).items():
            assert not any(k.startswith("nvidia.com/") for k in container(w)["resources"]["limits"])
            assert "/models" not in {m["mountPath"] for m in container(w).get("volumeMounts", [])}


# --- model flags and whether they fit ----------------------------------------------------------

CONFIGS = ROOT / "tests" / "deploy" / "configs"
GIB = 1 << 30
MODEL_FLAGS = {
    # overlay: (device, dtype, verifier KV, drafter KV, max model len)
    "base": ("auto", "auto", "512MiB", "128MiB", "1024"),
    "cpu-demo": ("auto", "auto", "512MiB", "128MiB", "1024"),
    "gpu": ("cuda", "bfloat16", "48GiB", "8GiB", "32768"),
}
GPU_MODELS = {"/models/target": CONFIGS / "Qwen2.5-7B-Instruct",
              "/models/draft-code": CONFIGS / "Qwen2.5-Coder-0.5B-Instruct",
              "/models/draft-prose": CONFIGS / "Qwen2.5-0.5B-Instruct"}
"""What the gpu overlay's budgets were sized for (its kustomization says so)."""


def spin_argv(docs: list[dict], workload: dict) -> list[str]:
    """The container's command line after variable expansion."""
    c = container(workload)
    env = environment(docs, workload, c)
    return [expand(a, env) for a in c["args"]]


@pytest.mark.parametrize("target", TARGETS)
def test_model_flags_per_role(target: str) -> None:
    from spin.cli import parser

    docs = docs_of(target)
    device, dtype, verifier_kv, drafter_kv, max_len = MODEL_FLAGS[target]
    for name, w in spin_workloads(docs).items():
        if component(w) == "router":
            continue
        args = parser().parse_args(spin_argv(docs, w))  # the real parser takes them
        kv = verifier_kv if component(w) == "verifier" else drafter_kv
        opts = effective_args(docs, w, container(w))
        assert (opts["--device"], opts["--dtype"], opts["--kv-cache-memory"],
                opts["--max-model-len"]) == (device, dtype, kv, max_len), name
        assert args.max_seqs == 64 and args.gpu_memory_utilization == 0.9
        assert "--slots" not in opts


@pytest.mark.parametrize("target", TARGETS)
def test_every_pod_fits_its_memory(target: str) -> None:
    """The memory plan of every verifier and drafter pod (spin.plan) against its memory limit
    and, in the gpu overlay, a whole 80 GiB GPU (verifier) or an MPS slice of one (drafters)."""
    from spin.cli import parser
    from spin.engine.memory import parse_size
    from spin.engine.model_runner import RunnerConfig
    from spin.plan import format_plan, plan_model

    docs = docs_of(target)
    slices = 1
    if target == "gpu":
        (mps,) = [d for d in by_kind(docs, "ConfigMap").values() if "spin-mps" in d["data"]]
        slices = yaml.safe_load(mps["data"]["spin-mps"])["sharing"]["mps"]["resources"][0][
            "replicas"]
    plans = []
    for name, w in spin_workloads(docs).items():
        if component(w) == "router":
            continue
        a = parser().parse_args(spin_argv(docs, w))
        runner = RunnerConfig(device=a.device, dtype=a.dtype, kv_cache_memory=a.kv_cache_memory,
                              gpu_memory_utilization=a.gpu_memory_utilization,
                              max_model_len=a.max_model_len, max_seqs=a.max_seqs,
                              block_size=a.block_size, quantize=getattr(a, "quantize", "none"))
        if target == "gpu":
            config = GPU_MODELS[str(a.model)]
            gpu = 80 * GIB
            share = gpu if component(w) == "verifier" else gpu // slices
        else:
            config = FAMILY / Path(a.model).relative_to(DEMO_MODELS_IN_IMAGE)
            gpu = share = None
        limit = parse_size(container(w)["resources"]["limits"]["memory"])
        plans.append(plan_model(name, str(a.model), runner, gpu, share, limit,
                                config=config))
    assert len(plans) == 1 + len(EXPECTED[target][0])
    assert all(p.fits for p in plans), format_plan(plans)


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for unit, factor in units.items():
        if quantity.endswith(unit):
            return int(float(quantity[:-2]) * factor)
    return int(quantity)


def _cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)
