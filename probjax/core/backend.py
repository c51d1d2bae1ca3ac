"""The backend contract every op's implementations follow, and the registry per op.

An op (attention, grouped matmul, ...) describes one call by a frozen *call* object (shapes,
dtype, flags, configs: everything but the arrays). A :class:`Backend` says whether it runs on
a device (:meth:`Backend.available`) and whether it computes a call exactly
(:meth:`Backend.supports`, a reason or None), and computes it (:meth:`Backend.__call__`,
differentiable in reverse mode). The op's :class:`Registry` is the only list of its backends:
what is available on a device, which names (and aliases) exist and what an explicit
``implementation=`` resolves to all come from it, so a new backend is its module and one
registry line: ``register(backend)`` for an object, or ``add(name, "module:Class")``, which
imports the backend's module the first time the backend is asked for (kernels a device cannot
run are then never imported on it).
"""

from __future__ import annotations

import abc
import importlib
from typing import Any, ClassVar, Generic, TypeVar

from probjax.core.device import Device

Call = TypeVar("Call")


class Backend(abc.ABC, Generic[Call]):
  """One implementation of an op."""

  name: ClassVar[str]
  aliases: ClassVar[tuple[str, ...]] = ()

  def available(self, device: Device) -> str | None:
    """Why the backend cannot run on ``device`` at all, or None."""
    return None

  @abc.abstractmethod
  def supports(self, call: Call, device: Device) -> str | None:
    """Why the backend cannot compute ``call`` exactly on ``device``, or None.

    Pure: reads the call's static description only, so dispatch and tests can ask it of
    fake devices."""

  @abc.abstractmethod
  def __call__(self, *arrays: Any, call: Call) -> Any:
    """Computes ``call`` on ``arrays`` (differentiable: ``jax.grad`` runs the backend's own
    backward). Callers check :meth:`supports` first."""


class Registry(Generic[Call]):
  """The backends of one op, by name, in registration order."""

  def __init__(self, op: str):
    self.op = op
    self._backends: dict[str, Backend[Call] | str] = {}  # a str: "module:Class", not imported yet
    self._aliases: dict[str, str] = {}

  def register(self, backend: Backend[Call]) -> Backend[Call]:
    """Registers a backend object under its ``name`` and ``aliases``."""
    self._claim(backend.name, backend.aliases)
    self._backends[backend.name] = backend
    return backend

  def add(self, name: str, target: str, *, aliases: tuple[str, ...] = ()) -> None:
    """Registers the backend class ``target`` (``"package.module:Class"``) under ``name`` and
    ``aliases`` without importing it: the first :meth:`get` imports the module and makes one
    instance, whose own ``name`` and ``aliases`` must be these."""
    if ":" not in target:
      raise ValueError(f"{self.op}: backend target must be 'module:Class', got {target!r}")
    self._claim(name, aliases)
    self._backends[name] = target

  def _claim(self, name: str, aliases: tuple[str, ...]) -> None:
    for n in (name, *aliases):
      if n in self._backends or n in self._aliases:
        raise ValueError(f"{self.op}: implementation name {n!r} is registered twice")
    self._aliases.update({a: name for a in aliases})

  def names(self) -> tuple[str, ...]:
    return tuple(self._backends)

  def canonical(self, implementation: str | None) -> str | None:
    """``implementation`` with aliases resolved; None stays None (the default).

    Raises TypeError for a non-string, ValueError for an unknown name."""
    if implementation is None:
      return None
    if not isinstance(implementation, str):
      raise TypeError(f"implementation must be a string or None, got {type(implementation).__name__}")
    name = self._aliases.get(implementation, implementation)
    if name not in self._backends:
      known = sorted((*self._backends, *self._aliases))
      raise ValueError(f"unknown implementation {implementation!r} of {self.op}; expected None or one of {known}")
    return name

  def get(self, implementation: str) -> Backend[Call]:
    name = self.canonical(implementation)
    backend = self._backends[name]
    if isinstance(backend, str):
      module, cls = backend.split(":")
      backend = getattr(importlib.import_module(module), cls)()
      aliases = tuple(a for a, n in self._aliases.items() if n == name)
      if backend.name != name or tuple(backend.aliases) != aliases:
        raise ValueError(f"{self.op}: {module}:{cls} is named {backend.name!r} (aliases {backend.aliases}), "
                         f"but registered as {name!r} (aliases {aliases})")
      self._backends[name] = backend
    return backend

  def available(self, device: Device) -> list[str]:
    """Names of the backends that can run on ``device``."""
    return [n for n in self._backends if self.get(n).available(device) is None]
