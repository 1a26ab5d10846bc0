# syntax=docker/dockerfile:1
#
# ferry's container image: one `ferry` binary for every role (`up`, `router`, `prefill`,
# `decode`, …) and every device. docs/deploy.md says how to run it; deploy/helm/ferry uses it.
#
#   docker build -t ferry:dev .                  # the default target, `cpu`
#   docker build -t ferry:dev-cuda --target cuda .
#
# Targets (the binary is the same in both):
#   cpu   Debian slim + libucx0 + the binary (the embedded tiny-k3 model and its drafter are
#         compiled into it: nothing to download). Runs the model on the CPU.
#   cuda  `cpu` + NVRTC and cuBLAS (CUDA 13.0, from NVIDIA's pip wheels). The binary loads the
#         driver, NVRTC and cuBLAS with dlopen at run time (cudarc `dynamic-loading`), so no
#         CUDA toolkit is needed to build. The NVIDIA Container Toolkit injects only the
#         *driver* (libcuda.so.1) into a container, not NVRTC or cuBLAS — which is why this
#         target adds them. Run it with the toolkit (driver >= 580, i.e. CUDA 13.0):
#           docker run --gpus all -p 8000:8000 -p 50051:50051 ferry:dev-cuda \
#             up --device cuda --http-addr 0.0.0.0:8000 --grpc-addr 0.0.0.0:50051
#         (Kubernetes: the NVIDIA device plugin and `nvidia.com/gpu` limits do the same.)
#         The `cpu` image can also use a GPU if NVRTC/cuBLAS 13 are mounted in and put on
#         LD_LIBRARY_PATH (scripts/gpu_env.sh finds them on a host).
#
# Health: `ferry health` asks `grpc.health.v1` at $FERRY_HEALTH_ADDR (default 127.0.0.1:50051,
# the router's public gRPC port as `ferry up`/`ferry router` bind it) and exits 0 only for
# SERVING. For a worker container set
# FERRY_HEALTH_ADDR to its --grpc-addr. Kubernetes ignores HEALTHCHECK and uses its own gRPC
# probes (deploy/helm/ferry).

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

# ---- build the binary ------------------------------------------------------------------------
FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS builder
WORKDIR /src
# protoc comes vendored (protoc-bin-vendored); oniguruma and ring build with the image's gcc;
# CUDA, UCX and (feature `rocm` aside) HIP are loaded at run time, so nothing else is needed.
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked --bin ferry \
 && install -D -m 0755 target/release/ferry /out/ferry

# ---- NVRTC + cuBLAS for the `cuda` target ----------------------------------------------------
FROM python:3.12-slim-${DEBIAN_RELEASE} AS cudalibs
# CUDA 13.0 Update 2: the oldest CUDA 13 release, so the PTX NVRTC emits JITs on every
# CUDA 13 driver (R580 and later). A newer NVRTC needs a newer driver.
ARG NVRTC_VERSION=13.0.88
ARG CUBLAS_VERSION=13.0.2.14
RUN pip install --no-cache-dir --no-deps --target /opt/nvidia \
      "nvidia-cuda-nvrtc==${NVRTC_VERSION}" "nvidia-cublas==${CUBLAS_VERSION}" \
 && mkdir -p /out/lib \
 && find /opt/nvidia -name 'lib*.so*' -exec cp -a {} /out/lib/ \; \
 && ls /out/lib/libnvrtc.so.13 /out/lib/libcublas.so.13 /out/lib/libcublasLt.so.13

# ---- runtime ---------------------------------------------------------------------------------
FROM debian:${DEBIAN_RELEASE}-slim AS runtime
# libucx0: `--transport ucx` loads libucp.so.0 at run time (without it TCP still works).
# ca-certificates: OTLP export to an https collector.
# Not version-pinned (DL3008): Debian security updates replace the old versions in the archive,
# so a pin breaks the build within weeks; the release (bookworm) pins the ABI.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libucx0 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# A fixed non-root uid/gid (10001) so Kubernetes' runAsNonRoot can check it numerically.
RUN groupadd --system --gid 10001 ferry \
 && useradd --system --uid 10001 --gid ferry --home-dir /var/lib/ferry --create-home \
      --shell /usr/sbin/nologin ferry
COPY --from=builder /out/ferry /usr/local/bin/ferry
# Model configs for `--load-format dummy` benchmarks (config.json only, random weights).
COPY models/dummy /usr/share/ferry/models/dummy
# The embedded model is unpacked once into $XDG_CACHE_HOME/ferry (a few MB); keep it writable
# (Kubernetes mounts an emptyDir there so the root filesystem can be read-only).
ENV XDG_CACHE_HOME=/var/lib/ferry/cache \
    FERRY_HEALTH_ADDR=127.0.0.1:50051
USER 10001:10001
WORKDIR /var/lib/ferry
# 8000: OpenAI HTTP + /health + /metrics; 50051: public gRPC. The internal ports (router
# 50052, workers' gRPC, KV transfer, worker metrics) are chosen by flags and stay private.
EXPOSE 8000 50051
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["/usr/local/bin/ferry", "health", "--timeout-ms", "2000"]
ENTRYPOINT ["/usr/local/bin/ferry"]
# `ferry up` on every interface; anything after `docker run IMAGE` replaces this.
CMD ["up", "--http-addr", "0.0.0.0:8000", "--grpc-addr", "0.0.0.0:50051"]

# ---- cuda: runtime + NVRTC/cuBLAS ------------------------------------------------------------
FROM runtime AS cuda
COPY --from=cudalibs /out/lib /usr/local/lib/ferry-cuda
ENV LD_LIBRARY_PATH=/usr/local/lib/ferry-cuda \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# ---- cpu: the default target (last stage) ----------------------------------------------------
FROM runtime AS cpu
