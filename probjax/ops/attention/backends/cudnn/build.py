"""Builds the cuDNN SDPA FFI extension (``csrc/sdpa_ffi.cc``) with the host C++ compiler.

    python -m probjax.ops.attention.backends.cudnn.build [--cudnn-include DIR] [--frontend-include DIR]

Needs headers only: XLA FFI's (shipped with jaxlib), the CUDA runtime's and NVRTC's
(``$CUDA_HOME/include``, default ``/usr/local/cuda``, and ``nvidia/cu13/include`` of the
pip packages), cuDNN's (``nvidia-cudnn-cu13``, ``$CUDNN_INCLUDE_DIR`` or ``--cudnn-include``)
and the header-only cudnn-frontend (``nvidia-cudnn-frontend`` or ``--frontend-include``);
``bench/stage_cudnn_ffi.sh`` fetches the pinned ones and builds. No GPU and no CUDA
library is needed to build: the library finds cuDNN and the CUDA runtime at run time
(cudnn-frontend's dynamic loading), after :mod:`probjax.ops.attention.backends.cudnn.ffi` has loaded
them from the ``nvidia`` packages. Output: :data:`LIBRARY`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import pathlib
import shlex
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE / "csrc" / "sdpa_ffi.cc"
LIBRARY = HERE / "_build" / "libprobjax_cudnn_sdpa.so"


def _package_dir(name: str) -> pathlib.Path | None:
  spec = importlib.util.find_spec(name)
  if spec is None or not spec.submodule_search_locations:
    return None
  return pathlib.Path(list(spec.submodule_search_locations)[0])


def nvidia_dir(sub: str) -> pathlib.Path | None:
  """``nvidia/<sub>`` of the installed NVIDIA pip packages (``cudnn``, ``cu13``), if any."""
  try:
    pkg = _package_dir("nvidia")
  except ModuleNotFoundError:
    return None
  return pkg / sub if pkg and (pkg / sub).is_dir() else None


def _cudnn_include(arg: str | None) -> pathlib.Path:
  for cand in (arg, os.environ.get("CUDNN_INCLUDE_DIR")):
    if cand:
      return pathlib.Path(cand)
  pkg = nvidia_dir("cudnn")
  if pkg and (pkg / "include" / "cudnn.h").exists():
    return pkg / "include"
  raise SystemExit("cuDNN headers not found: install nvidia-cudnn-cu13, set CUDNN_INCLUDE_DIR or pass --cudnn-include")


def _frontend_include(arg: str | None) -> pathlib.Path:
  if arg:
    return pathlib.Path(arg)
  try:
    for f in importlib.metadata.files("nvidia-cudnn-frontend") or ():
      if f.name == "cudnn_frontend.h":
        return pathlib.Path(f.locate()).parent
  except importlib.metadata.PackageNotFoundError:
    pass
  raise SystemExit("cudnn-frontend headers not found: install nvidia-cudnn-frontend or pass --frontend-include")


def _cuda_includes(extra: list[str]) -> list[pathlib.Path]:
  dirs = [pathlib.Path(d) for d in extra]
  dirs.append(pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include")
  cu13 = nvidia_dir("cu13")
  if cu13:
    dirs.append(cu13 / "include")
  for header in ("cuda_runtime_api.h", "nvrtc.h"):
    if not any((d / header).exists() for d in dirs):
      raise SystemExit(f"{header} not found in {[str(d) for d in dirs]}: set CUDA_HOME or pass --include")
  return dirs


def command(cudnn_include: str | None = None, frontend_include: str | None = None,
            output: pathlib.Path = LIBRARY, include: list[str] = ()) -> list[str]:
  """The compiler command line."""
  import jax  # noqa: PLC0415 (only for the FFI headers' location)

  includes = [pathlib.Path(jax.ffi.include_dir()), *_cuda_includes(list(include)),
              _cudnn_include(cudnn_include), _frontend_include(frontend_include)]
  return ([os.environ.get("CXX", "g++"), "-std=c++17", "-O2", "-fPIC", "-shared", "-DNDEBUG"]
          + [f"-I{d}" for d in includes]
          + [str(SOURCE), "-o", str(output), "-ldl", "-lpthread", "-static-libstdc++", "-static-libgcc"])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cudnn-include")
  p.add_argument("--frontend-include")
  p.add_argument("--include", action="append", default=[], help="more include folders (CUDA, NVRTC)")
  p.add_argument("--output", type=pathlib.Path, default=LIBRARY)
  a = p.parse_args(argv)
  a.output.parent.mkdir(parents=True, exist_ok=True)
  cmd = command(a.cudnn_include, a.frontend_include, a.output, a.include)
  print("[build]", shlex.join(cmd), flush=True)
  subprocess.run(cmd, check=True)
  print(f"[build] wrote {a.output} ({a.output.stat().st_size // 1024} KiB)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
