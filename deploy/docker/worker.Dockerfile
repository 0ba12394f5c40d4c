# Worker image: `accrue-worker` built with the `cuda` feature (NCCL through
# cudarc, loaded at run time) against the libtorch of PyTorch 2.13.0, the
# version tch 0.26 binds, on an NVIDIA CUDA base, as a non-root user.
#
#   docker build -f deploy/docker/worker.Dockerfile -t accrue/worker:0.1.0-cuda .
#
# CUDA_VERSION is the one knob: it picks the PyTorch wheel index (13.0.1 ->
# cu130), cudarc's bindings (CUDARC_CUDA_VERSION=13000, see
# .cargo/config.toml) and the runtime base (nvidia/cuda:13.0.1-base-...).
# The PyTorch wheels bring their own CUDA libraries (cuBLAS, cuDNN, NCCL,
# ... under site-packages/nvidia), so the runtime base is NVIDIA's `base`
# flavour (cudart and the driver's compatibility files only): `runtime`
# would ship those libraries a second time. CUDA_IMAGE=runtime is there for
# a libtorch that expects the system's CUDA libraries.
#
# A CPU-only image (for deploy/k8s/overlays/cpu-dev on a laptop cluster):
#
#   docker build -f deploy/docker/worker.Dockerfile -t accrue/worker:0.1.0-cpu \
#     --build-arg CUDA_VERSION=cpu --build-arg RUNTIME_BASE=debian:bookworm-slim .
#
# Run from the repository root.

ARG CUDA_VERSION=13.0.1
ARG CUDA_IMAGE=base
ARG RUNTIME_BASE=nvidia/cuda:${CUDA_VERSION}-${CUDA_IMAGE}-ubuntu24.04

FROM rust:1.95-bookworm AS build
ARG CUDA_VERSION
ARG TORCH_VERSION=2.13.0
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-venv \
 && rm -rf /var/lib/apt/lists/*
# The same layout as scripts/setup.sh: a venv holding PyTorch, whose
# libtorch tch links (LIBTORCH_USE_PYTORCH=1, as scripts/env.sh sets).
ENV VIRTUAL_ENV=/opt/accrue/venv LIBTORCH_USE_PYTORCH=1
ENV PATH=/opt/accrue/venv/bin:$PATH
# 13.0.1 -> wheel index cu130, cudarc 13000, feature cuda; cpu -> neither.
RUN case "$CUDA_VERSION" in \
      cpu) echo "cpu  " ;; \
      *) v=${CUDA_VERSION#*.}; echo "cu${CUDA_VERSION%%.*}${v%%.*} ${CUDA_VERSION%%.*}0${v%%.*}0 cuda" ;; \
    esac > /opt/cuda-choice \
 && read -r index _ _ < /opt/cuda-choice \
 && python3 -m venv "$VIRTUAL_ENV" \
 && pip install --no-cache-dir --index-url "https://download.pytorch.org/whl/$index" "torch==$TORCH_VERSION"
WORKDIR /src
COPY . .
# worker/build.rs bakes torch/lib of the venv into the binary's rpath, so
# the runtime stage puts those libraries at the very same path; the wheels'
# CUDA library directories go to ld.so.conf, found here rather than named,
# so no path in the image dangles. cudarc dlopens NCCL as `libnccl.so` (or
# .so.<CUDA major>), never by its soname `libnccl.so.2`, the only name the
# wheel ships: hence the link.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    read -r _ cudarc features < /opt/cuda-choice \
 && if [ -n "$cudarc" ]; then export CUDARC_CUDA_VERSION="$cudarc"; fi \
 && cargo build --release --locked -p accrue-worker --bin accrue-worker --features "$features" \
 && mkdir -p /out/usr/local/bin /out/etc/ld.so.conf.d \
 && cp target/release/accrue-worker /out/usr/local/bin/ \
 && site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && cp -a --parents "$site/torch/lib" /out/ \
 && if [ -d "$site/nvidia" ]; then cp -a --parents "$site/nvidia" /out/; fi \
 && find "$site/nvidia" -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u \
      > /out/etc/ld.so.conf.d/accrue-torch-cuda.conf \
 && for f in $(find "$site/nvidia" -name 'libnccl.so.2' 2>/dev/null); do \
      ln -sf libnccl.so.2 "/out${f%/*}/libnccl.so"; \
    done

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
# libcuda itself comes from the NVIDIA container toolkit at run time.
COPY --from=build /out/etc/ld.so.conf.d/ /etc/ld.so.conf.d/
RUN ldconfig
USER 65532:65532
# 7071: collective ring (TCP); 7072: gRPC health; 7073: plan relay (TCP);
# 9091: HTTP metrics.
# `--gpus all` moves local rank i's ports up by 100·i; its metrics ports
# are declared (the PodMonitor scrapes them by name).
EXPOSE 7071 7072 7073 9091 9191 9291 9391 9491 9591 9691 9791
# Docker's own check (Kubernetes uses the manifests' gRPC probes): the
# worker's liveness on its health port (--health-listen 0.0.0.0:7072, as the
# manifests run it).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["/usr/local/bin/accrue-worker", "--health-check", "127.0.0.1:7072"]
ENTRYPOINT ["/usr/local/bin/accrue-worker"]
