# Worker image: `accrue-worker` built with the `cuda` feature (NCCL through
# cudarc, loaded at run time) against the libtorch of PyTorch 2.13.0, the
# version tch 0.26 binds, on an NVIDIA CUDA runtime base, as a non-root user.
#
#   docker build -f deploy/docker/worker.Dockerfile -t accrue/worker:0.1.0-cuda .
#
# A CPU-only image (for deploy/k8s/overlays/cpu-dev on a laptop cluster):
#
#   docker build -f deploy/docker/worker.Dockerfile -t accrue/worker:0.1.0-cpu \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu \
#     --build-arg FEATURES= --build-arg RUNTIME_BASE=debian:bookworm-slim .
#
# Run from the repository root.

# CUDA 13.0 matches cudarc's `cuda-13000` feature (worker/Cargo.toml) and
# the torch wheel index below.
ARG RUNTIME_BASE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

FROM rust:1.95-bookworm AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ARG FEATURES=cuda
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-venv \
 && rm -rf /var/lib/apt/lists/*
# The same layout as scripts/setup.sh: a venv holding PyTorch, whose
# libtorch tch links (LIBTORCH_USE_PYTORCH=1, as scripts/env.sh sets).
ENV VIRTUAL_ENV=/opt/accrue/venv LIBTORCH_USE_PYTORCH=1
ENV PATH=/opt/accrue/venv/bin:$PATH
RUN python3 -m venv "$VIRTUAL_ENV" \
 && pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"
WORKDIR /src
COPY . .
# worker/build.rs bakes torch/lib of the venv into the binary's rpath, so
# the runtime stage puts those libraries at the very same path.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p accrue-worker --bin accrue-worker --features "$FEATURES" \
 && mkdir -p /out/usr/local/bin \
 && cp target/release/accrue-worker /out/usr/local/bin/ \
 && site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && cp -a --parents "$site/torch/lib" /out/ \
 && if [ -d "$site/nvidia" ]; then cp -a --parents "$site/nvidia" /out/; fi

FROM ${RUNTIME_BASE}
RUN (apt-get update \
     && apt-get install -y --no-install-recommends ca-certificates libgomp1 \
     && rm -rf /var/lib/apt/lists/*) \
 && groupadd --gid 65532 accrue \
 && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin accrue \
 && mkdir -p /shared \
 && chown 65532:65532 /shared
# The worker binary and the venv's torch/lib (+ the CUDA wheels' nvidia/*
# libraries torch loads) at the paths they had in the build stage.
COPY --from=build /out/usr/local/bin/accrue-worker /usr/local/bin/accrue-worker
COPY --from=build /out/opt/ /opt/
# NCCL is dlopen'ed by cudarc: put the wheels' library directories on the
# search path (libcuda itself comes from the NVIDIA container toolkit).
ENV LD_LIBRARY_PATH=/opt/accrue/venv/lib/python3.11/site-packages/nvidia/nccl/lib:/opt/accrue/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib:/opt/accrue/venv/lib/python3.11/site-packages/torch/lib
USER 65532:65532
# 7071: collective ring (TCP); 7072: gRPC health; 9091: HTTP metrics.
EXPOSE 7071 7072 9091
ENTRYPOINT ["/usr/local/bin/accrue-worker"]
