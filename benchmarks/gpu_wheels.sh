#!/usr/bin/env bash
# Wheels for benchmarks/gpu_check.py on a device machine that has torch and transformers but not
# the rest of our runtime, and no network: downloaded here for CPython 3.10-3.12 on x86-64 Linux into
# ./wheels (git-ignored), which the device tool carries (carry: ["wheels"], under its 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(pydantic psutil typer rich fastapi uvicorn httpx pyyaml)
for py in 3.10 3.11 3.12; do
  pip download -q --only-binary=:all: --python-version "$py" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d wheels "${PKGS[@]}"
done
du -sh wheels
