#!/usr/bin/env bash
# Build the benchmark peers (Java, Maven) and print the jar path on stdout.
# Idempotent: skips Maven when the jar is newer than every source file.
#   benches/peers/build.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
proj="$here/kstreams-dedup"
jar="$proj/target/kstreams-dedup.jar"

command -v mvn >/dev/null || { echo "build.sh: mvn not found (apt-get install maven)" >&2; exit 1; }
command -v java >/dev/null || { echo "build.sh: java not found (Java 17+ needed)" >&2; exit 1; }

# Any source or the pom newer than the jar (or no jar) means rebuild.
if [[ ! -f "$jar" ]] || [[ -n "$(find "$proj/pom.xml" "$proj/src" -newer "$jar" -print -quit)" ]]; then
    echo "build.sh: building $jar (first build fetches dependencies from Maven Central)" >&2
    log="$(mktemp)"
    if ! (cd "$proj" && mvn -q -B package -DskipTests) >"$log" 2>&1; then
        sed 's/\x1b\[[0-9;]*m//g' "$log" | tail -n 40 >&2
        rm -f "$log"
        echo "build.sh: Maven build failed" >&2
        exit 1
    fi
    rm -f "$log"
    [[ -f "$jar" ]] || { echo "build.sh: Maven succeeded but $jar is missing" >&2; exit 1; }
    touch "$jar" # shade may keep an older mtime; make the skip check reliable
fi
echo "$jar"
