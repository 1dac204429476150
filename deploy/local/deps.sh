#!/usr/bin/env bash
# Installs (as root) or names (otherwise) what building and testing stepgate need
# on a Debian/Ubuntu machine. Sourced by demo.sh and test.sh; safe to run alone.
set -euo pipefail

missing=()
dpkg -s libclang-dev >/dev/null 2>&1 || missing+=(libclang-dev)   # RocksDB's bindgen
command -v c++ >/dev/null 2>&1 || missing+=(build-essential)
command -v make >/dev/null 2>&1 || missing+=(make)
dpkg -s libssl-dev >/dev/null 2>&1 || missing+=(libssl-dev)       # librdkafka TLS, reqwest
dpkg -s zlib1g-dev >/dev/null 2>&1 || missing+=(zlib1g-dev)
dpkg -s libsasl2-dev >/dev/null 2>&1 || missing+=(libsasl2-dev)   # librdkafka GSSAPI (Kerberos)
dpkg -s libcurl4-openssl-dev >/dev/null 2>&1 || missing+=(libcurl4-openssl-dev) # librdkafka OIDC
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]]; then
  command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)
  command -v mvn >/dev/null 2>&1 || missing+=(maven)
  command -v kcat >/dev/null 2>&1 || missing+=(kcat)                  # interop tests
  command -v openssl >/dev/null 2>&1 || missing+=(openssl)            # kafka.sh's SASL_SSL certificates
  command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose) # validates docker-compose.yml
  command -v python3 >/dev/null 2>&1 || missing+=(python3 python3-pip)
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)          # tests/broker/console.rs's browser
fi
# tests/offline/wheel.rs installs the wheel it builds into a fresh `python3 -m venv`
# (on Debian's python3, venv's pip comes with python3-venv).
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]] && ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
  missing+=(python3-venv)
fi

if ((${#missing[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "installing: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "missing packages: ${missing[*]}" >&2
    echo "run: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi

# The interop tests drive stepgate from Python's confluent-kafka.
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]] && ! python3 -c 'import confluent_kafka' 2>/dev/null; then
  echo "installing the Python package confluent-kafka"
  python3 -m pip install -q confluent-kafka 2>/dev/null ||
    python3 -m pip install -q --break-system-packages confluent-kafka
fi

# tests/broker/python_client.rs drives the Python client's OpenAI Agents SDK and
# LangGraph adapters; tests/broker/mcp.rs drives `stepgate mcp` with the official MCP
# SDK's client and puts a FastMCP server behind it as a tool.
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]] &&
  ! python3 -c 'import agents, langgraph, mcp, fastmcp' 2>/dev/null; then
  echo "installing the Python packages openai-agents, langgraph, mcp and fastmcp"
  python3 -m pip install -q openai-agents langgraph mcp fastmcp 2>/dev/null ||
    python3 -m pip install -q --break-system-packages openai-agents langgraph mcp fastmcp
fi

# tests/broker/python_client.rs runs the Python client's own pytest suite
# (clients/python/tests).
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]] && ! python3 -c 'import pytest' 2>/dev/null; then
  echo "installing the Python package pytest"
  python3 -m pip install -q pytest 2>/dev/null ||
    python3 -m pip install -q --break-system-packages pytest
fi

# tests/broker/console.rs drives the console in Debian's chromium through Playwright
# for Python (its own browser download is not used: `executable_path`).
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]] && ! python3 -c 'import playwright.sync_api' 2>/dev/null; then
  echo "installing the Python package playwright"
  python3 -m pip install -q playwright 2>/dev/null ||
    python3 -m pip install -q --break-system-packages playwright
fi

# The TypeScript client's tests (clients/typescript) need Node.js 20 or newer
# with npm; Debian bookworm's own nodejs is 18, so it is named, not installed.
# Its native Kafka module builds with make, a C++ compiler and python3 (above).
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]]; then
  node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
  if ((node_major < 20)) || ! command -v npm >/dev/null 2>&1; then
    echo "missing: Node.js >= 20 with npm (clients/typescript; found ${node_major:-none})" >&2
    exit 1
  fi
fi

# A Go tool the tests run, installed with `go install` (as root) when missing.
go=$(command -v go || echo /usr/local/go/bin/go)
go_install() { # what module@version
  if [[ -x "$go" && $(id -u) == 0 ]]; then
    echo "installing $1 (go install $2)"
    GOBIN=/usr/local/bin "$go" install "$2"
  else
    echo "missing: $1 (go install $2)" >&2
    exit 1
  fi
}

# tests/offline/deploy.rs renders the Kubernetes overlays as `kubectl apply -k` would:
# with kubectl's kustomize, or kustomize itself (a Go module) where kubectl is absent.
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]] && ! command -v kubectl >/dev/null 2>&1 &&
  ! command -v kustomize >/dev/null 2>&1; then
  go_install "kubectl or kustomize" sigs.k8s.io/kustomize/kustomize/v5@v5.5.0
fi

# tests/offline/deploy.rs checks the alert rules and runs their unit tests with
# Prometheus' promtool (a Go module: ~10 min to build once).
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]] && ! command -v promtool >/dev/null 2>&1; then
  go_install promtool github.com/prometheus/prometheus/cmd/promtool@v0.316.0
fi

# tests/offline/deploy.rs validates every overlay's rendered output with kubeconform
# (a Go module) in strict mode, offline, against JSON schemas that
# kubeconform-schemas.py writes to $STEPGATE_K8S_SCHEMAS: the Kubernetes API's,
# from the PyPI package kubernetes-validate, and the Prometheus Operator CRDs'
# (PodMonitor, PrometheusRule), from the operator's Go module. SOURCE in that
# directory names the pinned versions it was written from.
k8s_schemas=${STEPGATE_K8S_SCHEMAS:-/usr/local/share/stepgate/k8s-schemas}
k8s_schemas_from="kubernetes-validate==1.37.0 github.com/prometheus-operator/prometheus-operator@v0.85.0"
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]] && ! command -v kubeconform >/dev/null 2>&1; then
  go_install kubeconform github.com/yannh/kubeconform/cmd/kubeconform@v0.8.0
fi
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]] &&
  [[ "$(cat "$k8s_schemas/SOURCE" 2>/dev/null)" != "$k8s_schemas_from" ]]; then
  if [[ -x "$go" && $(id -u) == 0 ]]; then
    echo "writing the Kubernetes JSON schemas to $k8s_schemas ($k8s_schemas_from)"
    if ! python3 -c 'from kubernetes_validate.version import __version__ as v; assert v == "1.37.0"' 2>/dev/null; then
      python3 -m pip install -q kubernetes-validate==1.37.0 2>/dev/null ||
        python3 -m pip install -q --break-system-packages kubernetes-validate==1.37.0
    fi
    operator=$("$go" mod download -json github.com/prometheus-operator/prometheus-operator@v0.85.0 |
      python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
    rm -rf "$k8s_schemas"
    python3 "$(dirname "${BASH_SOURCE[0]}")/kubeconform-schemas.py" "$k8s_schemas" \
      "$operator/example/prometheus-operator-crd"
    echo "$k8s_schemas_from" >"$k8s_schemas/SOURCE"
  else
    echo "missing: the Kubernetes JSON schemas in $k8s_schemas ($k8s_schemas_from; run this as root)" >&2
    exit 1
  fi
fi

# tests/offline/deploy.rs validates the Grafana dashboard with deploy/grafana/check, a
# Go program on the Grafana Foundation SDK (pinned in its go.mod), which the
# test runs offline (GOPROXY=off): fetch the SDK and build it once here.
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]]; then
  check="$(dirname "${BASH_SOURCE[0]}")/../grafana/check"
  if ! (cd "$check" && GOPROXY=off "$go" build -o /dev/null .) >/dev/null 2>&1; then
    if [[ -x "$go" ]]; then
      echo "fetching and building deploy/grafana/check (github.com/grafana/grafana-foundation-sdk/go)"
      (cd "$check" && "$go" mod download && "$go" build -o /dev/null .)
    else
      echo "missing: go (deploy/grafana/check is a Go program)" >&2
      exit 1
    fi
  fi
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "Rust is not installed: install it with rustup (https://rustup.rs), then run this again." >&2
  exit 1
fi
