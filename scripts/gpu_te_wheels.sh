#!/usr/bin/env bash
# Transformer Engine for the offline H100 machine, in one carried folder under 64 MiB (run here, with
# internet): megatron-core 0.16.1 pins transformer-engine >= 2.9, < 2.12, so 2.11.0:
#   - transformer-engine-cu13 2.11.0 (179 MB wheel, 463 MB library) with the device code of every
#     architecture but sm_90 zeroed (scripts/fatbin_prune.py), repacked: about 29 MB;
#   - transformer-engine 2.11.0 (the Python package), nvdlfw-inspect;
#   - transformer-engine-torch 2.11.0's source (no wheel is published: the GPU machine builds it,
#     scripts/gpu_env.sh gpu_te) and cuDNN frontend's headers, which that build includes.
#   bash scripts/gpu_te_wheels.sh [DIR]      (default .te; keep DIR ignored: echo /.te/ >> .git/info/exclude)
set -euo pipefail
dir=${1:-.te}
v=2.11.0
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$dir"
plat=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$tmp" \
  transformer-engine-cu13==$v transformer-engine==$v nvdlfw-inspect==0.2.2 nvidia-cudnn-frontend==1.32.0
cp "$tmp"/transformer_engine-$v-*.whl "$tmp"/nvdlfw_inspect-*.whl "$dir"/
# The extension's source: pip would build it to read its metadata, so fetch the file itself.
url=$(python3 - "$v" <<'PY'
import re, sys, urllib.request
page = urllib.request.urlopen("https://pypi.org/simple/transformer-engine-torch/").read().decode()
print(re.search(r'href="([^"#]*transformer_engine_torch-%s\.tar\.gz)' % re.escape(sys.argv[1]), page).group(1))
PY
)
python3 -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" "$url" \
  "$dir/transformer_engine_torch-$v.tar.gz"
core=$(ls "$tmp"/transformer_engine_cu13-$v-*.whl)
lib=transformer_engine/wheel_lib/libtransformer_engine.so
(cd "$tmp" && python3 -m zipfile -e "$core" core >/dev/null)
python3 "$here/fatbin_prune.py" "$tmp/core/$lib" "$tmp/lib90.so" --keep 90
python3 - "$core" "$dir/$(basename "$core")" "$lib" "$tmp/lib90.so" <<'PY'
# The wheel again with the pruned library, its RECORD line updated (pip checks it).
import base64, hashlib, sys, zipfile
src, dst, member, path = sys.argv[1:]
new = open(path, "rb").read()
digest = base64.urlsafe_b64encode(hashlib.sha256(new).digest()).rstrip(b"=").decode()
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        data = new if info.filename == member else zin.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            data = "".join(f"{member},sha256={digest},{len(new)}\n" if line.startswith(member + ",") else line + "\n"
                           for line in data.decode().splitlines()).encode()
        zout.writestr(info, data)
PY
python3 - "$(ls "$tmp"/nvidia_cudnn_frontend-*.whl)" "$dir/cudnn_frontend_include.tar.gz" <<'PY'
# cuDNN frontend is header-only for the build: its include/ alone.
import io, sys, tarfile, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, tarfile.open(sys.argv[2], "w:gz") as tar:
    for name in z.namelist():
        if name.startswith("include/") and not name.endswith("/"):
            data = z.read(name)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
PY
du -sh "$dir"
