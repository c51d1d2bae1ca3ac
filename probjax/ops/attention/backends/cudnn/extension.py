"""The cuDNN FFI extension's library (``csrc/sdpa_ffi.cc``): where it is looked for, and its build.

Looked for, in order: ``$PROBJAX_CUDNN_FFI_LIBRARY`` (only there, when set; read by
:mod:`~probjax.ops.attention.backends.cudnn.ffi`); :data:`IN_TREE`, ``_build/`` beside this
module (git-ignored; ``bench/stage_cudnn_ffi.sh`` builds there for device runs, which carry
it); the user cache (:func:`cache_root`), under ``cudnn_ffi/<key>/``, the key naming the
versions of probjax, jaxlib, the Python ABI and the headers, and the source's hash, so that a
library built against anything else is never loaded. The cuDNN route builds the cache's on
first use on a GPU; ``python -m probjax.ops.attention.backends.cudnn.build`` builds it ahead.

Building needs a C++ compiler and headers only, no GPU and no CUDA library: XLA FFI's
(jaxlib's), the CUDA runtime's and NVRTC's, cuDNN's and the header-only cudnn-frontend's, all in
the NVIDIA pip packages (the ``cuda13`` extra, ``INSTALL``; CUDA 13's runtime headers need ``crt/`` and ``nv/``, of
nvidia-cuda-crt and nvidia-cuda-cccl), else in ``$CUDA_HOME`` or
``/usr/local/cuda``. The library finds cuDNN and the CUDA runtime at run time (cudnn-frontend's
dynamic loading), after ffi.py has loaded them from those packages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping

from probjax.core import config
from probjax.core.version import __version__

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE / "csrc" / "sdpa_ffi.cc"
NAME = "libprobjax_cudnn_sdpa.so"
IN_TREE = HERE / "_build" / NAME
CACHE_ENV = config.CACHE_DIR.name
BUILD_COMMAND = "python -m probjax.ops.attention.backends.cudnn.build"
# The distribution (pyproject.toml's name; the import name is probjax). Not on a package index:
# "probjax" there is another project, so install commands name a checkout, sdist or wheel.
DISTRIBUTION = "probjax-attention"


def install_command(extra: str = "cuda13") -> str:
  """The pip command that adds ``extra``'s packages to this installation: probjax installed again,
  with the extra, from where it came (PEP 610's ``direct_url.json``: the checkout, editable or
  not, the sdist or wheel file, or the VCS URL and commit), never by name from a package index."""
  # the first record that says (a checkout's own egg-info, found first from its folder, does not)
  records = (d.read_text("direct_url.json") for d in importlib.metadata.distributions(name=DISTRIBUTION))
  try:
    info = json.loads(next((r for r in records if r), "{}"))
  except ValueError:
    info = {}
  url = info.get("url", "") if isinstance(info, dict) else ""
  if url.startswith("file:") and info.get("dir_info", {}).get("editable"):
    path = urllib.request.url2pathname(urllib.parse.urlparse(url).path)
    return f'pip install -e "{path}[{extra}]"'
  if url and "vcs_info" in info:
    vcs = info["vcs_info"]
    url = f"{vcs['vcs']}+{url}" + (f"@{vcs['commit_id']}" if vcs.get("commit_id") else "")
  if url:
    return f'pip install "{DISTRIBUTION}[{extra}] @ {url}"'
  checkout = HERE.parents[4]  # not installed: run from a checkout (PYTHONPATH)
  if (checkout / "pyproject.toml").is_file():
    return f'pip install "{checkout}[{extra}]"'
  return f'pip install "{DISTRIBUTION}[{extra}] @ <probjax checkout, sdist or wheel>"'


INSTALL = install_command()
# A failed build leaves its compiler output here (and no library): later processes report it
# instead of compiling again; the build command retries.
LOG = "build.log"


class BuildError(RuntimeError):
  """Why the extension cannot be built here."""


@dataclasses.dataclass(frozen=True)
class Headers:
  """The include folders of one build, in ``-I`` order, and the versions they carry."""
  include_dirs: tuple[pathlib.Path, ...]
  versions: tuple[tuple[str, str], ...]  # (("cudnn", "9.19.0"), ...)
  version_files: tuple[pathlib.Path, ...]  # hashed into the cache key


def package_dirs(name: str) -> list[pathlib.Path]:
  """The folders of the installed top-level package ``name``: all of them for a namespace
  package spread over several site-packages (``nvidia``). Does not import it."""
  try:
    spec = importlib.util.find_spec(name)
  except (ImportError, ValueError):
    return []
  if spec is None or spec.submodule_search_locations is None:
    return []
  return [pathlib.Path(p) for p in spec.submodule_search_locations]


def nvidia_dirs(sub: str) -> list[pathlib.Path]:
  """``nvidia/<sub>`` of the installed NVIDIA pip packages (``cudnn``, ``cu13``)."""
  return [d / sub for d in package_dirs("nvidia") if (d / sub).is_dir()]


def site_dirs() -> list[pathlib.Path]:
  """The site-packages folders holding NVIDIA packages: those of the ``nvidia`` namespace and
  of cudnn-frontend's Python package ``cudnn``, beside which its wheel puts ``include/``."""
  return list(dict.fromkeys(d.parent for name in ("nvidia", "cudnn") for d in package_dirs(name)))


def _define(path: pathlib.Path, name: str) -> str:
  m = re.search(rf"^\s*#\s*define\s+{name}\s+(\d+)", path.read_text(errors="replace"), re.M)
  if m is None:
    raise BuildError(f"{path} does not define {name}")
  return m.group(1)


def _first(header: str, dirs: Iterable[pathlib.Path], missing: list[str]) -> pathlib.Path | None:
  dirs = list(dict.fromkeys(dirs))
  for d in dirs:
    if (d / header).is_file():
      return d
  missing.append(f"{header} (looked in {', '.join(map(str, dirs))})" if dirs else f"{header} (no package installed)")
  return None


def find_headers(sites: Iterable[pathlib.Path], env: Mapping[str, str], *, include: Iterable[str] = (),
                 cudnn_include: str | None = None, frontend_include: str | None = None,
                 ffi_include: str | None = None) -> Headers:
  """The headers of a build: first the folders passed, then the NVIDIA packages under
  ``sites`` (site-packages folders), then ``$CUDA_HOME/include`` and ``/usr/local/cuda/include``.
  ``ffi_include``: XLA's FFI headers (default: the installed jaxlib's); a library built with a
  newer jaxlib's headers does not register with an older jaxlib (the FFI API version is
  checked), so one built for other machines takes the oldest supported jaxlib's.
  BuildError names every header missing and where it was looked for."""
  import jax  # noqa: PLC0415 (the FFI headers ship with jaxlib; jax is imported by then on every path)

  sites = list(sites)
  system = [pathlib.Path(env["CUDA_HOME"]) / "include"] if env.get("CUDA_HOME") else []
  system.append(pathlib.Path("/usr/local/cuda/include"))
  given = [pathlib.Path(d) for d in include]
  missing: list[str] = []
  cuda = [_first(h, given + [s / "nvidia" / "cu13" / "include" for s in sites] + system, missing)
          for h in ("cuda_runtime_api.h", "crt/host_defines.h", "nv/target", "nvrtc.h")]
  cudnn = _first("cudnn_version.h", [pathlib.Path(d) for d in (cudnn_include, env.get("CUDNN_INCLUDE_DIR")) if d]
                 + [s / "nvidia" / "cudnn" / "include" for s in sites] + system, missing)
  frontend = _first("cudnn_frontend_version.h", ([pathlib.Path(frontend_include)] if frontend_include else [])
                    + [s / "include" for s in sites], missing)
  if missing:
    raise BuildError(f"headers not found: {'; '.join(missing)}. {INSTALL} installs them")
  version_files = (cudnn / "cudnn_version.h", frontend / "cudnn_frontend_version.h",
                   cuda[0] / "cuda_runtime_api.h", cuda[3] / "nvrtc.h")
  cudart = int(_define(version_files[2], "CUDART_VERSION"))
  versions = (("cudnn", ".".join(_define(version_files[0], f"CUDNN_{p}") for p in ("MAJOR", "MINOR", "PATCHLEVEL"))),
              ("frontend", ".".join(_define(version_files[1], f"CUDNN_FRONTEND_{p}_VERSION")
                                    for p in ("MAJOR", "MINOR", "PATCH"))),
              ("cuda", f"{cudart // 1000}.{cudart % 1000 // 10}"))
  # frontend, then cuDNN, then CUDA: a cudnn.h that also lies in a CUDA folder is not the one versioned
  dirs = (pathlib.Path(ffi_include or jax.ffi.include_dir()), frontend, cudnn, *cuda)
  return Headers(tuple(dict.fromkeys(dirs)), versions, version_files)


@functools.lru_cache(maxsize=8)
def _discovered(cuda_home: str | None, cudnn_include: str | None, path: tuple[str, ...]) -> Headers | BuildError:
  try:
    return find_headers(site_dirs(), {"CUDA_HOME": cuda_home or "", "CUDNN_INCLUDE_DIR": cudnn_include or ""})
  except BuildError as e:
    return e


def discover(env: Mapping[str, str]) -> Headers:
  """:func:`find_headers` of the installed packages, once per process for each ``sys.path``,
  ``$CUDA_HOME`` and ``$CUDNN_INCLUDE_DIR``: the cuDNN route asks on every call."""
  found = _discovered(env.get("CUDA_HOME"), env.get("CUDNN_INCLUDE_DIR"), tuple(sys.path))
  if isinstance(found, BuildError):
    raise found
  return found


def cache_root(env: Mapping[str, str]) -> pathlib.Path:
  """``$PROBJAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/probjax``, else ``~/.cache/probjax``."""
  if config.CACHE_DIR.value(env):
    return pathlib.Path(config.CACHE_DIR.value(env))
  return pathlib.Path(env.get("XDG_CACHE_HOME") or pathlib.Path(env.get("HOME") or pathlib.Path.home()) / ".cache",
                      "probjax")


@functools.lru_cache(maxsize=8)  # the cuDNN route asks on every call: hash the files once
def cache_key(headers: Headers) -> str:
  """The cache folder's name: probjax's, jaxlib's, the Python ABI's and the headers' versions,
  and a hash of the source and the versioned headers' text (so that an edited ``sdpa_ffi.cc``
  in an editable install, or a patched header, is built afresh in the next process)."""
  digest = hashlib.sha256(SOURCE.read_bytes())
  for f in headers.version_files:
    digest.update(f.read_bytes())
  abi = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag
  parts = [f"probjax{__version__}", f"jaxlib{importlib.metadata.version('jaxlib')}", abi,
           *(f"{name}{v}" for name, v in headers.versions), digest.hexdigest()[:12]]
  return "-".join(parts)


def cached_library(env: Mapping[str, str], headers: Headers | None = None) -> pathlib.Path:
  """Where the cache holds the library built from ``headers`` (default: :func:`discover`'s)."""
  return cache_root(env) / "cudnn_ffi" / cache_key(headers or discover(env)) / NAME


def compiler(env: Mapping[str, str]) -> str:
  """``$CXX`` (default g++), if it is on PATH."""
  cxx = env.get("CXX") or "g++"
  if shutil.which(shlex.split(cxx)[0]) is None:
    raise BuildError(f"no C++ compiler: {cxx} is not on PATH (install g++ or set CXX)")
  return cxx


def last_failure(library: pathlib.Path) -> str | None:
  """Why the last build of ``library`` failed, if it did and none succeeded since."""
  log = library.parent / LOG
  if library.exists() or not log.is_file():
    return None
  return f"its last build failed (compiler output: {log}; retry: {BUILD_COMMAND})"


def command(headers: Headers, cxx: str, output: pathlib.Path) -> list[str]:
  """The compiler command line."""
  return (shlex.split(cxx) + ["-std=c++17", "-O2", "-fPIC", "-shared", "-DNDEBUG"]
          + [f"-I{d}" for d in headers.include_dirs]
          + [str(SOURCE), "-o", str(output), "-ldl", "-lpthread", "-static-libstdc++", "-static-libgcc"])


@contextlib.contextmanager
def locked(path: pathlib.Path):
  """An exclusive lock on ``path`` (created): one build of a library at a time, across
  processes; another process's waits, then finds the library built."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _error_line(text: str) -> str:
  lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
  errors = [ln for ln in lines if "error" in ln.lower()]
  return (errors or lines or ["no output"])[0]


def build(env: Mapping[str, str] | None = None, *, output: pathlib.Path | None = None, force: bool = False,
          include: Iterable[str] = (), cudnn_include: str | None = None, frontend_include: str | None = None,
          ffi_include: str | None = None, announce: Callable[[str], None] = print) -> pathlib.Path:
  """Builds the library into ``output`` (default: :func:`cached_library`) unless it is there
  (or ``force``), under :func:`locked`, and returns its path; BuildError says why it cannot.

  ``announce`` gets one line before the compiler runs. The compiler writes a temporary file
  renamed into place, so that no process loads a library being written."""
  env = os.environ if env is None else env
  if include or cudnn_include or frontend_include or ffi_include:
    headers = find_headers(site_dirs(), env, include=include, cudnn_include=cudnn_include,
                           frontend_include=frontend_include, ffi_include=ffi_include)
  else:
    headers = discover(env)
  cxx = compiler(env)
  output = pathlib.Path(output) if output is not None else cached_library(env, headers)
  log = output.parent / LOG
  try:
    with locked(output.with_name(output.name + ".lock")):
      if output.exists() and not force:
        return output
      tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
      cmd = command(headers, cxx, tmp)
      announce(f"probjax: building the cuDNN FFI extension into {output.parent} "
               f"({', '.join(f'{n} {v}' for n, v in headers.versions)}; once, about a minute)")
      proc = subprocess.run(cmd, capture_output=True, text=True)
      if proc.returncode != 0:
        log.write_text(f"{shlex.join(cmd)}\n\n{proc.stdout}{proc.stderr}")
        tmp.unlink(missing_ok=True)
        raise BuildError(f"{cxx} failed ({_error_line(proc.stderr)}); compiler output: {log}")
      os.replace(tmp, output)
      log.unlink(missing_ok=True)
  except OSError as e:
    raise BuildError(f"cannot write {output}: {e}") from e
  return output
