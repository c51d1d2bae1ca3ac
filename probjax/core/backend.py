"""The backend contract every op's implementations follow, and the registry per op.

An op (attention, grouped matmul, ...) describes one call by a frozen *call* object (shapes,
dtype, flags, configs: everything but the arrays). A :class:`Backend` says whether it runs on
a device (:meth:`Backend.available`) and whether it computes a call exactly
(:meth:`Backend.supports`, a reason or None), and computes it (:meth:`Backend.__call__`,
differentiable in reverse mode). The op's :class:`Registry` is the only list of its backends:
what is available on a device, which names (and aliases) exist and what an explicit
``implementation=`` resolves to all come from it, so a new backend is one module and one
``register`` call.
"""

from __future__ import annotations

import abc
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
    self._backends: dict[str, Backend[Call]] = {}
    self._aliases: dict[str, str] = {}

  def register(self, backend: Backend[Call]) -> Backend[Call]:
    for name in (backend.name, *backend.aliases):
      if name in self._backends or name in self._aliases:
        raise ValueError(f"{self.op}: implementation name {name!r} is registered twice")
    self._backends[backend.name] = backend
    self._aliases.update({a: backend.name for a in backend.aliases})
    return backend

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
    return self._backends[self.canonical(implementation)]

  def available(self, device: Device) -> list[str]:
    """Names of the backends that can run on ``device``."""
    return [n for n, b in self._backends.items() if b.available(device) is None]
