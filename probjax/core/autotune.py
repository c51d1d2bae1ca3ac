"""Opt-in autotuning, for any op: measure the exact candidates once per key, keep the choice.

Off by default: dispatch runs its rules. :func:`autotune` (a context manager) or
``PROBJAX_AUTOTUNE=1`` turns it on; then, on the first call of a key (device kind, op, shapes,
dtypes, mask kind, differentiated: :func:`make_key`) an op's dispatch times every backend (and
configuration) that computes the call exactly on the device (:func:`time_candidates`), and
stores the times and the fastest in a JSON :class:`Cache`, which later calls and later processes
read instead of measuring again.

The cache: ``autotune(cache_path=...)``, else ``PROBJAX_AUTOTUNE_CACHE``, else
``$XDG_CACHE_HOME/probjax/autotune.json`` (``~/.cache/probjax/autotune.json``). It is read once
per process (again when the file changed on a miss); a new entry is written under an
inter-process lock (``fcntl.flock`` on ``<cache>.lock``) by re-reading the file, merging the
entry in and replacing the file atomically (a temporary file in the same folder, then
``os.replace``), so processes writing at once lose nothing and readers never see half a file.

Only the standard library is imported at module level (dispatch imports this module to ask
:func:`enabled`); the attention side lives in :mod:`probjax.ops.attention.autotune`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import json
import os
import pathlib
import statistics
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from probjax.core import config

FORMAT = 1  # the cache file's "format"; a file of another format is not read


@dataclasses.dataclass(frozen=True)
class _State:
  enabled: bool
  cache_path: str | None


_STATE: contextvars.ContextVar[_State | None] = contextvars.ContextVar("probjax_autotune", default=None)


@contextlib.contextmanager
def autotune(enabled: bool = True, cache_path: str | os.PathLike | None = None) -> Iterator[None]:
  """Autotuning on (or, ``enabled=False``, off) for the calls traced inside the block.

  ::

    with probjax.autotune():
      jax.jit(train_step).lower(state, batch)  # each new attention call measured once

  Args:
    enabled: on or off inside the block, whatever ``PROBJAX_AUTOTUNE`` says; blocks nest.
    cache_path: the JSON cache to read and extend (default: ``PROBJAX_AUTOTUNE_CACHE``, else
      the user's cache folder, :func:`cache_path`), e.g. one the pre-tune command wrote.

  The state is per thread and per ``contextvars`` context: what a block turns on is on for the
  tracing the block runs, not in other threads.
  """
  token = _STATE.set(_State(bool(enabled), None if cache_path is None else os.fspath(cache_path)))
  try:
    yield
  finally:
    _STATE.reset(token)


def enabled(env: Mapping[str, str] | None = None) -> bool:
  """Whether autotuning is on: the innermost :func:`autotune` block, else ``PROBJAX_AUTOTUNE``
  under ``env`` (default ``os.environ``), off unless set to a value other than ``0``/``false``/
  ``off``/``no``."""
  state = _STATE.get()
  if state is not None:
    return state.enabled
  value = config.AUTOTUNE.value(env)
  return value is not None and value.strip().lower() not in config.OFF


def active(env: Mapping[str, str] | None = None) -> bool:
  """Whether an op's dispatch should ask its autotuner: autotuning :func:`enabled`, or a
  :func:`recording` block open."""
  return _RECORDING.get() is not None or enabled(env)


_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("probjax_autotune_recording", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[dict]]:
  """Collects, inside the block, the calls each op's autotuner is asked about (as JSON-ready
  dicts, each once), e.g. while a model's step is traced: what the pre-tune command takes
  (``python -m probjax.ops.attention.autotune --shapes``). Autotuning need not be on."""
  items: list[dict] = []
  token = _RECORDING.set(items)
  try:
    yield items
  finally:
    _RECORDING.reset(token)


def record(item: dict) -> None:
  """Adds ``item`` to the open :func:`recording` block's list (once); nothing without one."""
  items = _RECORDING.get()
  if items is not None and item not in items:
    items.append(item)


def cache_path(env: Mapping[str, str] | None = None) -> pathlib.Path:
  """The cache file in effect: the :func:`autotune` block's ``cache_path``, else
  ``PROBJAX_AUTOTUNE_CACHE``, else ``$XDG_CACHE_HOME/probjax/autotune.json`` (``~/.cache/...``
  where ``XDG_CACHE_HOME`` is unset)."""
  state = _STATE.get()
  if state is not None and state.cache_path is not None:
    return pathlib.Path(state.cache_path).expanduser()
  explicit = config.AUTOTUNE_CACHE.value(env)
  if explicit:
    return pathlib.Path(explicit).expanduser()
  env = os.environ if env is None else env
  base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "probjax" / "autotune.json"


def make_key(op: str, device: str, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any], mask: str,
             differentiated: bool) -> str:
  """The stable text key of a measurement: the same call description gives the same string in
  every process (no hashes of objects, no ids), e.g.
  ``attention|cpu|1x64x2x16,1x64x2x16,1x64x2x16|float32|none|forward``."""
  shape_text = ",".join("x".join(str(int(d)) for d in s) for s in shapes)
  dtype_text = ",".join(str(getattr(d, "name", d)) for d in dtypes)
  return "|".join((op, device, shape_text, dtype_text, mask, "grad" if differentiated else "forward"))


# ---------------------------------------------------------------------------
# the cache file
# ---------------------------------------------------------------------------
class Cache:
  """One JSON cache file: ``{"format": 1, "entries": {key: entry}}``.

  An entry: ``choice`` (the fastest candidate's name), ``ms`` (every candidate's median
  milliseconds; None for one that failed), ``errors`` (why those failed), ``measured_at``
  (UTC, ISO 8601), ``versions`` (Python, JAX, jaxlib, probjax).
  """

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    self._entries: dict[str, dict] | None = None
    self._stamp: tuple[int, int] | None = None
    self._lock = threading.Lock()

  @property
  def lock_path(self) -> pathlib.Path:
    return self.path.with_name(self.path.name + ".lock")

  def _file_stamp(self) -> tuple[int, int] | None:
    try:
      st = self.path.stat()
    except OSError:
      return None
    return st.st_mtime_ns, st.st_size

  def _read_file(self) -> dict[str, dict]:
    try:
      text = self.path.read_text()
    except FileNotFoundError:
      return {}
    try:
      data = json.loads(text)
    except json.JSONDecodeError:
      return {}  # unreadable: measured again, and the next write replaces it
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
      return {}
    return dict(data["entries"])

  def _refresh(self, *, force: bool = False) -> dict[str, dict]:
    """The entries, read from the file on first use (and again when it changed, with ``force``),
    merged over what this process holds."""
    stamp = self._file_stamp()
    if self._entries is None or (force and stamp != self._stamp):
      merged = dict(self._entries or {})
      merged.update(self._read_file())
      self._entries, self._stamp = merged, stamp
    return self._entries

  def get(self, key: str) -> dict | None:
    """The entry of ``key``, or None; a miss re-reads the file if another process changed it."""
    with self._lock:
      entry = self._refresh().get(key)
      if entry is None:
        entry = self._refresh(force=True).get(key)
      return entry

  def entries(self) -> dict[str, dict]:
    """Every entry this process sees (the file's, re-read if it changed, and its own)."""
    with self._lock:
      return dict(self._refresh(force=True))

  def put(self, key: str, entry: dict) -> None:
    """Adds ``entry`` under ``key`` to the file: under the lock, the file is re-read, merged
    with this entry and replaced atomically."""
    self.update({key: entry})

  def update(self, entries: Mapping[str, dict]) -> None:
    """Adds several entries in one locked write (see :meth:`put`)."""
    with self._lock:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      with _file_lock(self.lock_path):
        merged = self._read_file()
        merged.update(entries)
        _write_atomic(self.path, {"format": FORMAT, "entries": dict(sorted(merged.items()))})
        stamp = self._file_stamp()
      self._entries = {**(self._entries or {}), **merged}
      self._stamp = stamp


@contextlib.contextmanager
def _file_lock(path: pathlib.Path) -> Iterator[None]:
  """An exclusive inter-process lock on ``path`` (``fcntl.flock``; on systems without it, the
  atomic replace alone: no torn files, but two writers at once may drop one's entry)."""
  try:
    import fcntl
  except ImportError:  # pragma: no cover (Windows)
    yield
    return
  with open(path, "a") as f:
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _write_atomic(path: pathlib.Path, data: dict) -> None:
  fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(data, f, indent=1, sort_keys=False)
      f.write("\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


class AllFailed(RuntimeError):
  """No candidate of a measurement ran (nothing is stored)."""


_CACHES: dict[str, Cache] = {}
_CACHES_LOCK = threading.Lock()


def get_cache(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Cache:
  """The process's :class:`Cache` of ``path`` (default :func:`cache_path`), one per file."""
  p = pathlib.Path(path) if path is not None else cache_path(env)
  name = os.path.abspath(p)
  with _CACHES_LOCK:
    if name not in _CACHES:
      _CACHES[name] = Cache(name)
    return _CACHES[name]


def clear_process_caches() -> None:
  """Forgets what this process read (the files stay): the next lookup reads them again."""
  with _CACHES_LOCK:
    _CACHES.clear()


# ---------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------
def _block_until_ready(x):
  import jax
  return jax.block_until_ready(x)


def time_candidates(candidates: Mapping[str, Callable[[], Any]], *, rounds: int = 3, repeats: int = 3,
                    sync: Callable[[Any], Any] | None = None, timer: Callable[..., dict] | None = None,
                    min_repeat_s: float = 0.005) -> tuple[dict[str, float | None], dict[str, str]]:
  """Times each candidate ``fn()`` (which launches the work and returns what ``sync`` waits
  on, default ``jax.block_until_ready``): ``(ms, errors)``, each candidate's median
  milliseconds per call (None where it failed) and the failures' messages.

  Each candidate is warmed up (compiled and run) first, then timed in ``rounds`` rounds, the
  order of the candidates rotated each round so that none always runs after the same one; a
  round is :func:`probjax.core.timing.time_fn` with ``repeats`` repeats, and a candidate's time
  is the median of its rounds' medians. A failing candidate (its error classified by
  :func:`probjax.core.timing.classify_error`) is left out of later rounds. ``timer``
  replaces ``time_fn`` (tests).
  """
  from probjax.core import timing
  sync = sync or _block_until_ready
  timer = timer or timing.time_fn
  names = list(candidates)
  samples: dict[str, list[float]] = {n: [] for n in names}
  errors: dict[str, str] = {}
  for r in range(max(1, rounds)):
    order = names[r % len(names):] + names[:r % len(names)] if names else []
    for name in order:
      if name in errors:
        continue
      try:
        res = timer(candidates[name], sync, warmup=2 if r == 0 else 0, repeats=repeats, min_repeat_s=min_repeat_s)
      except Exception as e:  # noqa: BLE001 (a candidate that fails is recorded, never raised)
        errors[name] = "%s: %s" % timing.classify_error(e)
        continue
      samples[name].append(float(res["ms"]))
  ms = {n: (statistics.median(samples[n]) if samples[n] and n not in errors else None) for n in names}
  return ms, errors


def fastest(ms: Mapping[str, float | None], allowed: Callable[[str], bool] | None = None) -> list[str]:
  """Candidate names by time, fastest first; failed ones (None) and those ``allowed`` refuses
  left out."""
  ok = [(t, n) for n, t in ms.items() if t is not None and (allowed is None or allowed(n))]
  return [n for _, n in sorted(ok)]


def entry_of(ms: Mapping[str, float | None], errors: Mapping[str, str] | None = None, **extra) -> dict:
  """A cache entry for measured times: the choice, the times, the failures, when and with what."""
  order = fastest(ms)
  if not order:
    raise AllFailed(f"every candidate failed: {dict(errors or {})}")
  from probjax.core import timing
  versions = timing.library_versions()
  return {"choice": order[0], "ms": dict(ms), "errors": dict(errors or {}),
          "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "versions": {k: versions[k] for k in ("python", "jax", "jaxlib", "probjax") if k in versions},
          **extra}


def lookup_or_measure(key: str, measure: Callable[[], tuple[dict, dict]] | None, *,
                      cache: Cache | None = None) -> tuple[dict | None, str]:
  """The entry of ``key``: ``(entry, "cached")`` from the cache, else, where ``measure`` (which
  returns :func:`time_candidates`'s ``(ms, errors)``) is given, ``(entry, "measured")`` after
  measuring and storing it; ``(None, "miss")`` when there is nothing to measure with."""
  cache = cache or get_cache()
  entry = cache.get(key)
  if entry is not None:
    return entry, "cached"
  if measure is None:
    return None, "miss"
  ms, errors = measure()
  entry = entry_of(ms, errors)
  cache.put(key, entry)
  return entry, "measured"
