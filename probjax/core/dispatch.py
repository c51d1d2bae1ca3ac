"""The one :class:`Decision` every op's dispatch returns and its ``explain_dispatch`` reports.

Each op decides by small pure rules over its frozen call description and a
:class:`~probjax.core.device.Device`: the first rule that applies returns a Decision naming a
backend of the op's :class:`~probjax.core.backend.Registry`, the reason, the settings the backend
runs the call with, and, where a differentiated call runs something else, that decision too.
An explicitly requested implementation is checked and kept (``rule="requested"``), never
replaced.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

REQUESTED = "requested"


@dataclasses.dataclass(frozen=True)
class Decision:
  """What computes a call and why.

  Attributes:
    implementation: the registry name of the backend that runs the call (its forward).
    rule: why: the reason the rule that chose it gives, or ``"requested"``.
    config: the settings the backend runs this call with, as ``(name, value)`` pairs in the
      backend's own order (e.g. ``(("chunk_size", 64),)``); empty: the backend's heuristic.
      Read one with :meth:`get`.
    backward: what computes the backward pass where the backend pairs its forward with one of
      several (e.g. ``"triton_fused"``); None: the backend's own.
    grad: what a differentiated call runs (forward with residuals, then backward) where that
      differs from this decision; None: the same.
  """

  implementation: str
  rule: str
  config: tuple[tuple[str, Any], ...] = ()
  backward: str | None = None
  grad: Decision | None = None

  def __post_init__(self):
    if isinstance(self.config, Mapping):
      object.__setattr__(self, "config", tuple(self.config.items()))
    names = [k for k, _ in self.config]
    if len(set(names)) != len(names):
      raise ValueError(f"Decision config names repeat: {names}")

  def get(self, name: str, default: Any = None) -> Any:
    """The config value ``name``, or ``default`` where the decision sets none."""
    return dict(self.config).get(name, default)

  @property
  def under_grad(self) -> Decision:
    """What a differentiated call runs: :attr:`grad`, else this decision."""
    return self if self.grad is None else self.grad

  def replace(self, **changes) -> Decision:
    """A copy with fields changed; ``config=`` entries are merged into the existing ones."""
    if "config" in changes:
      merged = dict(self.config)
      merged.update(dict(changes.pop("config")))
      changes["config"] = tuple(merged.items())
    return dataclasses.replace(self, **changes)

  def as_dict(self) -> dict:
    """JSON-ready: config as a mapping, ``grad`` nested (None where absent)."""
    return {"implementation": self.implementation, "rule": self.rule,
            "config": {k: _plain(v) for k, v in self.config}, "backward": self.backward,
            "grad": None if self.grad is None else self.grad.as_dict()}

  def summary(self) -> str:
    """The implementation and its settings, without the reason."""
    extra = "".join(f", {k}={_plain(v)}" for k, v in self.config)
    if self.backward is not None:
      extra += f", backward={self.backward}"
    return self.implementation + extra

  def __str__(self):
    grad = f"; under grad {self.grad.summary()} ({self.grad.rule})" if self.grad is not None else ""
    return f"{self.summary()} ({self.rule}){grad}"


def _plain(value: Any) -> Any:
  """A config value as JSON and ``str`` show it: a nested decision by its summary."""
  if isinstance(value, Decision):
    return str(value)
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  return repr(value)
