# Source at the start of a device command (from the repository root):
#   source bench/gpu_env.sh
# Installs the carried peer wheels from .peers/ (see bench/stage_peers.sh)
# into /tmp/peers_site, puts them and then the tokamax profiler stub on
# PYTHONPATH, picks the Python that has jax and torch, and sets the allocator so
# that JAX and torch can share the GPU within one process. Missing peers are
# reported and the suites record their rows as "unsupported"; nothing fails here.
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # torch peers share the device in the same process
export PY="${PY:-python3}"
_root="$(pwd)"
export PYTHONPATH="$_root${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${PROBJAX_PEERS_READY:-}" ]; then :  # set by an outer gpu_pair.sh: installed, on PYTHONPATH
elif [ -d "$_root/.peers/wheels" ] && ls "$_root"/.peers/wheels/*.whl >/dev/null 2>&1; then
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/peers_site "$_root"/.peers/wheels/*.whl >/tmp/peers_install.log 2>&1; then
    export PYTHONPATH="$PYTHONPATH:/tmp/peers_site:$_root/.peers/stubs"
    export PROBJAX_PEERS_READY=1
  else
    echo "[gpu_env] peer wheels did not install (see /tmp/peers_install.log); peers will be unsupported" >&2
  fi
else
  echo "[gpu_env] no .peers/ carried: tokamax rows will be 'unsupported' (run bench/stage_peers.sh, carry .peers)" >&2
fi
$PY - <<'PYEOF' >&2 || true
import importlib
for m in ("jax", "torch", "tokamax", "probjax"):
    try:
        mod = importlib.import_module(m)
        print(f"[gpu_env] {m} {getattr(mod, '__version__', '')}")
    except Exception as e:
        print(f"[gpu_env] {m} missing: {type(e).__name__}: {e}")
PYEOF
