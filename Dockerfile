# Build: docker build -t stepgate .
FROM rust:1-bookworm AS build
# libsasl2 and libcurl: librdkafka's Kerberos (GSSAPI) and OIDC logins.
RUN apt-get update && apt-get install -y --no-install-recommends libclang-dev cmake libsasl2-dev libcurl4-openssl-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Dependencies first, in a layer of their own (RocksDB alone takes ~18 min to
# build): a source edit then rebuilds only stepgate. Stub sources satisfy the
# workspace's manifests: Cargo refuses a manifest whose declared [[example]]
# or [[test]] has no file, so each one named in Cargo.toml gets an empty one.
# stepgate's own artefacts are removed so the real sources below are built
# whatever their timestamps. tests/offline/wheel.rs runs these steps without Docker.
COPY Cargo.toml Cargo.lock ./
COPY crates/stepgate-client/Cargo.toml crates/stepgate-client/
COPY crates/stepgate-bench/Cargo.toml crates/stepgate-bench/
RUN mkdir -p src examples tests crates/stepgate-client/src crates/stepgate-bench/src \
    && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && for e in $(sed -n '/^\[\[example\]\]/{n;s/^name = "\(.*\)"/\1/p;}' Cargo.toml); do \
        echo 'fn main() {}' > "examples/$e.rs"; done \
    && for t in $(sed -n '/^\[\[test\]\]/{n;s/^name = "\(.*\)"/\1/p;}' Cargo.toml); do \
        touch "tests/$t.rs"; done \
    && touch crates/stepgate-client/src/lib.rs \
    && echo 'fn main() {}' > crates/stepgate-bench/src/main.rs \
    && cargo build --release --locked -p stepgate --bin stepgate \
    && rm -rf src examples tests crates target/release/.fingerprint/stepgate-* \
        target/release/deps/stepgate* target/release/deps/libstepgate*
COPY src ./src
COPY crates ./crates
COPY schemas ./schemas
COPY examples ./examples
COPY tests ./tests
# The console's stylesheet and htmx, compiled in (include_str!).
COPY assets ./assets
RUN cargo build --release --locked -p stepgate --bin stepgate

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libssl3 libsasl2-2 libsasl2-modules-gssapi-mit libcurl4 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/stepgate /usr/local/bin/stepgate
# The binary allocates with jemalloc (feature `jemalloc`), which returns freed
# memory to the system; MALLOC_CONF tunes it (README "Performance").
# The state directory belongs to the user the gate runs as (a volume mounted
# there starts with this ownership; Kubernetes' fsGroup does the same).
RUN mkdir -p /var/lib/stepgate && chown 65532:65532 /var/lib/stepgate
USER 65532:65532
WORKDIR /var/lib/stepgate
ENTRYPOINT ["/usr/local/bin/stepgate"]
CMD ["run", "--config", "/etc/stepgate/stepgate.toml"]
