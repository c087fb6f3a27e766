"""The chart's monitoring: ServiceMonitor/PodMonitor, the PrometheusRule (alerts) and the Grafana
dashboards, checked with the real tools (helm, promtool, the prometheus-operator schemas, tsc with
@grafana/schema) and against the metrics the running services export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.conftest import (CHART, K8S_VERSIONS, MONITORING_APIS, TOOLS, by_kind, helm_template,
                             kubernetes_validate, run, tool)

HERE = Path(__file__).resolve().parent
PROMTOOL_TESTS = HERE / "promtool"
TYPECHECK = HERE / "typecheck"
DASHBOARDS = CHART / "files" / "dashboards"
NODE_MODULES = TOOLS / "node_modules"
CRD_KINDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")
SCRAPED = ("router", "drafter", "verifier")
EVENT_ONLY = {"spin:drafter_failures_total", "spin:service_resyncs_total",
              "spin:suffix_share_texts_total"}
"""Counters of failures, and of a feature off by default (``--suffix-share``): a healthy system
with the defaults has no samples of them, only their declaration."""


def apis(*names: str) -> list[str]:
    return [a for api in names for a in ("--api-versions", api)]


def node_tool(rel: str) -> Path:
    path = NODE_MODULES / rel
    if not path.exists():
        pytest.fail(f"{path} is missing: run `scripts/deploy-tools.sh` (make test does)")
    return path


def kinds(docs: list[dict]) -> set[str]:
    return {d["kind"] for d in docs}


def dashboard_configmaps(docs: list[dict]) -> dict[str, dict]:
    return {n: d for n, d in by_kind(docs, "ConfigMap").items() if "-dashboard-" in n}


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    """The chart with every monitoring object (the PodMonitor is off by default)."""
    return helm_template(*apis(*MONITORING_APIS), "--set", "monitoring.podMonitor.enabled=true")


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def rule_groups(docs: list[dict]) -> list[dict]:
    (rule,) = by_kind(docs, "PrometheusRule").values()
    return rule["spec"]["groups"]


def alerts(docs: list[dict]) -> dict[str, dict]:
    return {r["alert"]: r for g in rule_groups(docs) for r in g["rules"] if "alert" in r}


# ---- which objects render ------------------------------------------------------------------------
def test_monitoring_objects_render_only_where_the_cluster_has_the_crds(rendered) -> None:
    assert set(CRD_KINDS) <= kinds(rendered)
    without = helm_template()
    assert not set(CRD_KINDS) & kinds(without), "prometheus-operator objects without the CRDs"
    assert set(dashboard_configmaps(without)) == set(dashboard_configmaps(rendered))
    for api, kind in zip(MONITORING_APIS, CRD_KINDS):
        only = helm_template(*apis(api), "--set", "monitoring.podMonitor.enabled=true")
        assert set(CRD_KINDS) & kinds(only) == {kind}, api


def test_disabled_monitoring_objects_are_absent() -> None:
    docs = helm_template(*apis(*MONITORING_APIS))
    assert "PodMonitor" not in kinds(docs), "the PodMonitor is off by default"
    off = helm_template(*apis(*MONITORING_APIS), "--set", "monitoring.serviceMonitor.enabled=false",
                        "--set", "monitoring.prometheusRule.enabled=false",
                        "--set", "monitoring.dashboards.enabled=false")
    assert not set(CRD_KINDS) & kinds(off)
    assert not dashboard_configmaps(off)
    assert {"Deployment", "Service"} <= kinds(off), "only the monitoring objects go"


# ---- scraping ------------------------------------------------------------------------------------
def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def _port_names(ports: list[dict]) -> set[str]:
    return {p.get("name") for p in ports}


def test_monitors_scrape_the_metrics_port_of_every_component(rendered) -> None:
    (sm,) = by_kind(rendered, "ServiceMonitor").values()
    (pm,) = by_kind(rendered, "PodMonitor").values()
    for mon, endpoints in ((sm, sm["spec"]["endpoints"]), (pm, pm["spec"]["podMetricsEndpoints"])):
        assert mon["metadata"]["namespace"] == "serving"
        assert mon["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}
        (ep,) = endpoints
        assert (ep["port"], ep["path"], ep["interval"]) == ("metrics", "/metrics", "15s")
        for source, target in (("instance", "spin_release"), ("component", "spin_component")):
            assert {"sourceLabels": [f"__meta_kubernetes_pod_label_app_kubernetes_io_{source}"],
                    "targetLabel": target, "action": "replace"} in ep["relabelings"]
    services = by_kind(rendered, "Service")
    selected = {n: s for n, s in services.items() if _selects(sm["spec"]["selector"],
                                                              s["metadata"]["labels"])}
    roles = {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected.values()}
    assert roles == set(SCRAPED), f"ServiceMonitor selects {sorted(selected)}"
    for name, svc in selected.items():
        assert "metrics" in _port_names(svc["spec"]["ports"]), f"{name} has no `metrics` port"
    pods = [d["spec"]["template"] for d in rendered if d["kind"] in ("Deployment", "StatefulSet")]
    selected_pods = [p for p in pods if _selects(pm["spec"]["selector"], p["metadata"]["labels"])]
    assert {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in selected_pods} \
        == set(SCRAPED)
    for p in selected_pods:
        ports = {port.get("name") for c in p["spec"]["containers"] for port in c.get("ports", [])}
        assert "metrics" in ports, p["metadata"]["labels"]


def test_monitor_labels_come_from_values() -> None:
    docs = helm_template(*apis(*MONITORING_APIS), "--set", "monitoring.podMonitor.enabled=true",
                         "--set", "monitoring.serviceMonitor.labels.release=kps",
                         "--set", "monitoring.podMonitor.labels.release=kps",
                         "--set", "monitoring.prometheusRule.labels.release=kps",
                         "--set", "monitoring.serviceMonitor.interval=30s")
    for kind in CRD_KINDS:
        (obj,) = by_kind(docs, kind).values()
        assert obj["metadata"]["labels"]["release"] == "kps", kind
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == "spin", kind
    (sm,) = by_kind(docs, "ServiceMonitor").values()
    assert sm["spec"]["endpoints"][0]["interval"] == "30s"


# ---- prometheus-operator schemas -----------------------------------------------------------------
def _validate_crds(objects: list[dict]) -> subprocess.CompletedProcess:
    node = shutil.which("node")
    assert node, "node is missing: install Node.js (scripts/deploy-tools.sh needs it too)"
    node_tool("@kubernetes-models/prometheus-operator/package.json")
    return subprocess.run([node, str(HERE / "validate_crds.mjs"), str(NODE_MODULES)],
                          input=json.dumps(objects), capture_output=True, text=True)


def test_monitoring_objects_validate_against_the_operator_schemas(rendered) -> None:
    objects = [d for d in rendered if d["kind"] in CRD_KINDS]
    proc = _validate_crds(objects)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("valid ") == len(objects) == 3


def test_operator_schema_validation_rejects_broken_objects(rendered) -> None:
    rule = json.loads(json.dumps(by_kind(rendered, "PrometheusRule")["spin"]))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    (sm,) = json.loads(json.dumps(list(by_kind(rendered, "ServiceMonitor").values())))
    sm["spec"]["endpoints"][0]["interval"] = 15
    proc = _validate_crds([rule, sm])
    assert proc.returncode == 1
    assert "INVALID PrometheusRule/spin" in proc.stdout and "/for must match pattern" in proc.stdout
    assert "INVALID ServiceMonitor/spin" in proc.stdout and "interval must be string" in proc.stdout


# ---- tsc: dashboards against @grafana/schema, monitors against the operator's types -----------
TYPES = {"ServiceMonitor": "ServiceMonitorJson", "PodMonitor": "PodMonitorJson",
         "PrometheusRule": "PrometheusRuleJson"}


def _tsc(tmp_path: Path, objects: dict[str, tuple[str, object]]) -> subprocess.CompletedProcess:
    """Compile `export const <name>: <type> = <object>;` for each object, strictly."""
    tsc = node_tool(".bin/tsc")
    node_tool("@grafana/schema/package.json")
    (tmp_path / "node_modules").symlink_to(NODE_MODULES)
    shutil.copy(TYPECHECK / "json.ts", tmp_path / "json.ts")
    types = sorted({t for t, _ in objects.values()})
    lines = [f"import type {{ {', '.join(types)} }} from './json.js';"]
    lines += [f"export const {name}: {t} = {json.dumps(obj, indent=2)};"
              for name, (t, obj) in objects.items()]
    (tmp_path / "objects.ts").write_text("\n".join(lines) + "\n")
    return subprocess.run([str(tsc), "--noEmit", "--strict", "--module", "nodenext",
                           "--moduleResolution", "nodenext", "--target", "es2022",
                           "--pretty", "false", str(tmp_path / "objects.ts")],
                          capture_output=True, text=True, cwd=tmp_path)


def test_dashboards_and_monitors_type_check(rendered, dashboards, tmp_path: Path) -> None:
    objects = {f"dashboard_{n}": ("DashboardJson", d) for n, d in dashboards.items()}
    objects |= {f"{d['kind']}_object": (TYPES[d["kind"]], d) for d in rendered
                if d["kind"] in CRD_KINDS}
    assert len(objects) == 5
    proc = _tsc(tmp_path, objects)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_type_check_rejects_wrong_dashboards_and_monitors(rendered, dashboards,
                                                          tmp_path: Path) -> None:
    bad = json.loads(json.dumps(dashboards["serving"]))
    bad["panels"][1]["gridPos"]["h"] = "4"  # a string where the schema has a number
    typo = json.loads(json.dumps(dashboards["speculation"]))
    typo["panels"][1]["fieldConfig"]["defaults"]["untis"] = "s"  # no such field
    enum = json.loads(json.dumps(dashboards["speculation"]))
    enum["templating"]["list"][0]["type"] = "prometheus"  # not a variable type
    (sm,) = json.loads(json.dumps(list(by_kind(rendered, "ServiceMonitor").values())))
    sm["spec"]["endpoints"][0]["relabeling"] = []  # misspelt relabelings
    proc = _tsc(tmp_path, {"wrong_type": ("DashboardJson", bad), "typo": ("DashboardJson", typo),
                           "wrong_enum": ("DashboardJson", enum), "sm": ("ServiceMonitorJson", sm)})
    assert proc.returncode != 0
    out = proc.stdout
    assert "Type 'string' is not assignable to type 'number'" in out, out
    assert "'\"untis\"' does not exist" in out, out
    assert "Type '\"prometheus\"' is not assignable to type 'VariableType'" in out, out
    assert "'\"relabeling\"' does not exist" in out, out
    assert len(re.findall(r"error TS\d+", out)) == 4, out


# ---- dashboards ----------------------------------------------------------------------------------
def _panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]


def _variable_selectors(dashboard: dict) -> list[str]:
    """The series selectors of the query variables (``label_values(<selector>, <label>)``)."""
    out = []
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"])
            assert m, f"{v['name']}: unexpected variable query {v['query']!r}"
            out.append(m.group(1))
    return out


def _datasource_refs(node: object) -> list[dict]:
    if isinstance(node, dict):
        refs = [node["datasource"]] if isinstance(node.get("datasource"), dict) else []
        return refs + [r for v in node.values() for r in _datasource_refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _datasource_refs(v)]
    return []


def test_dashboards_follow_grafana_conventions(dashboards) -> None:
    assert set(dashboards) == {"serving", "speculation"}
    uids = set()
    for name, d in dashboards.items():
        assert 39 <= d["schemaVersion"] <= 42, "Grafana 11/12 dashboard schema"
        uids.add(d["uid"])
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        assert {"namespace", "instance"} <= set(variables)
        refs = _datasource_refs(d)
        assert refs and all(r == {"type": "prometheus", "uid": "${datasource}"} for r in refs), \
            f"{name}: a panel or query names a data source other than ${{datasource}}"
        panels = _panels(d)
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for p in panels:
            if p["type"] != "row":
                assert p["targets"] and p.get("description"), p["title"]
                for e in _exprs({"panels": [p]}):
                    assert 'namespace=~"$namespace"' in e and 'instance=~"$instance"' in e, e
        cells = set()  # panels do not overlap on the 24-column grid
        for p in panels:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                    for y in range(g["y"], g["y"] + g["h"])}
            assert not mine & cells, f"{name}: {p['title']} overlaps another panel"
            cells |= mine
    assert len(uids) == 2


def test_dashboards_show_what_operators_look_for(dashboards) -> None:
    serving = " ".join(_exprs(dashboards["serving"]))
    for metric in ("spin:time_to_first_token_seconds_bucket", "spin:time_per_output_token_seconds",
                   "spin:inter_token_latency_seconds", "spin:e2e_request_latency_seconds",
                   "spin:generation_tokens_total", "spin:request_success_total",
                   "spin:num_requests_waiting", "spin:num_requests_running",
                   "spin:kv_cache_usage_perc", "spin:request_errors_total"):
        assert metric in serving, metric
    for q in ("0.5", "0.9", "0.99"):
        ttft = "spin:time_to_first_token_seconds_bucket"
        assert f"histogram_quantile({q}, sum by (le) (rate({ttft}" in serving
    spec = {p["title"]: " ".join(_exprs({"panels": [p]}))
            for p in _panels(dashboards["speculation"])}
    acc, draft, drafts = (f"spin:spec_decode_num_{c}_total"
                          for c in ("accepted_tokens", "draft_tokens", "drafts"))
    rate_of = r"sum by \(draft_model\) \(rate\({}\{{[^}}]*\}}\[\$__rate_interval\]\)\)"
    assert re.fullmatch(rate_of.format(acc) + " / " + rate_of.format(draft),
                        spec["Acceptance rate per draft model"])
    assert re.fullmatch("1 \\+ " + rate_of.format(acc) + " / " + rate_of.format(drafts),
                        spec["Mean acceptance length τ per draft model"])
    for title, metric in (("Acceptance per position", "accepted_tokens_per_pos_total"),
                          ("Chosen k distribution", "spin:spec_decode_k_bucket"),
                          ("Drafter choice share", "spin:spec_decode_steps_total"),
                          ("Speculation-off share", 'draft_model=""'),
                          ("Goodput", "spin:generation_tokens_total"),
                          ("Step time split (mean per step)", "spin:step_rpc_overhead_seconds"),
                          ("Predicted vs measured step time", "spin:step_predicted_seconds"),
                          ("Verification padded fraction", "spin:verify_padded_fraction"),
                          ("Cost model calibration (measured / predicted)",
                           "spin:cost_model_calibration")):
        assert metric in spec[title], title


def test_dashboard_configmaps_carry_the_sidecar_label(dashboards, tmp_path: Path) -> None:
    docs = helm_template("--set", "monitoring.dashboards.label=grafana_dash",
                         "--set", "monitoring.dashboards.labelValue=yes",
                         "--set", "monitoring.dashboards.annotations.grafana_folder=LLM")
    cms = dashboard_configmaps(docs)
    assert set(cms) == {"spin-dashboard-serving", "spin-dashboard-speculation"}
    for name, cm in cms.items():
        assert cm["metadata"]["labels"]["grafana_dash"] == "yes"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
        (key,) = cm["data"]
        stem = name.removeprefix("spin-dashboard-")
        assert key == f"spin-{stem}.json"
        assert json.loads(cm["data"][key]) == dashboards[stem]
    default = dashboard_configmaps(helm_template())
    assert all(cm["metadata"]["labels"]["grafana_dashboard"] == "1" for cm in default.values())
    kubernetes_validate(list(cms.values()), tmp_path, K8S_VERSIONS[-1])


# ---- PromQL --------------------------------------------------------------------------------------
def _promtool_check(groups: list[dict], path: Path) -> None:
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    run([tool("promtool"), "check", "rules", path])


def _grafana_to_promql(expr: str) -> str:
    """Grafana's variables replaced by values Prometheus accepts."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b", "5m", expr)
    return re.sub(r"\$\{?\w+\}?", "x", expr)  # only inside label matcher strings here


def test_alert_rules_pass_promtool_check(rendered, tmp_path: Path) -> None:
    _promtool_check(rule_groups(rendered), tmp_path / "rules.yaml")
    for name, rule in alerts(rendered).items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert re.fullmatch(r"\d+m", rule["for"]), name
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), name


def test_dashboard_queries_are_valid_promql(dashboards, tmp_path: Path) -> None:
    rules = []
    for name, d in dashboards.items():
        exprs = _exprs(d) + _variable_selectors(d)
        rules += [{"record": f"spin_dashboard:{name}:q{i}", "expr": _grafana_to_promql(e)}
                  for i, e in enumerate(exprs)]
    _promtool_check([{"name": "dashboards", "rules": rules}], tmp_path / "dashboards.yaml")
    broken = tmp_path / "broken.yaml"  # the check can fail
    broken.write_text(yaml.safe_dump({"groups": [{"name": "b", "rules": [
        {"record": "x:y", "expr": _grafana_to_promql("sum by (le (rate(spin:a[$__range]))")}]}]}))
    proc = subprocess.run([str(tool("promtool")), "check", "rules", str(broken)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "parse error" in proc.stdout + proc.stderr


# ---- alert unit tests (promtool test rules) ------------------------------------------------------
def _promtool_test(tmp_path: Path, *values: str) -> subprocess.CompletedProcess:
    docs = helm_template(*apis("monitoring.coreos.com/v1/PrometheusRule"),
                         "-f", PROMTOOL_TESTS / "values.yaml", *values)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups(docs)},
                                                        sort_keys=False))
    shutil.copy(PROMTOOL_TESTS / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    return subprocess.run([str(tool("promtool")), "test", "rules", "alerts_test.yaml"],
                          capture_output=True, text=True, cwd=tmp_path)


def test_every_alert_has_a_firing_and_a_silent_unit_test(rendered) -> None:
    cases = yaml.safe_load((PROMTOOL_TESTS / "alerts_test.yaml").read_text())["tests"]
    fires, silent = set(), set()
    for case in cases:
        for t in case["alert_rule_test"]:
            (fires if t.get("exp_alerts") else silent).add(t["alertname"])
    assert fires == silent == set(alerts(rendered)), (fires, silent)


def test_alert_unit_tests_pass(tmp_path: Path) -> None:
    proc = _promtool_test(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_alert_thresholds_come_from_values(tmp_path: Path) -> None:
    docs = helm_template(*apis(*MONITORING_APIS), "--set", "router.maxQueue=100",
                         "--set-json", "monitoring.prometheusRule.slo.ttftP99Seconds=3.5",
                         "--set-json", "monitoring.prometheusRule.slo.tpotP99Seconds=0.125",
                         "--set-json",
                         "monitoring.prometheusRule.thresholds.acceptanceRateMin=0.35",
                         "--set-json",
                         "monitoring.prometheusRule.thresholds.queueSaturationRatio=0.75")
    a = alerts(docs)
    assert re.search(r"\) > 3\.5$", a["SpinTimeToFirstTokenP99OverSLO"]["expr"])
    assert re.search(r"\) > 0\.125$", a["SpinTimePerOutputTokenP99OverSLO"]["expr"])
    assert re.search(r"\) < 0\.35\s+and", a["SpinAcceptanceCollapse"]["expr"])
    assert a["SpinQueueSaturated"]["expr"].endswith(" / 100 > 0.75")
    for rule in a.values():  # this release's series only
        assert 'namespace="serving", spin_release="spin"' in rule["expr"]
    # and the unit tests notice: thresholds the collapse and TTFT cases no longer meet
    proc = _promtool_test(tmp_path, "--set-json", "monitoring.prometheusRule.slo.ttftP99Seconds=5",
                          "--set-json",
                          "monitoring.prometheusRule.thresholds.acceptanceRateMin=0.05")
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    failed = set(re.findall(r"alertname: (\w+)", out))
    assert failed == {"SpinAcceptanceCollapse", "SpinTimeToFirstTokenP99OverSLO"}, out


# ---- every query names a metric the services export ----------------------------------------------
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
             "bool", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, keywords and labels stripped)."""
    names = set()
    for m in re.finditer(r'__name__\s*=~?\s*"([^"]*)"', expr):
        names |= {n for n in re.split(r"[|()]", m.group(1)) if n}
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, regexes)
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue  # a function call or a keyword
        names.add(m.group(0))
    return names


def test_metric_name_extraction() -> None:
    expr = ('sum by (draft_model, position) (increase(spin:a_total{x=~"$y", draft_model=""}[5m]))'
            ' / ignoring(position) group_left sum by (draft_model) (rate(spin:b_total[5m:1m]))'
            ' * on() group_left vector(1e-9) > bool 0.5 offset 5m or up'
            ' unless label_replace(spin:c, "d", "e:f", "g", "") and '
            '{__name__=~"spin:d|spin:e", le="+Inf"} and histogram_quantile(0.9, spin:h_bucket)')
    assert metric_names(expr) == {"spin:a_total", "spin:b_total", "up", "spin:c", "spin:d",
                                  "spin:e", "spin:h_bucket"}


def _families(body: str) -> tuple[set[str], set[str]]:
    """(names with samples, names declared by # TYPE lines) of a text exposition."""
    sampled, declared = set(), set()
    for line in body.splitlines():
        if m := re.match(r"# TYPE (\S+) (\w+)", line):
            name, kind = m.groups()
            suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            declared |= {name + s for s in suffixes}
        elif line and not line.startswith("#"):
            sampled.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return sampled, declared


def test_queries_name_only_metrics_the_services_export(serving, rendered, dashboards) -> None:
    import urllib.request

    import grpc
    from service_helpers import collect, request

    code = ("def parse(path):\n    with open(path) as f:\n"
            "        return [line.split(',') for line in f]\n")
    collect(serving.endpoint, request(code, max_tokens=16, mode="auto"))
    collect(serving.endpoint,
            request(code, max_tokens=16, mode="drafter", drafter="draft-code", k=4))
    collect(serving.endpoint, request(code, max_tokens=8, mode="off"))
    with pytest.raises(grpc.RpcError):  # an error, so spin:request_errors_total has a sample
        collect(serving.endpoint, request(code, max_tokens=4, mode="drafter", drafter="no-such"))
    sampled, declared = set(), set()
    roles = set()
    for child in serving.children:
        assert child.metrics_port, f"{child.role} exports no metrics"
        roles.add(child.role.split("-")[0])
        body = urllib.request.urlopen(f"http://127.0.0.1:{child.metrics_port}/metrics",
                                      timeout=10).read().decode()
        s, d = _families(body)
        sampled |= s
        declared |= d
    assert roles == set(SCRAPED)
    queries = {f"alert {n}": r["expr"] for n, r in alerts(rendered).items()}
    for name, d in dashboards.items():
        for p in _panels(d):
            for t in p.get("targets", []):
                queries[f"{name}: {p['title']} ({t['refId']})"] = t["expr"]
        for i, sel in enumerate(_variable_selectors(d)):
            queries[f"{name}: variable {i}"] = sel
    used = set()
    missing = {}
    for where, expr in queries.items():
        names = metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        used |= names
        bad = {n for n in names if n not in sampled
               and not (n in EVENT_ONLY and n in declared)}
        if bad:
            missing[where] = sorted(bad)
    assert not missing, f"queries name metrics the services do not export: {missing}"
    assert EVENT_ONLY <= used
    assert "spin:bogus_total" not in sampled | declared  # the check can fail
