# Build: docker build -t stepgate .
FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends libclang-dev cmake && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY schemas ./schemas
# Cargo.toml names an example (ticket_tool): the manifest needs its file.
COPY examples ./examples
RUN cargo build --release --locked --bin stepgate

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libssl3 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/stepgate /usr/local/bin/stepgate
# The binary allocates with jemalloc (feature `jemalloc`), which returns freed
# memory to the system; MALLOC_CONF tunes it (README "Performance").
USER 65532:65532
WORKDIR /var/lib/stepgate
ENTRYPOINT ["/usr/local/bin/stepgate"]
CMD ["run", "--config", "/etc/stepgate/stepgate.toml"]
