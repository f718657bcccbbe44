#!/usr/bin/env bash
# Installs NVIDIA's PTX assembler (`ptxas`, from PyPI's pinned nvidia-cuda-nvcc-cu12 wheel) and
# prints its path. `cargo xtask test` runs it when `$ZERO_PTXAS` is unset, and the PTX tests
# assemble every PTX module the project ships (the hand-written kernels of zero-comm's NCCL
# backend and CUDA loopback, zero-quant's NVRTC-compiled codecs) for the GPUs they target, so
# a module a driver would refuse fails here, without a GPU. CUDA 12.9's ptxas reads PTX ISA up to
# 8.8: raise the pin when `cargo xtask ptx` writes a newer `.version`.
#
# Usage: .ci/ptxas.sh          (installs under ~/.cache/zero-rs-ptxas, or $ZERO_PTXAS_SDK)
set -euo pipefail

sdk="${ZERO_PTXAS_SDK:-$HOME/.cache/zero-rs-ptxas}"
ptxas="$sdk/nvidia/cuda_nvcc/bin/ptxas"
if [ ! -x "$ptxas" ]; then
  echo "ptxas: installing CUDA 12.9's ptxas (nvidia-cuda-nvcc-cu12, 40 MB) into $sdk" >&2
  reqs="$(mktemp)"
  cat > "$reqs" <<'REQS'
nvidia-cuda-nvcc-cu12==12.9.86 --hash=sha256:5d6a0d32fdc7ea39917c20065614ae93add6f577d840233237ff08e9a38f58f0
REQS
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --upgrade \
    --target "$sdk" --require-hashes -r "$reqs" >&2
  rm -f "$reqs"
  chmod +x "$ptxas"
fi
"$ptxas" --version >&2
echo "$ptxas"
