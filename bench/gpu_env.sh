# Sourced at the start of every device command, from the repo root:
#   source bench/gpu_env.sh [sglang]
# Installs the carried wheels (bench/gpu_kit.sh made them; .whl/core, .whl/overlap, .whl_trl, whichever came) into
# /tmp/site ($TANDEM_SITE) with one pip call, and with `sglang` unpacks .sglang/site.tar.xz into /tmp/site_sglang
# ($TANDEM_SGLANG_SITE), ahead on PYTHONPATH (it shadows transformers with 5.12.1 in every process; see its
# README). It then sets the environment the device README asks for and prints one line of versions. Any failure exits the calling shell: a device
# command must not go on without its packages.
_tandem_env_fail() { echo "gpu_env: FAILED: $*" >&2; exit 1; }

_tandem_env_main() {
  local repo want_sglang=0 arg
  repo=$(pwd)
  for arg in "$@"; do
    case $arg in
      sglang) want_sglang=1 ;;
      *) _tandem_env_fail "unknown argument '$arg' (use: source bench/gpu_env.sh [sglang])" ;;
    esac
  done
  [[ -d $repo/services ]] || _tandem_env_fail "source it from the repo root (no services/ in $repo)"

  # NVLink multicast stays off in NCCL, PyTorch and NVSHMEM: it can take a shared host's GPUs down (KINDS.md)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

  local site=${TANDEM_SITE:-/tmp/site} sglang_site=${TANDEM_SGLANG_SITE:-/tmp/site_sglang} path_head=""
  if (( want_sglang )); then
    if [[ -f $repo/.sglang/site.tar.xz ]]; then
      if [[ ! -f $sglang_site/.unpacked ]] || ! cmp -s "$repo/.sglang/SHA256SUMS" "$sglang_site/.unpacked"; then
        (cd "$repo/.sglang" && sha256sum -c --quiet SHA256SUMS) || _tandem_env_fail ".sglang/site.tar.xz checksum"
        rm -rf "$sglang_site" && mkdir -p "$sglang_site"
        tar -xJf "$repo/.sglang/site.tar.xz" -C "$sglang_site" || _tandem_env_fail "unpacking .sglang/site.tar.xz"
        cp "$repo/.sglang/SHA256SUMS" "$sglang_site/.unpacked"
      fi
      path_head=$sglang_site:
    else
      echo "gpu_env: no .sglang/site.tar.xz carried: SGLang stages will skip"
      want_sglang=0
    fi
  fi

  # .whl/overlap's packages come with the bundle at the same versions; installing both would be two copies
  local wheels=() f
  for f in "$repo"/.whl/*.whl "$repo"/.whl/core/*.whl "$repo"/.whl_trl/*.whl; do [[ -f $f ]] && wheels+=("$f"); done
  if (( ! want_sglang )); then
    for f in "$repo"/.whl/overlap/*.whl; do [[ -f $f ]] && wheels+=("$f"); done
  fi
  (( ${#wheels[@]} )) || _tandem_env_fail "no wheels carried (run bench/gpu_kit.sh here; carry .whl)"
  local dupes
  dupes=$(for f in "${wheels[@]}"; do basename "$f" | cut -d- -f1 | tr 'A-Z_.' 'a-z--'; done | sort | uniq -d)
  [[ -z $dupes ]] || _tandem_env_fail "more than one wheel of: $dupes"
  local stamp
  stamp=$(for f in "${wheels[@]}"; do echo "$(basename "$f") $(stat -c %s "$f")"; done | sort)
  if [[ ! -f $site/.installed ]] || [[ $(cat "$site/.installed") != "$stamp" ]]; then   # else: this machine has them
    rm -rf "$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}" \
      || _tandem_env_fail "pip install of ${#wheels[@]} wheels"
    echo "$stamp" > "$site/.installed"
  fi
  export PYTHONPATH=$path_head$site:$repo${PYTHONPATH:+:$PYTHONPATH}
  export PATH=$site/bin:$PATH

  python3 - <<'EOF' || _tandem_env_fail "an installed package does not import"
import importlib.metadata as md
import platform
import grpc, pydantic, torch, transformers  # noqa: F401,E401  (import errors surface here, not mid-stage)
def ver(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
cuda = f"cuda {torch.version.cuda}, {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no CUDA device"
parts = [f"python {platform.python_version()}", f"torch {torch.__version__} ({cuda})", f"deepspeed {ver('deepspeed')}",
         f"grpc {grpc.__version__}", f"pydantic {pydantic.VERSION}", f"transformers {transformers.__version__}"]
parts += [f"{name} {ver(name)}" for name in ("trl", "datasets", "sglang") if ver(name)]
print("gpu_env: " + "; ".join(parts))
EOF
}

_tandem_env_main "$@"
unset -f _tandem_env_main
