#!/usr/bin/env bash
# llama-cpp-python without its 18-minute build (issue 42).
#
# The registry has no prebuilt llama-cpp-python wheel, and `pip install llama-cpp-python` compiles
# llama.cpp with its common library, the multimodal library and every tool: about 18 minutes on 2
# cores. We use only libllama and ggml through its ctypes bindings, so this script
#   1. builds those two from the llama.cpp that llama-cpp-python's own sdist vendors (the ABI its
#      bindings were written for): shared libraries, portable (GGML_NATIVE=OFF: AVX2, FMA, F16C,
#      BMI2, so they run on every host class we get: AVX2-only, AVX-512, AMX), no common library,
#      no tools: 171 s on 2 AVX2 cores;
#   2. installs the sdist's Python package with LLAMA_BUILD=OFF (no compiler: 13 s) and its
#      [server] extra, and puts the libraries in its llama_cpp/lib, where the bindings look.
# The libraries are cached under $VARIANTBENCH_WHEELS (default ~/wheels), keyed by the version and
# the build flags: a second run takes seconds. Prebuilt alternatives were tried and refused:
# llama-cpp-py-sync's libllama needs glibc 2.38 (Debian 12 has 2.36), llama-cpp-cffi is a 320 MB
# CFFI module of an older llama.cpp with another API.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
FLAGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=OFF
       -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_OPENMP=ON
       -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
       -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF
       "-DCMAKE_INSTALL_RPATH=\$ORIGIN" -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON)
KEY="$(printf '%s ' "$VERSION" "${FLAGS[@]}" | sha256sum | cut -c1-12)"
CACHE="${VARIANTBENCH_WHEELS:-$HOME/wheels}/llama-cpp-libs-$VERSION-$KEY"
PIP=(python -m pip install --quiet --disable-pip-version-check -c constraints.txt)

if python -c "import llama_cpp; llama_cpp.llama_print_system_info()" 2>/dev/null; then
    echo "llama-cpp-python is already installed and loads"
    exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m pip download --quiet --disable-pip-version-check --no-deps --no-binary=:all: \
    "llama-cpp-python==$VERSION" -d "$work"
sdist="$work/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$CACHE/libllama.so" ]; then
    command -v cmake >/dev/null && command -v ninja >/dev/null || "${PIP[@]}" cmake ninja
    tar xzf "$sdist" -C "$work"
    start=$(date +%s)
    cmake -S "$work/llama_cpp_python-$VERSION/vendor/llama.cpp" -B "$work/build" -G Ninja "${FLAGS[@]}" >/dev/null
    cmake --build "$work/build" --target llama -j"$(nproc)" >/dev/null
    mkdir -p "$CACHE.tmp"
    cp -P "$work/build/bin/"lib*.so* "$CACHE.tmp/"
    rm -rf "$CACHE" && mv "$CACHE.tmp" "$CACHE"
    echo "built libllama and ggml for llama-cpp-python $VERSION in $(( $(date +%s) - start )) s"
fi
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "${PIP[@]}" "llama-cpp-python[server] @ file://$sdist"
site="$(python -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('llama_cpp').origin))")"
mkdir -p "$site/lib"
cp -P "$CACHE/"lib*.so* "$site/lib/"
python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, '|', llama_cpp.llama_print_system_info().decode().strip())"
