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
  command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose) # validates docker-compose.yml
  command -v python3 >/dev/null 2>&1 || missing+=(python3 python3-pip)
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

# tests/python_client.rs drives the Python client's OpenAI Agents SDK and
# LangGraph adapters; tests/mcp.rs drives `stepgate mcp` with the official MCP
# SDK's client and puts a FastMCP server behind it as a tool.
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]] &&
  ! python3 -c 'import agents, langgraph, mcp, fastmcp' 2>/dev/null; then
  echo "installing the Python packages openai-agents, langgraph, mcp and fastmcp"
  python3 -m pip install -q openai-agents langgraph mcp fastmcp 2>/dev/null ||
    python3 -m pip install -q --break-system-packages openai-agents langgraph mcp fastmcp
fi

# tests/deploy.rs renders the Kubernetes overlays as `kubectl apply -k` would:
# with kubectl's kustomize, or kustomize itself (a Go module) where kubectl is absent.
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]] && ! command -v kubectl >/dev/null 2>&1 &&
  ! command -v kustomize >/dev/null 2>&1; then
  go=$(command -v go || echo /usr/local/go/bin/go)
  if [[ -x "$go" && $(id -u) == 0 ]]; then
    echo "installing kustomize (go install sigs.k8s.io/kustomize/kustomize/v5@v5.5.0)"
    GOBIN=/usr/local/bin "$go" install sigs.k8s.io/kustomize/kustomize/v5@v5.5.0
  else
    echo "missing: kubectl or kustomize (go install sigs.k8s.io/kustomize/kustomize/v5@v5.5.0)" >&2
    exit 1
  fi
fi

# tests/deploy.rs checks the alert rules and runs their unit tests with
# Prometheus' promtool (a Go module: ~10 min to build once).
if [[ "${STEPGATE_NEED_KAFKA:-0}" == 1 ]] && ! command -v promtool >/dev/null 2>&1; then
  go=$(command -v go || echo /usr/local/go/bin/go)
  if [[ -x "$go" && $(id -u) == 0 ]]; then
    echo "installing promtool (go install github.com/prometheus/prometheus/cmd/promtool@v0.316.0)"
    GOBIN=/usr/local/bin "$go" install github.com/prometheus/prometheus/cmd/promtool@v0.316.0
  else
    echo "missing: promtool (go install github.com/prometheus/prometheus/cmd/promtool@v0.316.0)" >&2
    exit 1
  fi
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "Rust is not installed: install it with rustup (https://rustup.rs), then run this again." >&2
  exit 1
fi
