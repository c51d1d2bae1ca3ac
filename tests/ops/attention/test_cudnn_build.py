"""The cuDNN FFI extension's build and lookup (``probjax.ops.attention.backends.cudnn.extension``,
``.build``) and what ``ffi`` says about it, on CPU: header discovery from a site-packages layout
of the NVIDIA pip packages (fake ones in tmp folders), the cache key, the build lock, a failed
build recorded once, the one-time notice, ``extension_status`` and the build command. The
``slow`` test compiles the extension from the real header packages (pip-downloaded)."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import tomllib
import zipfile

import pytest

import probjax
from probjax.ops.attention.backends.cudnn import build, extension, ffi

ROOT = pathlib.Path(__file__).resolve().parents[3]
MODULE = "probjax.ops.attention.backends.cudnn.build"


def _header(path: pathlib.Path, **defines) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(f"#define {k} {v}\n" for k, v in defines.items()))


def fake_site(root: pathlib.Path, cudnn=(9, 19, 0), frontend=(1, 32, 0), cudart=13000) -> pathlib.Path:
  """A site-packages folder as nvidia-cudnn-cu13, nvidia-cuda-runtime (-crt, -cccl), nvidia-cuda-nvrtc and
  nvidia-cudnn-frontend lay it out (headers only; the frontend's Python package empty)."""
  _header(root / "nvidia/cudnn/include/cudnn_version.h",
          **dict(zip(("CUDNN_MAJOR", "CUDNN_MINOR", "CUDNN_PATCHLEVEL"), cudnn)))
  _header(root / "nvidia/cu13/include/cuda_runtime_api.h", CUDART_VERSION=cudart)
  _header(root / "nvidia/cu13/include/crt/host_defines.h")
  _header(root / "nvidia/cu13/include/nv/target")
  _header(root / "nvidia/cu13/include/nvrtc.h")
  _header(root / "include/cudnn_frontend_version.h", **dict(zip(
      ("CUDNN_FRONTEND_MAJOR_VERSION", "CUDNN_FRONTEND_MINOR_VERSION", "CUDNN_FRONTEND_PATCH_VERSION"), frontend)))
  _header(root / "cudnn/__init__.py")
  return root


def fake_compiler(tmp_path: pathlib.Path, fail: bool = False) -> tuple[str, pathlib.Path]:
  """A ``$CXX`` that writes its ``-o`` file (or fails as a compiler does) and counts its runs."""
  runs = tmp_path / "runs"
  script = tmp_path / "fake-cxx"
  body = ('echo "x.cc:1: fatal error: cudnn.h: No such file or directory" >&2; exit 1' if fail
          else 'echo built > "$out"')
  script.write_text(f'#!/bin/sh\necho run >> "{runs}"\n'
                    f'while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n{body}\n')
  script.chmod(0o755)
  return str(script), runs


def _runs(runs: pathlib.Path) -> int:
  return len(runs.read_text().split()) if runs.exists() else 0


@pytest.fixture
def site(tmp_path, monkeypatch):
  """The fake NVIDIA packages on sys.path, found as installed ones are (importlib's find_spec)."""
  root = fake_site(tmp_path / "site-packages")
  monkeypatch.syspath_prepend(str(root))
  return root


@pytest.fixture
def fresh_ffi(monkeypatch):
  """ffi's per-process records emptied, no in-tree library, and a GPU as JAX's backend."""
  monkeypatch.setattr(ffi, "_loaded", {})
  monkeypatch.setattr(ffi, "_failed", {})
  monkeypatch.setattr(ffi, "_noticed", False)
  monkeypatch.setattr(extension, "IN_TREE", pathlib.Path("/nonexistent") / extension.NAME)
  monkeypatch.setattr(ffi.jax, "default_backend", lambda: "gpu")


def _notices(caplog):
  return [r for r in caplog.records if r.name == "probjax" and "cuDNN route" in r.getMessage()]


def test_headers_from_a_site_packages_layout(tmp_path):
  root = fake_site(tmp_path)
  h = extension.find_headers([root], {})
  assert dict(h.versions) == {"cudnn": "9.19.0", "frontend": "1.32.0", "cuda": "13.0"}
  # the packages' folders, no /usr/local/cuda: no CUDA_HOME needed where they are installed
  assert h.include_dirs[1:] == (root / "include", root / "nvidia/cudnn/include", root / "nvidia/cu13/include")
  assert (h.include_dirs[0] / "xla/ffi/api/ffi.h").is_file()  # jaxlib's
  cmd = extension.command(h, "g++", tmp_path / "lib.so")
  assert cmd[0] == "g++" and f"-I{root / 'include'}" in cmd and str(extension.SOURCE) in cmd


def test_site_dirs_are_found_by_find_spec(site):
  assert site in extension.site_dirs()
  assert site / "nvidia/cudnn" in extension.nvidia_dirs("cudnn")
  assert extension.discover({}).include_dirs[1:] == (site / "include", site / "nvidia/cudnn/include",
                                                     site / "nvidia/cu13/include")


def test_cuda_home_is_the_fallback(tmp_path):
  root = fake_site(tmp_path / "site")
  shutil.rmtree(root / "nvidia/cu13")  # no CUDA runtime / NVRTC packages
  cuda = tmp_path / "cuda"
  _header(cuda / "include/cuda_runtime_api.h", CUDART_VERSION=12080)
  _header(cuda / "include/crt/host_defines.h")
  _header(cuda / "include/nv/target")
  _header(cuda / "include/nvrtc.h")
  h = extension.find_headers([root], {"CUDA_HOME": str(cuda)})
  assert h.include_dirs[-1] == cuda / "include" and dict(h.versions)["cuda"] == "12.8"


def test_missing_headers_are_named(tmp_path):
  with pytest.raises(extension.BuildError) as e:
    extension.find_headers([tmp_path], {"CUDA_HOME": str(tmp_path / "cuda")})
  msg = str(e.value)
  assert "cudnn_version.h (looked in" in msg and str(tmp_path / "nvidia/cudnn/include") in msg
  assert "cudnn_frontend_version.h" in msg and extension.INSTALL in msg and "[cuda13]" in extension.INSTALL


def test_cache_root_and_key(tmp_path, monkeypatch):
  assert extension.cache_root({"PROBJAX_CACHE_DIR": "/a", "XDG_CACHE_HOME": "/b"}) == pathlib.Path("/a")
  assert extension.cache_root({"XDG_CACHE_HOME": "/b", "HOME": "/h"}) == pathlib.Path("/b/probjax")
  assert extension.cache_root({"HOME": "/h"}) == pathlib.Path("/h/.cache/probjax")

  folders = iter(range(100))

  def key(**site):
    return extension.cache_key(extension.find_headers([fake_site(tmp_path / str(next(folders)), **site)], {}))

  keys = [key()]
  assert keys[0].startswith(f"probjax{probjax.__version__}-jaxlib{importlib.metadata.version('jaxlib')}-")
  assert "-cudnn9.19.0-frontend1.32.0-cuda13.0-" in keys[0]
  assert key() == keys[0]  # the same versions in another folder: the same build
  keys.append(key(cudnn=(9, 20, 0)))
  keys.append(key(frontend=(1, 33, 0)))
  keys.append(key(cudart=13010))
  monkeypatch.setattr(extension, "__version__", "9.9.9")
  keys.append(key())
  monkeypatch.undo()
  version = importlib.metadata.version
  monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.0.1" if d == "jaxlib" else version(d))
  keys.append(key())
  monkeypatch.undo()
  get = sysconfig.get_config_var
  monkeypatch.setattr(sysconfig, "get_config_var", lambda n: "cpython-399-x" if n == "SOABI" else get(n))
  keys.append(key())
  monkeypatch.undo()
  edited = tmp_path / "sdpa_ffi.cc"
  edited.write_bytes(extension.SOURCE.read_bytes() + b"// edited\n")
  monkeypatch.setattr(extension, "SOURCE", edited)
  keys.append(key())
  assert len(set(keys)) == len(keys), keys


def test_build_waits_for_the_lock_and_reuses_the_library(tmp_path, site):
  cxx, runs = fake_compiler(tmp_path)
  env = {"CXX": cxx, "PROBJAX_CACHE_DIR": str(tmp_path / "cache")}
  out = extension.cached_library(env)
  assert out.parent.parent == tmp_path / "cache/cudnn_ffi"
  lines = []
  with extension.locked(out.with_name(out.name + ".lock")):  # another process building
    t = threading.Thread(target=lambda: lines.append(extension.build(env, announce=lines.append)))
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and not out.exists()
    out.write_text("built by the other process")
  t.join(10)
  assert lines == [out] and _runs(runs) == 0 and out.read_text() == "built by the other process"
  assert extension.build(env, announce=lines.append, force=True) == out
  assert _runs(runs) == 1 and out.read_text() == "built\n"
  assert len(lines) == 2 and lines[1].startswith(f"probjax: building the cuDNN FFI extension into {out.parent}")
  assert not list(out.parent.glob(".*.tmp"))


def test_first_use_builds_once_and_a_failure_is_not_retried(tmp_path, site, fresh_ffi, caplog, capsys):
  cxx, runs = fake_compiler(tmp_path, fail=True)
  env = {"CXX": cxx, "PROBJAX_CACHE_DIR": str(tmp_path / "cache")}
  assert ffi.unavailable(env) is None  # buildable: the route is the FFI's until a build fails
  with caplog.at_level(logging.WARNING, logger="probjax"):
    why = ffi.ready(env)
    assert ffi.ready(env) == ffi.unavailable(env) == why
  assert why.startswith("the FFI extension is not built: building it failed:") and "fatal error: cudnn.h" in why
  assert _runs(runs) == 1
  assert capsys.readouterr().err.count("probjax: building the cuDNN FFI extension") == 1
  (notice,) = _notices(caplog)
  msg = notice.getMessage()
  assert "\n" not in msg and why in msg and extension.INSTALL in msg
  assert "PROBJAX_ATTENTION_CUDNN_FFI=0 silences this" in msg
  # another process: the failure's log is there, so it reports it instead of compiling again
  ffi._failed.clear()
  assert "its last build failed (compiler output:" in ffi.ready(env) and _runs(runs) == 1
  with pytest.raises(extension.BuildError, match="fatal error"):  # the build command retries
    extension.build(env, announce=lambda _: None)
  assert _runs(runs) == 2


def test_first_use_build_then_load(tmp_path, site, fresh_ffi, monkeypatch):
  cxx, runs = fake_compiler(tmp_path)
  env = {"CXX": cxx, "PROBJAX_CACHE_DIR": str(tmp_path / "cache")}
  loads = []
  monkeypatch.setattr(ffi, "_load", lambda path: loads.append(path))
  path = extension.cached_library(env)
  assert ffi.extension_status(env) == f"builds on first use on a GPU into {path.parent}"
  assert ffi.ready(env) is None and ffi.ready(env) is None
  assert _runs(runs) == 1 and loads == [path]
  assert ffi.extension_status(env) == f"loaded from {path}"


def test_no_build_without_a_gpu(tmp_path, site, fresh_ffi, monkeypatch):
  cxx, runs = fake_compiler(tmp_path)
  monkeypatch.setattr(ffi.jax, "default_backend", lambda: "cpu")
  why = ffi.ready({"CXX": cxx, "PROBJAX_CACHE_DIR": str(tmp_path / "cache")})
  assert why == "the FFI extension is built on first use on a GPU (platform is cpu)" and _runs(runs) == 0


def test_notice_is_logged_once_and_not_when_disabled(tmp_path, fresh_ffi, caplog):
  missing = {ffi.LIBRARY_ENV: str(tmp_path / "none.so")}
  with caplog.at_level(logging.WARNING, logger="probjax"):
    assert ffi.ready({ffi.ENV: "0"}) == f"{ffi.ENV}=0"
    assert not _notices(caplog)
    for _ in range(3):
      assert ffi.ready(missing).startswith("the FFI extension is not built")
  assert len(_notices(caplog)) == 1


def test_extension_status(tmp_path, site, fresh_ffi, monkeypatch):
  assert ffi.extension_status({ffi.ENV: "0"}) == f"disabled: {ffi.ENV}=0"
  none = tmp_path / "none.so"
  assert ffi.extension_status({ffi.LIBRARY_ENV: str(none)}) == f"missing: the FFI extension is not built ({none})"
  assert ffi.extension_status({"CXX": "/nonexistent/c++"}).startswith(
      "missing: the FFI extension is not built and cannot be built here: no C++ compiler: /nonexistent/c++")
  bad = tmp_path / "bad.so"
  bad.write_bytes(b"not an ELF file")
  env = {ffi.LIBRARY_ENV: str(bad)}
  assert ffi.extension_status(env) == f"built at {bad}, loads on first use"
  ffi.ready(env)
  assert ffi.extension_status(env).startswith(f"missing: the FFI extension {bad} does not load")
  monkeypatch.setattr(extension, "IN_TREE", bad)  # looked at first
  assert ffi.extension_status({}) == ffi.extension_status(env)


def test_build_command(tmp_path, monkeypatch):
  monkeypatch.setattr(extension, "site_dirs", lambda: [tmp_path])
  monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
  monkeypatch.setenv("PROBJAX_CACHE_DIR", str(tmp_path / "cache"))
  extension._discovered.cache_clear()
  with pytest.raises(extension.BuildError, match=r"headers not found: .*cudnn_frontend_version.h"):
    build.main([])
  extension._discovered.cache_clear()
  # run as a module: no runpy RuntimeWarning, and a one-line reason, not a traceback
  env = dict(os.environ, CXX="/nonexistent/c++", PROBJAX_CACHE_DIR=str(tmp_path / "cache"))
  out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", MODULE], env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and "Traceback" not in out.stderr and "RuntimeWarning" not in out.stderr
  assert out.stderr.startswith("probjax: cannot build the cuDNN FFI extension: ")
  assert not (tmp_path / "cache").exists()


def test_the_source_and_the_extra_ship():
  assert extension.SOURCE.is_file()  # package-data: from a wheel too
  pyproject = ROOT / "pyproject.toml"
  if not pyproject.is_file():
    pytest.skip("needs the source tree (pyproject.toml)")
  meta = tomllib.loads(pyproject.read_text())
  assert "csrc/*.cc" in meta["tool"]["setuptools"]["package-data"]["probjax.ops.attention.backends.cudnn"]
  extra = " ".join(meta["project"]["optional-dependencies"]["cuda13"])
  for dist in ("nvidia-cudnn-frontend", "nvidia-cudnn-cu13", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime",
               "nvidia-cuda-crt", "nvidia-cuda-cccl"):
    assert dist in extra


# The header packages bench/stage_cudnn_ffi.sh pins (the H200's cuDNN and CUDA).
PINNED = ("nvidia-cudnn-frontend==1.32.0", "nvidia-cudnn-cu13==9.19.0.56", "nvidia-cuda-nvrtc==13.0.88",
          "nvidia-cuda-runtime==13.0.96", "nvidia-cuda-crt==13.0.88", "nvidia-cuda-cccl==13.0.85")


@pytest.mark.slow
def test_builds_the_extension_from_the_pip_packages(tmp_path):
  """The build command, with the header packages on PYTHONPATH (their wheels' headers, as pip
  installs them) and no CUDA_HOME, compiles a library that exports the FFI targets, where the
  run-time lookup finds it. The wheels are kept where bench/stage_cudnn_ffi.sh keeps them."""
  if shutil.which("g++") is None:
    pytest.skip("no g++")
  wheels = ROOT / ".cudnn_ffi/wheels" if (ROOT / "pyproject.toml").is_file() else tmp_path / "wheels"
  got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *PINNED],
                       capture_output=True, text=True, timeout=1200)
  if got.returncode:
    pytest.skip(f"cannot download the header packages: {got.stderr.strip().splitlines()[-1:]}")
  site = tmp_path / "site-packages"
  for w in wheels.glob("*.whl"):
    if any(w.name.startswith(p.split("==")[0].replace("-", "_") + "-" + p.split("==")[1]) for p in PINNED):
      with zipfile.ZipFile(w) as z:
        z.extractall(site, [n for n in z.namelist() if "/include/" in f"/{n}" or n == "cudnn/__init__.py"])
  env = {k: v for k, v in os.environ.items() if k != "CUDA_HOME"}
  env.update(PYTHONPATH=str(site), PROBJAX_CACHE_DIR=str(tmp_path / "cache"))
  out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", MODULE], env=env,
                       capture_output=True, text=True, timeout=1200)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "RuntimeWarning" not in out.stderr
  (lib,) = (tmp_path / "cache/cudnn_ffi").glob(f"*/{extension.NAME}")
  assert f"cuDNN FFI extension: {lib}" in out.stdout
  probe = ("import ctypes, os; from probjax.ops.attention.backends.cudnn import extension as e; "
           f"lib = ctypes.CDLL({str(lib)!r}); print(all(hasattr(lib, s) for s in {list(ffi._TARGETS.values())!r})); "
           "print(e.cached_library(os.environ)); print(*e.discover(os.environ).include_dirs[1:], sep='\\n')")
  shown = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
  assert shown.returncode == 0, shown.stderr
  loads, found, *includes = shown.stdout.split("\n")[:-1]
  assert loads == "True" and found == str(lib)
  assert all(pathlib.Path(d).is_relative_to(site) for d in includes), includes  # the packages', no CUDA_HOME
