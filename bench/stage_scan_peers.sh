#!/usr/bin/env bash
# Stages the scan benchmark's torch peers into the git-ignored .peers/scan/, for
# bench/torch_scan_worker.py on the GPU machine (which has neither package and no network):
#
#   * mamba_ssm's Triton SSD (mamba_chunk_scan_combined): mamba_ssm/ops/triton/ssd_combined.py
#     and the mamba_ssm modules it imports at module level (ssd_*, layernorm_gated,
#     k_activations, softplus, utils/determinism, utils/torch), without mamba_ssm/__init__.py
#     (it imports the compiled selective_scan_cuda and causal_conv1d): the worker registers
#     an empty package `mamba_ssm` over the staged folder instead.
#   * flash-linear-attention's chunk linear attention (fla.ops.linear_attn, which runs
#     fla.ops.simple_gla's chunk kernels) and the fla modules they import at module level,
#     without fla/__init__.py (it imports fla.layers and fla.models, transformers and all)
#     and fla/ops/__init__.py (every op): the worker registers empty `fla` (with the
#     `__version__` that fla.utils imports from it) and `fla.ops`.
#     fla.ops.common.backends (the registry of chunk_o's optional backends: TileLang, Ascend,
#     intra-card CP) is imported at module level and staged; those backends' kernels are
#     imported only inside their methods and are not staged: TileLang needs the tilelang
#     package (absent on the device; the worker also sets FLA_TILELANG=0), Ascend an NPU,
#     intra-card CP is off by default and for varlen inference only. fla then runs its Triton
#     kernels, as on a CUDA machine without tilelang.
#   * einops (pip download, pure Python) under .peers/scan/fallback/, for a device image
#     without it (the worker puts that folder last on sys.path; the GPU image has einops).
#
# Which modules: the closure of the roots' module-level imports (a static AST walk of the
# files at the staged commit: imports inside functions are not followed, they are not on
# the benchmark's path), plus each module's parent package __init__ files except the
# stubbed ones. The third-party modules imported at module level are listed in VERSIONS.json,
# and the script fails if a staged module imports a name from a stubbed package's __init__
# other than those the worker's stubs define.
#
# Each peer's LICENSE (and mamba's AUTHORS) is copied as .peers/scan/LICENSE.<package>; the commits staged
# go to .peers/scan/VERSIONS.json. Nothing is copied anywhere else in the repository.
#
# Usage (from anywhere; the mirrors are bare git directories, e.g. from the session
# tool `fetch github:state-spaces/mamba` / `fetch github:fla-org/flash-linear-attention`):
#
#   bash bench/stage_scan_peers.sh [MAMBA_GIT_DIR [FLA_GIT_DIR]]
#
# Defaults: /work/.mirror/state-spaces+mamba/repo and /work/.mirror/fla-org+flash-linear-attention/repo
# (or $MAMBA_GIT / $FLA_GIT); revisions $MAMBA_REV / $FLA_REV (default HEAD). A device run then
# carries the folder: run(..., carry=[".peers"]) (see bench/scan.py's docstring).
# bench/stage_peers.sh removes the whole .peers/: run this script after it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mamba="${1:-${MAMBA_GIT:-/work/.mirror/state-spaces+mamba/repo}}"
fla="${2:-${FLA_GIT:-/work/.mirror/fla-org+flash-linear-attention/repo}}"
out="$root/.peers/scan"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if command -v python3 >/dev/null; then py=python3; else py="$root/.venv/bin/python"; fi
fi
for g in "$mamba" "$fla"; do
  git --git-dir="$g" rev-parse --verify -q "HEAD^{commit}" >/dev/null \
    || { echo "not a git directory with commits: $g (fetch the mirror first)" >&2; exit 1; }
done
rm -rf "$out"
mkdir -p "$out"

"$py" - "$out" "$mamba" "${MAMBA_REV:-HEAD}" "$fla" "${FLA_REV:-HEAD}" <<'EOF'
import ast
import json
import os
import re
import subprocess
import sys

out, mamba_git, mamba_rev, fla_git, fla_rev = sys.argv[1:]
STDLIB = set(getattr(sys, "stdlib_module_names", ())) | {"__future__"}


def git(gd, *args):
  return subprocess.run(["git", f"--git-dir={gd}", *args], check=True, capture_output=True).stdout


def stage(name, gd, rev, repo, pkg, roots, stubs, extra_files):
  commit = git(gd, "rev-parse", f"{rev}^{{commit}}").decode().strip()
  date = git(gd, "show", "-s", "--format=%cI", commit).decode().strip()
  files = set(git(gd, "ls-tree", "-r", "--name-only", commit).decode().splitlines())

  def path_of(mod):
    base = mod.replace(".", "/")
    for p in (base + ".py", base + "/__init__.py"):
      if p in files:
        return p
    return None

  staged, third_party, lazy, problems = {}, set(), set(), []
  todo = list(roots)
  while todo:
    mod = todo.pop()
    parts = mod.split(".")
    for i in range(1, len(parts)):          # parent packages run their __init__ first
      parent = ".".join(parts[:i])
      if parent not in stubs and parent not in staged:
        todo.append(parent)
    if mod in staged or mod in stubs:
      continue
    path = path_of(mod)
    if path is None:
      problems.append(f"{mod}: no such module at {commit[:12]}")
      continue
    text = git(gd, "show", f"{commit}:{path}")
    staged[mod] = path
    is_pkg = path.endswith("__init__.py")
    package = mod if is_pkg else mod.rpartition(".")[0]

    def visit(node, in_function):
      for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
          visit(child, True)
          continue
        if isinstance(child, ast.Import):
          for a in child.names:
            use(a.name, in_function)
        elif isinstance(child, ast.ImportFrom):
          base = child.module or ""
          if child.level:
            anchor = package.split(".")[:len(package.split(".")) - (child.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
          for a in child.names:
            sub = f"{base}.{a.name}"
            if base.split(".")[0] == pkg and path_of(sub):
              use(sub, in_function)
            else:
              if base in stubs and a.name not in stubs[base] and not in_function:
                problems.append(f"{mod}: 'from {base} import {a.name}' needs the stubbed {base}/__init__.py")
              use(base, in_function)
        else:
          visit(child, in_function)

    def use(target, in_function):
      top = target.split(".")[0]
      if top == pkg:
        if in_function:
          lazy.add(target)
        else:
          todo.append(target)
      elif top not in STDLIB and not in_function:
        third_party.add(top)

    visit(ast.parse(text, filename=path), False)

  if problems:
    sys.exit(f"{name}: " + "; ".join(problems))
  licenses = [p for p in extra_files if p in files]
  for path, dst in [(p, p) for p in sorted(staged.values())] + [(p, f"{p}.{name}") for p in licenses]:
    dst = os.path.join(out, dst)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(dst, "wb") as f:
      f.write(git(gd, "show", f"{commit}:{path}"))
  version = None
  init = f"{pkg}/__init__.py"
  if init in files:
    m = re.search(rb'__version__\s*=\s*["\']([^"\']+)', git(gd, "show", f"{commit}:{init}"))
    version = m.group(1).decode() if m else None
  return dict(repo=repo, commit=commit, commit_date=date, version=version, package=pkg,
              roots=list(roots), stubbed_packages={k: list(v) for k, v in stubs.items()}, modules=sorted(staged),
              files=sorted(staged.values()), license_files=[f"{p}.{name}" for p in licenses],
              third_party_imports=sorted(third_party),
              lazy_imports_not_staged=sorted(t for t in lazy if t not in staged))


versions = {
    "mamba_ssm": stage("mamba_ssm", mamba_git, mamba_rev, "state-spaces/mamba", "mamba_ssm",
                       ["mamba_ssm.ops.triton.ssd_combined"], {"mamba_ssm": ()}, ["LICENSE", "AUTHORS"]),
    "fla": stage("fla", fla_git, fla_rev, "fla-org/flash-linear-attention", "fla",
                 ["fla.ops.linear_attn", "fla.ops.simple_gla"], {"fla": ("__version__",), "fla.ops": ()},
                 ["LICENSE"]),
}
with open(os.path.join(out, "VERSIONS.json"), "w") as f:
  json.dump(versions, f, indent=1)
  f.write("\n")
for name, v in versions.items():
  print(f"{name}: {v['repo']}@{v['commit'][:12]} ({v['commit_date']}), version {v['version']}, "
        f"{len(v['files'])} files; third-party imports: {', '.join(v['third_party_imports'])}")
EOF

# einops, pure Python, as a fallback for a device image without it (the GPU image has it).
tmp="$(mktemp -d)"
if "$py" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" einops >/dev/null 2>&1 \
    || "$root/.venv/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" einops >/dev/null 2>&1; then
  whl="$(ls "$tmp"/einops-*.whl | head -1)"
  mkdir -p "$out/fallback"
  "$py" - "$whl" "$out/fallback" "$out/VERSIONS.json" <<'EOF'
import json, os, sys, zipfile
whl, dst, versions = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
  names = [n for n in z.namelist() if n.startswith("einops/") or (".dist-info/" in n and "LICENSE" in n)]
  z.extractall(dst, names)
v = json.load(open(versions))
v["einops_fallback"] = dict(wheel=os.path.basename(whl), folder="fallback",
                            note="appended last to sys.path by the worker: used only where the device lacks einops")
json.dump(v, open(versions, "w"), indent=1)
print("einops fallback:", os.path.basename(whl))
EOF
else
  echo "warning: pip download einops failed; the worker relies on the device's einops" >&2
fi
rm -rf "$tmp"
find "$out" -name '*.py' | wc -l | xargs echo "python files staged:"
du -sh "$out"
