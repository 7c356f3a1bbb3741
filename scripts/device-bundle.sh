#!/usr/bin/env bash
# Builds here what the GPU machine runs, and packs it into .dev/ (git-ignored through
# .git/info/exclude) for the device tool to carry: that machine has nvcc but not the engine's
# Debian libraries (fmt, CLI11, nlohmann-json, cpp-httplib), so the engine cannot be built there.
#
#   build-dev/  a portable build (-march=x86-64-v3, not this machine's CPU), without ICU: ICU's
#               31 MB data library would not fit the carry limit; text prompts are then refused
#               with an error, and nothing the GPU suite or the benchmarks run needs them;
#   .dev/bin    xinfer, test_models, test_spec, test_http, cuda-op-check;
#   .dev/lib    the shared libraries they need beyond glibc and libstdc++ (about 7 MB);
#   .dev/plugin libxinfer-cuda.so; .dev/COMMIT the commit it was built from.
#
#   scripts/device-bundle.sh
#
# Then, on the device (carry [".dev"]), before scripts/gpu-check.sh or scripts/gpu-perf.sh:
#   export LD_LIBRARY_PATH=$PWD/.dev/lib:/usr/local/cuda/lib64; mkdir -p build/bin build-cuda/bin
#   cp .dev/bin/* .dev/plugin/libxinfer-cuda.so build/bin/; cp .dev/COMMIT COMMIT
#   cp .dev/plugin/libxinfer-cuda.so .dev/bin/cuda-op-check build-cuda/bin/
# Another plugin (an A/B variant) loads from its own folder with XINFER_PLUGIN_PATH=DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qs '^/.dev/$' .git/info/exclude || { mkdir -p .git/info && echo /.dev/ >>.git/info/exclude; }
# pkg-config sees cpp-httplib (and what it requires) but not ICU.
pc=$(mktemp -d)
trap 'rm -rf "$pc"' EXIT
for name in cpp-httplib openssl libssl libcrypto zlib libbrotlicommon libbrotlidec libbrotlienc; do
    file=$(pkg-config --variable=pcfiledir "$name" 2>/dev/null)/$name.pc
    [ -f "$file" ] && cp "$file" "$pc/"
done
# (-U: pkg-config's cached answers, so that a build directory once configured with ICU drops it.)
PKG_CONFIG_LIBDIR=$pc cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DXINFER_NATIVE=OFF \
    -U __pkg_config_checked_ICU -U 'ICU_*' -U 'pkgcfg_lib_ICU_*' >/dev/null
targets=(xinfer test_models test_spec test_http xinfer-cuda cuda-op-check)
cmake --build build-dev -j"$(nproc)" --target "${targets[@]}"
rm -rf .dev/bin .dev/lib .dev/plugin
mkdir -p .dev/bin .dev/lib .dev/plugin
cp build-dev/bin/{xinfer,test_models,test_spec,test_http,cuda-op-check} .dev/bin/
cp build-dev/bin/libxinfer-cuda.so .dev/plugin/
git rev-parse --short HEAD >.dev/COMMIT
git diff --quiet || sed -i 's/$/+dirty/' .dev/COMMIT
# Every library the binaries load that is not glibc, libstdc++ or the CUDA driver.
ldd .dev/bin/* .dev/plugin/* 2>/dev/null | awk '/=> \//{print $3}' | sort -u |
    grep -vE '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux[^/]*|libcuda|libcublas|libcublasLt|libcudart|libnvrtc|libnvJitLink)\.so' |
    while read -r lib; do cp -L "$lib" .dev/lib/; done
du -sh .dev
