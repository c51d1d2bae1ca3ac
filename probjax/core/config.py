"""probjax's settings: every ``PROBJAX_*`` environment variable it reads, in one place.

Each :class:`Setting` has its name, its default, the module that reads it and what it does;
``docs/guide/implementations.md`` ("Settings and environment variables") lists them, and
``tests/core/test_config.py`` checks that every ``PROBJAX_*`` name in probjax's Python source is
declared here and documented there.

Settings are read when they are used (a call traced, a library located), never cached at import:
:meth:`Setting.enabled` and :meth:`Setting.value` take an ``env`` mapping, default
``os.environ``, so the dispatch's ``explain_dispatch(..., env={...})`` and the tests ask about
an environment without changing the process's.

Switches are on unless set to ``0``, ``false``, ``off`` or ``no`` (any case, surrounding spaces
ignored); any other value, the empty one included, leaves them on. Values (paths, text) count
as unset when empty.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

OFF = ("0", "false", "off", "no")


@dataclasses.dataclass(frozen=True)
class Setting:
  """One environment variable: ``kind`` ``"switch"`` (on unless turned off, :meth:`enabled`)
  or ``"value"`` (a path or text, :meth:`value`); ``default`` is what an unset one means."""

  name: str
  kind: str
  default: str
  read_by: str
  meaning: str

  def enabled(self, env: Mapping[str, str] | None = None) -> bool:
    """A switch's state under ``env`` (default ``os.environ``): False when set to an off value."""
    env = os.environ if env is None else env
    return env.get(self.name, "1").strip().lower() not in OFF

  def value(self, env: Mapping[str, str] | None = None) -> str | None:
    """A value's text under ``env`` (default ``os.environ``), or None when unset or empty."""
    env = os.environ if env is None else env
    return env.get(self.name) or None


ATTENTION_DEVICE_DEFAULTS = Setting(
    "PROBJAX_ATTENTION_DEVICE_DEFAULTS", "switch", "on", "probjax.ops.attention.dispatch",
    "off: no device table (`probjax/ops/attention/tuning/sm_*.json`), the generic dispatch rules only")
ATTENTION_CUDNN = Setting(
    "PROBJAX_ATTENTION_CUDNN", "switch", "on", "probjax.ops.attention.dispatch",
    "off: the device table's cuDNN rules (3-4) are skipped")
ATTENTION_MOSAIC = Setting(
    "PROBJAX_ATTENTION_MOSAIC", "switch", "on", "probjax.ops.attention.dispatch",
    "off: the device table's Mosaic GPU rules (3, 5, 9) are skipped")
ATTENTION_CUDNN_FFI = Setting(
    "PROBJAX_ATTENTION_CUDNN_FFI", "switch", "on", "probjax.ops.attention.backends.cudnn.ffi",
    "off: the cuDNN route calls `jax.nn.dot_product_attention(implementation=\"cudnn\")` instead of "
    "probjax's own FFI call, and does not build the extension or warn that it is missing")
CUDNN_FFI_LIBRARY = Setting(
    "PROBJAX_CUDNN_FFI_LIBRARY", "value", "unset: `backends/cudnn/_build/`, else the cache",
    "probjax.ops.attention.backends.cudnn.ffi",
    "the built cuDNN FFI library to load (only there when set), instead of the in-tree build or "
    "the per-user cache")
CACHE_DIR = Setting(
    "PROBJAX_CACHE_DIR", "value", "`$XDG_CACHE_HOME/probjax`, else `~/.cache/probjax`",
    "probjax.ops.attention.backends.cudnn.extension",
    "where the cuDNN FFI extension is built on first use and cached")
COMMIT = Setting(
    "PROBJAX_COMMIT", "value", "unset: `git rev-parse --short HEAD` (`+dirty` for local edits)",
    "probjax.core.timing",
    "the probjax commit benchmark rows record (for a copy of the tree without `.git`)")
REPORT_TRACEBACK = Setting(
    "PROBJAX_REPORT_TRACEBACK", "value", "unset", "probjax.attention_report",
    "set (non-empty): the attention report prints the traceback of each failing case")
AUTOTUNE = Setting(
    "PROBJAX_AUTOTUNE", "value", "unset: off", "probjax.core.autotune",
    "set to anything but `0`/`false`/`off`/`no`: autotuning on (opt-in): the first call of each "
    "key times the exact candidates on the device and caches the fastest (`probjax.autotune()` "
    "overrides it inside its block)")
AUTOTUNE_CACHE = Setting(
    "PROBJAX_AUTOTUNE_CACHE", "value", "`$XDG_CACHE_HOME/probjax/autotune.json`, else "
    "`~/.cache/probjax/autotune.json`", "probjax.core.autotune",
    "the autotuning cache (JSON) to read and extend; `probjax.autotune(cache_path=...)` overrides it")

SETTINGS: tuple[Setting, ...] = (ATTENTION_DEVICE_DEFAULTS, ATTENTION_CUDNN, ATTENTION_MOSAIC,
                                 ATTENTION_CUDNN_FFI, CUDNN_FFI_LIBRARY, CACHE_DIR, COMMIT,
                                 REPORT_TRACEBACK, AUTOTUNE, AUTOTUNE_CACHE)


def names() -> list[str]:
  """Every declared variable's name."""
  return [s.name for s in SETTINGS]


def setting(name: str) -> Setting:
  """The declared setting called ``name``; KeyError for an undeclared one."""
  for s in SETTINGS:
    if s.name == name:
      return s
  raise KeyError(f"{name} is not a probjax setting (probjax.core.config.SETTINGS)")


def snapshot(env: Mapping[str, str] | None = None) -> dict[str, str | bool | None]:
  """Each setting's current state under ``env``: a switch's bool, a value's text or None."""
  return {s.name: s.enabled(env) if s.kind == "switch" else s.value(env) for s in SETTINGS}
