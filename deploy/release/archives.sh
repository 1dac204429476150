#!/usr/bin/env bash
# The release's downloads for this machine's platform, each with its checksum:
#
#   stepgate-<version>-<target>.tar.gz (+ .sha256)   the binary, README, LICENSE,
#                                                    the example config
#   stepgate_server-<version>-py3-none-<platform>.whl (+ .sha256)
#                                                    the wheel (deploy/local/wheel.sh)
#
#   bash deploy/release/archives.sh [--release|--dev] [--no-wheel] [--out DIR]
#
# What cargo-dist does for a Rust CLI, written out: one run makes one
# platform's files (<target> is rustc's host triple), so a release runs it on
# each platform it ships (Linux x86_64 and aarch64, macOS). The .sha256 files
# are `sha256sum`'s format: `sha256sum -c stepgate-….tar.gz.sha256` checks one.
# --dev builds with the dev profile (what tests/offline/wheel.rs does), --release (the
# default) optimised. Prints the files' paths, one a line.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"

profile=release
wheel=1
out=""
while (($#)); do
  case "$1" in
    --release) profile=release ;;
    --dev) profile=dev ;;
    --no-wheel) wheel=0 ;;
    --out) out="$2"; shift ;;
    -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "usage: $0 [--release|--dev] [--no-wheel] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done

version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/Cargo.toml" | head -n 1)"
host="$(rustc -vV | sed -n 's/^host: //p')"
name="stepgate-$version-$host"

# As wheel.sh does: dependencies from the usual target directory (Cargo's
# build-dir), the binary written apart, so a dev build does not replace the
# target/debug/stepgate (built with `test-hooks`) that the tests run.
target="${CARGO_TARGET_DIR:-$root/target}"
case "$target" in /*) ;; *) target="$root/$target" ;; esac
out="${out:-$target/dist}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

flags=(--locked -p stepgate --bin stepgate)
dir=debug
if [[ $profile == release ]]; then
  flags+=(--release)
  dir=release
fi
(
  export CARGO_BUILD_BUILD_DIR="${CARGO_BUILD_BUILD_DIR:-$target}"
  export CARGO_TARGET_DIR="$target/dist-build"
  cd "$root"
  cargo build "${flags[@]}" >&2
)
binary="$target/dist-build/$dir/stepgate"

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir "$stage/$name"
cp "$binary" "$stage/$name/stepgate"
strip "$stage/$name/stepgate" 2>/dev/null || true
cp "$root/README.md" "$root/LICENSE" "$root/deploy/stepgate.example.toml" "$stage/$name/"
# Reproducible bytes for the same binary: sorted names, fixed owner and times.
tar -C "$stage" --sort=name --owner=0 --group=0 --numeric-owner \
  --mtime="@${SOURCE_DATE_EPOCH:-0}" -cf - "$name" | gzip -n -9 >"$out/$name.tar.gz"

checksum() { # file: writes file.sha256 beside it, named relative to it
  (cd "$(dirname "$1")" && sha256sum "$(basename "$1")" >"$(basename "$1").sha256")
  echo "$1"
  echo "$1.sha256"
}
checksum "$out/$name.tar.gz"

if ((wheel)); then
  whl="$(bash "$root/deploy/local/wheel.sh" "--$profile" --out "$out" | tail -n 1)"
  checksum "$whl"
fi
