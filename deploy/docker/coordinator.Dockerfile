# Coordinator image: `accrue-coordinator` (server) and `accrue` (CLI) on a
# slim Debian, as a non-root user. Neither binary links libtorch.
#
#   docker build -f deploy/docker/coordinator.Dockerfile -t accrue/coordinator:0.1.0 .
#
# Run from the repository root (the build context; .dockerignore keeps
# target/, .venv/ and runs/ out of it).

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# protoc comes from the protoc-bin-vendored crate: nothing else to install.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p accrue-coordinator -p accrue-cli \
        --bin accrue-coordinator --bin accrue \
 && mkdir -p /out \
 && cp target/release/accrue-coordinator target/release/accrue /out/

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 65532 accrue \
 && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin accrue \
 && mkdir -p /var/lib/accrue/cache/tokens \
 && chown -R 65532:65532 /var/lib/accrue
COPY --from=build /out/accrue-coordinator /out/accrue /usr/local/bin/
USER 65532:65532
# The token cache (the user has no home, and / is not writable): a
# Kubernetes pod points it at the shared volume instead (deploy/k8s).
ENV ACCRUE_CACHE_DIR=/var/lib/accrue/cache/tokens
# 7070: gRPC (admin, worker, grpc.health.v1); 9090: HTTP metrics and status page.
EXPOSE 7070 9090
ENTRYPOINT ["/usr/local/bin/accrue-coordinator"]
CMD ["--listen", "0.0.0.0:7070", "--metrics-listen", "0.0.0.0:9090", "--state-dir", "/var/lib/accrue"]
