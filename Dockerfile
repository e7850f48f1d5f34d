# syntax=docker/dockerfile:1
# One image with the airlock binaries; the compose service's command picks one
# (`airlock-mcp` is there for an MCP client that starts it with `docker run -i`).
# bubblewrap isolates sandboxed tasks, slirp4netns gives tiers with a network theirs (a
# worker that runs sandbox jobs refuses to start when it cannot isolate them).
# Dependencies are built in their own layer (cargo-chef), so a code change rebuilds only
# airlock's own crates.

FROM rust:1-bookworm AS chef
RUN cargo install cargo-chef --locked --version ^0.1
WORKDIR /src

FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

FROM chef AS builder
COPY --from=planner /src/recipe.json recipe.json
RUN cargo chef cook --release --locked --recipe-path recipe.json
COPY . .
RUN cargo build --release --locked --bin airlock-api --bin airlock-admin --bin airlock-worker --bin airlock-mcp

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates bubblewrap slirp4netns \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/airlock --create-home airlock
COPY --from=builder /src/target/release/airlock-api /src/target/release/airlock-admin /src/target/release/airlock-worker \
     /src/target/release/airlock-mcp /usr/local/bin/
USER 10001:10001
WORKDIR /var/lib/airlock
ENV AIRLOCK_LOG_FORMAT=json \
    AIRLOCK__API__LISTEN=0.0.0.0:7070 \
    AIRLOCK__ADMIN__LISTEN=0.0.0.0:7071 \
    AIRLOCK__WORKER__METRICS_LISTEN=0.0.0.0:7073
EXPOSE 7070 7071 7073
# Each compose service overrides the probed port; this default fits the agent API.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["airlock-admin", "probe", "http://127.0.0.1:7070/healthz"]
CMD ["airlock-api"]
