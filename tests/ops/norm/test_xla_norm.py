"""The XLA backend against the norm op's conformance suite."""

from tests.ops.norm.conformance import NormConformance


class TestXlaNormConformance(NormConformance):
  implementation = "xla"
  # The 16-bit dtypes repeat the float32 computation (slow: a compilation each); make test keeps
  # one of each.
  slow_cases = frozenset({"*-bfloat16-*", "*-float16-*"})
  fast_cases = frozenset({"*[layer_blocks-bfloat16-res]", "*[adaln_sample-float16-res]"})
