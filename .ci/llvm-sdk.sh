#!/usr/bin/env bash
# Installs LLVM 23 where burn's CUDA backend looks for it, so `--features cuda` builds offline.
#
# burn-cuda 0.22.1 links cubecl-llvm, whose build dependency tracel-llvm-bundler downloads an LLVM
# release into `$XDG_DATA_HOME/tracel/tracel-llvm-<version>` (default `~/.local/share`) unless the
# marker file `.tracel-llvm-installed` already exists there; then it only runs that folder's
# `bin/llvm-config`. PyPI's relocatable LLVM wheels (mlc-llvm-static, plus the extra targets for
# NVPTX) have exactly that layout. This script installs both, pinned by hash, links the folder,
# writes the marker once and checks that NVPTX is built.
#
# With internet access nothing is needed: the bundler downloads LLVM itself. Offline (this
# project's CI and build machines), run this first. Keep XDG_DATA_HOME the same for every cargo
# call. Never re-touch the marker: the bundler rebuilds on its mtime (27 crates).
#
# Usage: .ci/llvm-sdk.sh            (SDK under ~/.cache/zero-rs-llvm-sdk, or $ZERO_LLVM_SDK)
set -euo pipefail
cd "$(dirname "$0")/.."

# The folder name the bundler looks for comes from its version in Cargo.lock.
bundler="$(awk '/^name = "tracel-llvm-bundler"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock)"
expected="23.1.0-4"
if [ "$bundler" != "$expected" ]; then
  echo "llvm-sdk: Cargo.lock has tracel-llvm-bundler ${bundler:-<none>}, this script installs LLVM for $expected;" >&2
  echo "llvm-sdk: update the wheels and hashes below to the LLVM that bundler version expects" >&2
  exit 1
fi

sdk="${ZERO_LLVM_SDK:-$HOME/.cache/zero-rs-llvm-sdk}"
tree="$sdk/mlc_llvm_static/static"
if [ ! -x "$tree/bin/llvm-config" ] || [ ! -e "$tree/lib/libLLVMNVPTXCodeGen.a" ]; then
  echo "llvm-sdk: installing LLVM 23.1.1 (mlc-llvm-static, 92 MB) into $sdk"
  reqs="$(mktemp)"
  cat > "$reqs" <<'EOF'
mlc-llvm-static==23.1.1.post0 --hash=sha256:dcfec888abfaa418be77d41af585805f31463584cf9c90582992c00f392c1ac5
mlc-llvm-static-extra-targets==23.1.1.post0 --hash=sha256:c36e834d9a4e9cf9759f27fece65711ece7a2fc2b5a96dbb15d66f5e9e787929
EOF
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --upgrade \
    --target "$sdk" --require-hashes -r "$reqs"
  rm -f "$reqs"
fi

data="${XDG_DATA_HOME:-$HOME/.local/share}/tracel"
link="$data/tracel-llvm-$expected"
mkdir -p "$data"
if [ "$(readlink "$link" 2>/dev/null)" != "$tree" ]; then
  ln -sfn "$tree" "$link"
fi
marker="$link/.tracel-llvm-installed"
[ -e "$marker" ] || touch "$marker"

version="$("$link/bin/llvm-config" --version)"
if ! "$link/bin/llvm-config" --targets-built | grep -qw NVPTX; then
  echo "llvm-sdk: $link has LLVM $version without the NVPTX target" >&2
  exit 1
fi
echo "llvm-sdk: LLVM $version with NVPTX at $link"
