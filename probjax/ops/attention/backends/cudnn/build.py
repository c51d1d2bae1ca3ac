"""Builds probjax's cuDNN FFI extension now, into the user cache, or fails saying why:

    python -m probjax.ops.attention.backends.cudnn.build [--force] [--output PATH]

The cuDNN route builds it by itself on first use on a GPU; this builds it ahead, or again
after a failed build. Headers come from the NVIDIA pip packages (probjax's ``cuda13``
extra, ``extension.INSTALL``), else ``$CUDA_HOME`` and ``/usr/local/cuda``
(:mod:`probjax.ops.attention.backends.cudnn.extension`). ``--output``, with the ``--*-include``
folders, is for staging a library elsewhere (``bench/stage_cudnn_ffi.sh`` builds into
``_build/``, which calls look at first): the run-time lookup finds cache builds only under the
key of the headers it finds itself.

Nothing imports this module, so that ``python -m`` runs it without runpy's RuntimeWarning.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from probjax.ops.attention.backends.cudnn import extension


def main(argv=None) -> int:
  """Builds; raises :class:`~probjax.ops.attention.backends.cudnn.extension.BuildError` with the reason."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--force", action="store_true", help="build even if the library is there")
  p.add_argument("--output", type=pathlib.Path, help="the library's path (default: in the user cache)")
  p.add_argument("--cudnn-include", help="cuDNN's headers (default: nvidia-cudnn-cu13's, $CUDNN_INCLUDE_DIR)")
  p.add_argument("--frontend-include", help="cudnn-frontend's headers (default: nvidia-cudnn-frontend's)")
  p.add_argument("--include", action="append", default=[], help="more include folders (CUDA runtime, NVRTC)")
  p.add_argument("--ffi-include", help="XLA's FFI headers (default: the installed jaxlib's; for a library "
                 "carried to another machine, the oldest jaxlib it runs with)")
  a = p.parse_args(argv)
  path = extension.build(output=a.output, force=a.force, include=a.include, cudnn_include=a.cudnn_include,
                         frontend_include=a.frontend_include, ffi_include=a.ffi_include)
  print(f"probjax: cuDNN FFI extension: {path} ({path.stat().st_size // 1024} KiB)")
  return 0


if __name__ == "__main__":
  try:
    sys.exit(main())
  except extension.BuildError as e:
    sys.exit(f"probjax: cannot build the cuDNN FFI extension: {e}")
