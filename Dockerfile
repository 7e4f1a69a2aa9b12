# The iadeep binary in a small runtime image (placer, tuner, CLI: one binary).
#   docker build -t iadeep/iadeep:0.1.0 .
# The image name matches deploy/kubernetes/base/*.yaml.

FROM rust:1.90-bookworm AS build
# protoc: the etcd client's build script compiles etcd's protobuf files with it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin iadeep

FROM debian:bookworm-slim
# CA certificates for TLS to API servers with public certificates; NVML
# (libnvidia-ml) is mounted into GPU pods by the NVIDIA container runtime.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/iadeep /usr/local/bin/iadeep
# A numeric non-root user, so `runAsNonRoot: true` can be checked by the kubelet.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/iadeep"]
CMD ["--help"]
