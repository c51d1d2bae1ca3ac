"""The scan room's dispatch on fake devices (pure rules, no arrays), its registry, and that the
Triton kernels lower for an H200 (sm_90) on CPU."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from probjax.core.device import Device
from probjax.ops import scan
from probjax.ops.scan import dispatch, registry
from probjax.ops.scan.calls import MambaCall, RLACall, SSDCall

CPU = Device("cpu")
H200 = Device("gpu", (9, 0), 140 << 30)
RTX3090 = Device("gpu", (8, 6), 24 << 30)
INTERPRET = Device.interpreter()

MAMBA = MambaCall(8, 2048, 1536, 16, "float32")
SSD = SSDCall(8, 2048, 24, 64, 1, 128, "bfloat16")
RLA = RLACall(4, 4096, 8, 8, 64, 64, 512, "softmax", "bfloat16")
CALLS = {"mamba": MAMBA, "ssd": SSD, "rla": RLA}


def _grad(decision):
  """The implementation a differentiated call runs instead (None: the decision's own)."""
  return None if decision.grad is None else decision.grad.implementation


@pytest.mark.parametrize("op, expect", [("mamba", "scan"), ("ssd", "chunked"), ("rla", "chunked")])
def test_cpu_default_is_the_fastest_exact_xla_form(op, expect):
  d = scan.explain_dispatch(CALLS[op], device=CPU)
  assert d.implementation == expect == dispatch.tuned_form(CALLS[op], Device("cpu"), "default")
  assert "cpu" in d.rule


@pytest.mark.parametrize("device", [H200, RTX3090, INTERPRET])
@pytest.mark.parametrize("op", list(CALLS))
def test_gpu_default_is_the_fastest_measured_form(op, device):
  d = scan.explain_dispatch(CALLS[op], device=device)
  # Forward: the Mamba-1, SSD and RLA kernels (RLA in bfloat16:
  # test_gpu_rla_form_follows_the_dtype_and_features). Differentiated: the same, but SSD, whose
  # tuned forward+backward ("grad" in tuning/gpu.json) is the chunked form, forward and backward.
  assert d.implementation == "triton", d
  assert (d.grad and d.grad.implementation) == ("chunked" if op == "ssd" else None), d
  if op == "mamba":
    assert d.get("chunk_size") == 32
  # The kernels asked for: every op's run forward and backward, SSD's included.
  asked = scan.explain_dispatch(CALLS[op], implementation="triton", device=device)
  assert _grad(asked) is None, asked


@pytest.mark.parametrize("dtype, head_dim, feature_map, form", [
    ("bfloat16", 128, "softmax", "triton"), ("float16", 64, "relu", "triton"),
    ("float32", 64, "softmax", "triton"), ("float32", 128, "relu", "triton"),
    ("float32", 128, "softmax", "chunked"), ("float32", 256, "relu", "chunked")])
def test_gpu_rla_form_follows_the_dtype_and_features(dtype, head_dim, feature_map, form):
  """RLA's tuned form is per dtype, and in float32 by feature width: the kernels in bfloat16
  and float16, in float32 below feature width 256 (softmax doubles head_dim), else the chunked
  form; forward and differentiated alike, the rule naming the conditions."""
  call = dataclasses.replace(RLA, dtype=dtype, head_dim=head_dim, v_head_dim=64, feature_map=feature_map)
  d = scan.explain_dispatch(call, device=H200)
  assert (d.implementation, d.grad) == (form, None), d
  assert dispatch.tuned_form(call, H200, "grad") == form
  assert dtype in d.rule
  if dtype == "float32":
    assert f"features {call.features} {'<' if form == 'triton' else '>='} 256" in d.rule, d


@pytest.mark.parametrize("length", [1, 1023, 1024, 4096])
def test_gpu_ssd_forward_runs_the_kernel(length):
  """SSD's forward kernel runs undifferentiated calls at every length; differentiated, the
  chunked form runs forward and backward (the tuned forward+backward; the kernels' own backward
  runs where they are asked for)."""
  d = scan.explain_dispatch(dataclasses.replace(SSD, length=length), device=H200)
  assert d.implementation == "triton" and d.grad.implementation == "chunked", d


def test_tuned_choice_reads_nested_conditions(tmp_path, monkeypatch):
  """A tuned value may nest dtype keys and size conditions; the choice names each one."""
  (tmp_path / "gpu.json").write_text(
      '{"forward": {"ssd_scan": {"float32": "chunked", "other": {"attr": "heads", "below": 16, '
      '"then": "triton", "else": "chunked"}}}}')
  monkeypatch.setattr(dispatch, "TUNING", str(tmp_path))
  assert dispatch.tuned_choice(dataclasses.replace(SSD, heads=8), H200, "forward") == ("triton", "bfloat16, heads 8 < 16")
  assert dispatch.tuned_choice(SSD, H200, "forward") == ("chunked", "bfloat16, heads 24 >= 16")
  assert dispatch.tuned_choice(dataclasses.replace(SSD, dtype="float32"), H200, "forward") == ("chunked", "float32")


def test_gpu_rla_kernel_refusal_runs_chunked_with_the_reason():
  """A bfloat16 RLA call the kernels refuse runs the chunked form forward and backward (RLA has
  no associative form), the reason naming the refusal."""
  d = scan.explain_dispatch(dataclasses.replace(RLA, v_head_dim=512), device=H200)
  assert (d.implementation, d.grad) == ("chunked", None), d
  assert "v_head_dim = 512" in d.rule, d


def test_gpu_grad_default_falls_back_to_chunked_for_memory():
  """A Mamba-1 call the kernels refuse (state 512) is differentiated by the associative form,
  which keeps every position's state: past a quarter of the device's memory (3 float32 copies
  of [B, L, D, N]) the chunked form runs instead."""
  fits = MambaCall(2, 1024, 1536, 512, "float32")        # 3 x 6.4 GB of 140 GB
  too_big = MambaCall(8, 8192, 1536, 512, "float32")     # 3 x 206 GB
  assert _grad(scan.explain_dispatch(fits, device=H200)) == "associative"
  big = scan.explain_dispatch(too_big, device=H200)  # the forward is chunked too: one form
  assert (big.implementation, _grad(big)) == ("chunked", None)


@pytest.mark.parametrize("call, why", [
    (MambaCall(2, 100, 64, 512, "float32"), "state = 512"),
    (MambaCall(2, 100, 64, 16, "float64"), "float64"),
    (MambaCall(2, 100, 64, 16, "float32", chunk_size=24), "chunk_size"),
    (SSDCall(2, 100, 4, 64, 1, 16, "float32", chunk_size=24), "chunk_size"),
    (RLACall(2, 100, 4, 4, 256, 64, 8, "softmax", "float32"), "features = 512"),
    (RLACall(2, 100, 4, 4, 64, 512, 8, "relu", "float32"), "v_head_dim = 512"),
])
def test_gpu_default_falls_back_to_chunked_with_the_reason(call, why):
  d = scan.explain_dispatch(call, device=H200)
  assert d.implementation == "chunked"
  if isinstance(call, MambaCall):  # SSD and RLA run the chunked form by default anyway
    assert why in d.rule
  with pytest.raises(ValueError, match=why):
    scan.explain_dispatch(call, implementation="triton", device=H200)


def test_explicit_triton_off_gpu_says_why():
  with pytest.raises(ValueError, match="interpret=True"):
    scan.explain_dispatch(MAMBA, implementation="triton", device=CPU)
  assert scan.explain_dispatch(MAMBA, implementation="pallas", device=INTERPRET).implementation == "triton"


def test_explicit_requests_are_kept():
  for op, call in CALLS.items():
    for name in dispatch.registry_of(call).names():
      d = scan.explain_dispatch(call, implementation=name, device=H200)
      assert d.implementation == name and d.rule == "requested"


def test_unknown_implementation():
  with pytest.raises(ValueError, match="associative"):  # RLA has no associative form
    scan.explain_dispatch(RLA, implementation="associative", device=CPU)
  with pytest.raises(TypeError):
    scan.explain_dispatch(MAMBA, implementation=3, device=CPU)


def test_chunk_sizes():
  chunked = lambda call: scan.explain_dispatch(call, implementation="chunked", device=CPU).get("chunk_size")
  assert chunked(MAMBA) == 64 and chunked(MambaCall(1, 1, 1, 1, "float32")) == 1
  assert chunked(SSD) == 64 and chunked(SSDCall(1, 20, 2, 4, 1, 4, "float32")) == 32
  assert chunked(RLACall(1, 20, 2, 2, 4, 4, 0, "relu", "float32", chunk_size=5)) == 5
  # RLA's: the smallest power of two whose square reaches 2 F Dv hk / h (at least 16, at most
  # 256), no longer than the power of two covering the sequence.
  assert chunked(RLA) == 128 and chunked(dataclasses.replace(RLA, kv_heads=2)) == 64
  assert chunked(dataclasses.replace(RLA, length=100)) == 128 and chunked(dataclasses.replace(RLA, length=9)) == 16
  assert chunked(RLACall(1, 20, 2, 2, 4, 4, 0, "relu", "float32")) == 16
  assert chunked(RLACall(1, 4096, 2, 2, 256, 256, 0, "softmax", "float32")) == 256
  # Forms without a chunk set none.
  assert scan.explain_dispatch(MAMBA, device=CPU).config == ()


def test_registries_and_availability():
  assert registry.MAMBA.names() == ("scan", "associative", "chunked", "triton")
  assert registry.RLA.names() == ("scan", "chunked", "triton")
  assert scan.available_implementations(MAMBA, CPU) == ["scan", "associative", "chunked"]
  assert scan.available_implementations(SSD, H200)[-1] == "triton"


@pytest.mark.parametrize("kw, match", [(dict(batch=0), "batch"), (dict(length=1.5), "length"),
                                        (dict(groups=5), "groups"), (dict(chunk_size=-2), "chunk_size")])
def test_bad_calls(kw, match):
  fields = dict(batch=2, length=10, heads=4, head_dim=8, groups=2, state=4, dtype="float32")
  with pytest.raises(ValueError, match=match):
    SSDCall(**{**fields, **kw})


def test_interpret_call_dispatches_as_on_a_gpu():
  call = MambaCall(2, 10, 4, 4, "float32", interpret=True)
  assert scan.explain_dispatch(call).implementation == "triton"


# -- every decision as recorded before scan took the shared Decision (issue 40) -----------------
# For each call and device: the outcome of implementation=None, then of each registered name in
# the registry's order, as "implementation[/chunk_size][ grad implementation[/chunk_size]] #rule"
# (rule: an index into _RULES) or "ValueError #message". Recorded from the code at 51f288f.
# RLA's chunk rules changed since: the chunked form's (chunked_math.rla_chunk) is 128 for the
# wide features and values below, the kernels' (backends/triton/rla.default_chunk) 64. Later the
# GPU forward table changed (docs/dev/decisions.md "SSD forward", "RLA by dtype"): SSD's kernel
# runs forward, float32 RLA runs the kernels below feature width 256, and a rule names the
# conditions that chose it. Then the SSD kernels got a backward: asked for, they differentiate
# themselves (no grad; the default's grad stays the tuned chunked form).

_DEVICES = {"cpu": CPU, "h200": H200, "rtx3090": RTX3090, "interpret": INTERPRET}

_RULES = (
    'platform cpu: the fastest exact XLA form measured on CPU',
    'requested',
    "mamba_scan: implementation='triton' cannot compute this call: the Triton kernels need an NVIDIA GPU (platform is cpu); interpret=True emulates them on any platform",
    'GPU: the Triton kernels, the fastest forward measured, compute the call exactly; differentiated, the fastest forward+backward measured',
    "ssd_scan: implementation='triton' cannot compute this call: the Triton kernels need an NVIDIA GPU (platform is cpu); interpret=True emulates them on any platform",
    "residual_linear_attention: implementation='triton' cannot compute this call: the Triton kernels need an NVIDIA GPU (platform is cpu); interpret=True emulates them on any platform",
    'GPU: the Triton kernels, the fastest forward measured (float32, features 128 < 256), compute the call exactly; differentiated, the fastest forward+backward measured',
    'GPU: the Triton kernels, the fastest forward measured (bfloat16), compute the call exactly; differentiated, the fastest forward+backward measured',
    "GPU: the Triton kernels cannot take it (state = 512 is above the kernels' 256 (their state lives in registers))",
    "mamba_scan: implementation='triton' cannot compute this call: state = 512 is above the kernels' 256 (their state lives in registers)",
    'GPU: the Triton kernels cannot take it (the kernels take float32, bfloat16, float16 inputs, not float64)',
    "mamba_scan: implementation='triton' cannot compute this call: the kernels take float32, bfloat16, float16 inputs, not float64",
    "GPU: the Triton kernels cannot take it (the kernels' chunk_size is one of (16, 32, 64, 128), got 24)",
    "mamba_scan: implementation='triton' cannot compute this call: the kernels' chunk_size is one of (16, 32, 64, 128), got 24",
    "ssd_scan: implementation='triton' cannot compute this call: the kernels' chunk_size is one of (16, 32, 64, 128), got 24",
    "ssd_scan: implementation='triton' cannot compute this call: state = 512 is above the kernels' 256 (their state lives in registers)",
    'GPU: the chunked XLA form, the fastest forward measured (float32, features 512 >= 256); differentiated, the fastest forward+backward measured',
    "residual_linear_attention: implementation='triton' cannot compute this call: features = 512 is above the kernels' 256 (their state lives in registers)",
    "GPU: the Triton kernels cannot take it (v_head_dim = 512 is above the kernels' 256 (their state lives in registers))",
    "residual_linear_attention: implementation='triton' cannot compute this call: v_head_dim = 512 is above the kernels' 256 (their state lives in registers)",
    "GPU: the Triton kernels cannot take it (the kernels' chunk_size is one of (16, 32, 64, 128), got 5)",
    "residual_linear_attention: implementation='triton' cannot compute this call: the kernels' chunk_size is one of (16, 32, 64, 128), got 5",
)
_RECORDED = {
    ('mamba L9 float32', 'cpu'): ['scan #0', 'scan #1', 'associative #1', 'chunked/4 #1', 'ValueError #2'],
    ('mamba L9 float32', 'h200'): ['triton/16 #3', 'scan #1', 'associative #1', 'chunked/4 #1', 'triton/16 #1'],
    ('mamba L9 float32', 'rtx3090'): ['triton/16 #3', 'scan #1', 'associative #1', 'chunked/4 #1', 'triton/16 #1'],
    ('mamba L9 float32', 'interpret'): ['triton/16 #3', 'scan #1', 'associative #1', 'chunked/4 #1', 'triton/16 #1'],
    ('ssd L9 float32', 'cpu'): ['chunked/16 #0', 'scan #1', 'associative #1', 'chunked/16 #1', 'ValueError #4'],
    ('ssd L9 float32', 'h200'): ['triton/16 grad chunked/16 #3', 'scan #1', 'associative #1', 'chunked/16 #1', 'triton/16 #1'],
    ('ssd L9 float32', 'rtx3090'): ['triton/16 grad chunked/16 #3', 'scan #1', 'associative #1', 'chunked/16 #1', 'triton/16 #1'],
    ('ssd L9 float32', 'interpret'): ['triton/16 grad chunked/16 #3', 'scan #1', 'associative #1', 'chunked/16 #1', 'triton/16 #1'],
    ('rla L9 float32', 'cpu'): ['chunked/16 #0', 'scan #1', 'chunked/16 #1', 'ValueError #5'],
    ('rla L9 float32', 'h200'): ['triton/16 #6', 'scan #1', 'chunked/16 #1', 'triton/16 #1'],
    ('rla L9 float32', 'rtx3090'): ['triton/16 #6', 'scan #1', 'chunked/16 #1', 'triton/16 #1'],
    ('rla L9 float32', 'interpret'): ['triton/16 #6', 'scan #1', 'chunked/16 #1', 'triton/16 #1'],
    ('mamba L20 float32', 'cpu'): ['scan #0', 'scan #1', 'associative #1', 'chunked/4 #1', 'ValueError #2'],
    ('mamba L20 float32', 'h200'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/4 #1', 'triton/32 #1'],
    ('mamba L20 float32', 'rtx3090'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/4 #1', 'triton/32 #1'],
    ('mamba L20 float32', 'interpret'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/4 #1', 'triton/32 #1'],
    ('ssd L20 float32', 'cpu'): ['chunked/32 #0', 'scan #1', 'associative #1', 'chunked/32 #1', 'ValueError #4'],
    ('ssd L20 float32', 'h200'): ['triton/32 grad chunked/32 #3', 'scan #1', 'associative #1', 'chunked/32 #1', 'triton/32 #1'],
    ('ssd L20 float32', 'rtx3090'): ['triton/32 grad chunked/32 #3', 'scan #1', 'associative #1', 'chunked/32 #1', 'triton/32 #1'],
    ('ssd L20 float32', 'interpret'): ['triton/32 grad chunked/32 #3', 'scan #1', 'associative #1', 'chunked/32 #1', 'triton/32 #1'],
    ('rla L20 float32', 'cpu'): ['chunked/32 #0', 'scan #1', 'chunked/32 #1', 'ValueError #5'],
    ('rla L20 float32', 'h200'): ['triton/32 #6', 'scan #1', 'chunked/32 #1', 'triton/32 #1'],
    ('rla L20 float32', 'rtx3090'): ['triton/32 #6', 'scan #1', 'chunked/32 #1', 'triton/32 #1'],
    ('rla L20 float32', 'interpret'): ['triton/32 #6', 'scan #1', 'chunked/32 #1', 'triton/32 #1'],
    ('mamba L300 float32', 'cpu'): ['scan #0', 'scan #1', 'associative #1', 'chunked/16 #1', 'ValueError #2'],
    ('mamba L300 float32', 'h200'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/16 #1', 'triton/32 #1'],
    ('mamba L300 float32', 'rtx3090'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/16 #1', 'triton/32 #1'],
    ('mamba L300 float32', 'interpret'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/16 #1', 'triton/32 #1'],
    ('ssd L300 float32', 'cpu'): ['chunked/64 #0', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #4'],
    ('ssd L300 float32', 'h200'): ['triton/32 grad chunked/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('ssd L300 float32', 'rtx3090'): ['triton/32 grad chunked/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('ssd L300 float32', 'interpret'): ['triton/32 grad chunked/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('rla L300 float32', 'cpu'): ['chunked/64 #0', 'scan #1', 'chunked/64 #1', 'ValueError #5'],
    ('rla L300 float32', 'h200'): ['triton/64 #6', 'scan #1', 'chunked/64 #1', 'triton/64 #1'],
    ('rla L300 float32', 'rtx3090'): ['triton/64 #6', 'scan #1', 'chunked/64 #1', 'triton/64 #1'],
    ('rla L300 float32', 'interpret'): ['triton/64 #6', 'scan #1', 'chunked/64 #1', 'triton/64 #1'],
    ('mamba L2048 float32', 'cpu'): ['scan #0', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #2'],
    ('mamba L2048 float32', 'h200'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('mamba L2048 float32', 'rtx3090'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('mamba L2048 float32', 'interpret'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('ssd L2048 float32', 'cpu'): ['chunked/64 #0', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #4'],
    ('ssd L2048 float32', 'h200'): ['triton/32 grad chunked/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('ssd L2048 float32', 'rtx3090'): ['triton/32 grad chunked/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('ssd L2048 float32', 'interpret'): ['triton/32 grad chunked/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('rla L2048 float32', 'cpu'): ['chunked/64 #0', 'scan #1', 'chunked/64 #1', 'ValueError #5'],
    ('rla L2048 float32', 'h200'): ['triton/64 #6', 'scan #1', 'chunked/64 #1', 'triton/64 #1'],
    ('rla L2048 float32', 'rtx3090'): ['triton/64 #6', 'scan #1', 'chunked/64 #1', 'triton/64 #1'],
    ('rla L2048 float32', 'interpret'): ['triton/64 #6', 'scan #1', 'chunked/64 #1', 'triton/64 #1'],
    ('mamba L9 bfloat16', 'cpu'): ['scan #0', 'scan #1', 'associative #1', 'chunked/4 #1', 'ValueError #2'],
    ('mamba L9 bfloat16', 'h200'): ['triton/16 #3', 'scan #1', 'associative #1', 'chunked/4 #1', 'triton/16 #1'],
    ('mamba L9 bfloat16', 'rtx3090'): ['triton/16 #3', 'scan #1', 'associative #1', 'chunked/4 #1', 'triton/16 #1'],
    ('mamba L9 bfloat16', 'interpret'): ['triton/16 #3', 'scan #1', 'associative #1', 'chunked/4 #1', 'triton/16 #1'],
    ('ssd L9 bfloat16', 'cpu'): ['chunked/16 #0', 'scan #1', 'associative #1', 'chunked/16 #1', 'ValueError #4'],
    ('ssd L9 bfloat16', 'h200'): ['triton/16 grad chunked/16 #3', 'scan #1', 'associative #1', 'chunked/16 #1', 'triton/16 #1'],
    ('ssd L9 bfloat16', 'rtx3090'): ['triton/16 grad chunked/16 #3', 'scan #1', 'associative #1', 'chunked/16 #1', 'triton/16 #1'],
    ('ssd L9 bfloat16', 'interpret'): ['triton/16 grad chunked/16 #3', 'scan #1', 'associative #1', 'chunked/16 #1', 'triton/16 #1'],
    ('rla L9 bfloat16', 'cpu'): ['chunked/16 #0', 'scan #1', 'chunked/16 #1', 'ValueError #5'],
    ('rla L9 bfloat16', 'h200'): ['triton/16 #7', 'scan #1', 'chunked/16 #1', 'triton/16 #1'],
    ('rla L9 bfloat16', 'rtx3090'): ['triton/16 #7', 'scan #1', 'chunked/16 #1', 'triton/16 #1'],
    ('rla L9 bfloat16', 'interpret'): ['triton/16 #7', 'scan #1', 'chunked/16 #1', 'triton/16 #1'],
    ('mamba L20 bfloat16', 'cpu'): ['scan #0', 'scan #1', 'associative #1', 'chunked/4 #1', 'ValueError #2'],
    ('mamba L20 bfloat16', 'h200'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/4 #1', 'triton/32 #1'],
    ('mamba L20 bfloat16', 'rtx3090'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/4 #1', 'triton/32 #1'],
    ('mamba L20 bfloat16', 'interpret'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/4 #1', 'triton/32 #1'],
    ('ssd L20 bfloat16', 'cpu'): ['chunked/32 #0', 'scan #1', 'associative #1', 'chunked/32 #1', 'ValueError #4'],
    ('ssd L20 bfloat16', 'h200'): ['triton/32 grad chunked/32 #3', 'scan #1', 'associative #1', 'chunked/32 #1', 'triton/32 #1'],
    ('ssd L20 bfloat16', 'rtx3090'): ['triton/32 grad chunked/32 #3', 'scan #1', 'associative #1', 'chunked/32 #1', 'triton/32 #1'],
    ('ssd L20 bfloat16', 'interpret'): ['triton/32 grad chunked/32 #3', 'scan #1', 'associative #1', 'chunked/32 #1', 'triton/32 #1'],
    ('rla L20 bfloat16', 'cpu'): ['chunked/32 #0', 'scan #1', 'chunked/32 #1', 'ValueError #5'],
    ('rla L20 bfloat16', 'h200'): ['triton/32 #7', 'scan #1', 'chunked/32 #1', 'triton/32 #1'],
    ('rla L20 bfloat16', 'rtx3090'): ['triton/32 #7', 'scan #1', 'chunked/32 #1', 'triton/32 #1'],
    ('rla L20 bfloat16', 'interpret'): ['triton/32 #7', 'scan #1', 'chunked/32 #1', 'triton/32 #1'],
    ('mamba L300 bfloat16', 'cpu'): ['scan #0', 'scan #1', 'associative #1', 'chunked/16 #1', 'ValueError #2'],
    ('mamba L300 bfloat16', 'h200'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/16 #1', 'triton/32 #1'],
    ('mamba L300 bfloat16', 'rtx3090'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/16 #1', 'triton/32 #1'],
    ('mamba L300 bfloat16', 'interpret'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/16 #1', 'triton/32 #1'],
    ('ssd L300 bfloat16', 'cpu'): ['chunked/64 #0', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #4'],
    ('ssd L300 bfloat16', 'h200'): ['triton/32 grad chunked/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('ssd L300 bfloat16', 'rtx3090'): ['triton/32 grad chunked/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('ssd L300 bfloat16', 'interpret'): ['triton/32 grad chunked/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('rla L300 bfloat16', 'cpu'): ['chunked/64 #0', 'scan #1', 'chunked/64 #1', 'ValueError #5'],
    ('rla L300 bfloat16', 'h200'): ['triton/64 #7', 'scan #1', 'chunked/64 #1', 'triton/64 #1'],
    ('rla L300 bfloat16', 'rtx3090'): ['triton/64 #7', 'scan #1', 'chunked/64 #1', 'triton/64 #1'],
    ('rla L300 bfloat16', 'interpret'): ['triton/64 #7', 'scan #1', 'chunked/64 #1', 'triton/64 #1'],
    ('mamba L2048 bfloat16', 'cpu'): ['scan #0', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #2'],
    ('mamba L2048 bfloat16', 'h200'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('mamba L2048 bfloat16', 'rtx3090'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('mamba L2048 bfloat16', 'interpret'): ['triton/32 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('ssd L2048 bfloat16', 'cpu'): ['chunked/64 #0', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #4'],
    ('ssd L2048 bfloat16', 'h200'): ['triton/32 grad chunked/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('ssd L2048 bfloat16', 'rtx3090'): ['triton/32 grad chunked/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('ssd L2048 bfloat16', 'interpret'): ['triton/32 grad chunked/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/32 #1'],
    ('rla L2048 bfloat16', 'cpu'): ['chunked/64 #0', 'scan #1', 'chunked/64 #1', 'ValueError #5'],
    ('rla L2048 bfloat16', 'h200'): ['triton/64 #7', 'scan #1', 'chunked/64 #1', 'triton/64 #1'],
    ('rla L2048 bfloat16', 'rtx3090'): ['triton/64 #7', 'scan #1', 'chunked/64 #1', 'triton/64 #1'],
    ('rla L2048 bfloat16', 'interpret'): ['triton/64 #7', 'scan #1', 'chunked/64 #1', 'triton/64 #1'],
    ('mamba big state', 'cpu'): ['scan #0', 'scan #1', 'associative #1', 'chunked/32 #1', 'ValueError #2'],
    ('mamba big state', 'h200'): ['chunked/32 grad associative #8', 'scan #1', 'associative #1', 'chunked/32 #1', 'ValueError #9'],
    ('mamba big state', 'rtx3090'): ['chunked/32 #8', 'scan #1', 'associative #1', 'chunked/32 #1', 'ValueError #9'],
    ('mamba big state', 'interpret'): ['chunked/32 grad associative #8', 'scan #1', 'associative #1', 'chunked/32 #1', 'ValueError #9'],
    ('mamba big state huge', 'cpu'): ['scan #0', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #2'],
    ('mamba big state huge', 'h200'): ['chunked/64 #8', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #9'],
    ('mamba big state huge', 'rtx3090'): ['chunked/64 #8', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #9'],
    ('mamba big state huge', 'interpret'): ['chunked/64 grad associative #8', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #9'],
    ('mamba float64', 'cpu'): ['scan #0', 'scan #1', 'associative #1', 'chunked/8 #1', 'ValueError #2'],
    ('mamba float64', 'h200'): ['chunked/8 grad associative #10', 'scan #1', 'associative #1', 'chunked/8 #1', 'ValueError #11'],
    ('mamba float64', 'rtx3090'): ['chunked/8 grad associative #10', 'scan #1', 'associative #1', 'chunked/8 #1', 'ValueError #11'],
    ('mamba float64', 'interpret'): ['chunked/8 grad associative #10', 'scan #1', 'associative #1', 'chunked/8 #1', 'ValueError #11'],
    ('mamba chunk 24', 'cpu'): ['scan #0', 'scan #1', 'associative #1', 'chunked/24 #1', 'ValueError #2'],
    ('mamba chunk 24', 'h200'): ['chunked/24 grad associative #12', 'scan #1', 'associative #1', 'chunked/24 #1', 'ValueError #13'],
    ('mamba chunk 24', 'rtx3090'): ['chunked/24 grad associative #12', 'scan #1', 'associative #1', 'chunked/24 #1', 'ValueError #13'],
    ('mamba chunk 24', 'interpret'): ['chunked/24 grad associative #12', 'scan #1', 'associative #1', 'chunked/24 #1', 'ValueError #13'],
    ('mamba chunk 64', 'cpu'): ['scan #0', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #2'],
    ('mamba chunk 64', 'h200'): ['triton/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/64 #1'],
    ('mamba chunk 64', 'rtx3090'): ['triton/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/64 #1'],
    ('mamba chunk 64', 'interpret'): ['triton/64 #3', 'scan #1', 'associative #1', 'chunked/64 #1', 'triton/64 #1'],
    ('ssd chunk 24', 'cpu'): ['chunked/24 #0', 'scan #1', 'associative #1', 'chunked/24 #1', 'ValueError #4'],
    ('ssd chunk 24', 'h200'): ['chunked/24 #12', 'scan #1', 'associative #1', 'chunked/24 #1', 'ValueError #14'],
    ('ssd chunk 24', 'rtx3090'): ['chunked/24 #12', 'scan #1', 'associative #1', 'chunked/24 #1', 'ValueError #14'],
    ('ssd chunk 24', 'interpret'): ['chunked/24 #12', 'scan #1', 'associative #1', 'chunked/24 #1', 'ValueError #14'],
    ('ssd state 512', 'cpu'): ['chunked/64 #0', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #4'],
    ('ssd state 512', 'h200'): ['chunked/64 #8', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #15'],
    ('ssd state 512', 'rtx3090'): ['chunked/64 #8', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #15'],
    ('ssd state 512', 'interpret'): ['chunked/64 #8', 'scan #1', 'associative #1', 'chunked/64 #1', 'ValueError #15'],
    ('rla features 512', 'cpu'): ['chunked/128 #0', 'scan #1', 'chunked/128 #1', 'ValueError #5'],
    ('rla features 512', 'h200'): ['chunked/128 #16', 'scan #1', 'chunked/128 #1', 'ValueError #17'],
    ('rla features 512', 'rtx3090'): ['chunked/128 #16', 'scan #1', 'chunked/128 #1', 'ValueError #17'],
    ('rla features 512', 'interpret'): ['chunked/128 #16', 'scan #1', 'chunked/128 #1', 'ValueError #17'],
    ('rla v_head_dim 512', 'cpu'): ['chunked/128 #0', 'scan #1', 'chunked/128 #1', 'ValueError #5'],
    ('rla v_head_dim 512', 'h200'): ['chunked/128 #18', 'scan #1', 'chunked/128 #1', 'ValueError #19'],
    ('rla v_head_dim 512', 'rtx3090'): ['chunked/128 #18', 'scan #1', 'chunked/128 #1', 'ValueError #19'],
    ('rla v_head_dim 512', 'interpret'): ['chunked/128 #18', 'scan #1', 'chunked/128 #1', 'ValueError #19'],
    ('rla chunk 5', 'cpu'): ['chunked/5 #0', 'scan #1', 'chunked/5 #1', 'ValueError #5'],
    ('rla chunk 5', 'h200'): ['chunked/5 #20', 'scan #1', 'chunked/5 #1', 'ValueError #21'],
    ('rla chunk 5', 'rtx3090'): ['chunked/5 #20', 'scan #1', 'chunked/5 #1', 'ValueError #21'],
    ('rla chunk 5', 'interpret'): ['chunked/5 #20', 'scan #1', 'chunked/5 #1', 'ValueError #21'],
}
_RECORDED_CALLS = {
    'mamba L9 float32': MambaCall(2, 9, 64, 16, 'float32'),
    'ssd L9 float32': SSDCall(2, 9, 8, 64, 2, 128, 'float32'),
    'rla L9 float32': RLACall(2, 9, 8, 2, 64, 64, 16, 'softmax', 'float32'),
    'mamba L20 float32': MambaCall(2, 20, 64, 16, 'float32'),
    'ssd L20 float32': SSDCall(2, 20, 8, 64, 2, 128, 'float32'),
    'rla L20 float32': RLACall(2, 20, 8, 2, 64, 64, 16, 'softmax', 'float32'),
    'mamba L300 float32': MambaCall(2, 300, 64, 16, 'float32'),
    'ssd L300 float32': SSDCall(2, 300, 8, 64, 2, 128, 'float32'),
    'rla L300 float32': RLACall(2, 300, 8, 2, 64, 64, 16, 'softmax', 'float32'),
    'mamba L2048 float32': MambaCall(2, 2048, 64, 16, 'float32'),
    'ssd L2048 float32': SSDCall(2, 2048, 8, 64, 2, 128, 'float32'),
    'rla L2048 float32': RLACall(2, 2048, 8, 2, 64, 64, 16, 'softmax', 'float32'),
    'mamba L9 bfloat16': MambaCall(2, 9, 64, 16, 'bfloat16'),
    'ssd L9 bfloat16': SSDCall(2, 9, 8, 64, 2, 128, 'bfloat16'),
    'rla L9 bfloat16': RLACall(2, 9, 8, 2, 64, 64, 16, 'softmax', 'bfloat16'),
    'mamba L20 bfloat16': MambaCall(2, 20, 64, 16, 'bfloat16'),
    'ssd L20 bfloat16': SSDCall(2, 20, 8, 64, 2, 128, 'bfloat16'),
    'rla L20 bfloat16': RLACall(2, 20, 8, 2, 64, 64, 16, 'softmax', 'bfloat16'),
    'mamba L300 bfloat16': MambaCall(2, 300, 64, 16, 'bfloat16'),
    'ssd L300 bfloat16': SSDCall(2, 300, 8, 64, 2, 128, 'bfloat16'),
    'rla L300 bfloat16': RLACall(2, 300, 8, 2, 64, 64, 16, 'softmax', 'bfloat16'),
    'mamba L2048 bfloat16': MambaCall(2, 2048, 64, 16, 'bfloat16'),
    'ssd L2048 bfloat16': SSDCall(2, 2048, 8, 64, 2, 128, 'bfloat16'),
    'rla L2048 bfloat16': RLACall(2, 2048, 8, 2, 64, 64, 16, 'softmax', 'bfloat16'),
    'mamba big state': MambaCall(2, 1024, 1536, 512, 'float32'),
    'mamba big state huge': MambaCall(8, 8192, 1536, 512, 'float32'),
    'mamba float64': MambaCall(2, 100, 64, 16, 'float64'),
    'mamba chunk 24': MambaCall(2, 100, 64, 16, 'float32', 24),
    'mamba chunk 64': MambaCall(2, 100, 64, 16, 'float32', 64),
    'ssd chunk 24': SSDCall(2, 100, 4, 64, 1, 16, 'float32', 24),
    'ssd state 512': SSDCall(2, 100, 4, 64, 1, 512, 'bfloat16'),
    'rla features 512': RLACall(2, 100, 4, 4, 256, 64, 8, 'softmax', 'float32'),
    'rla v_head_dim 512': RLACall(2, 100, 4, 4, 64, 512, 8, 'relu', 'float32'),
    'rla chunk 5': RLACall(1, 20, 2, 2, 4, 4, 0, 'relu', 'float32', 5),
}


def _outcome(call, implementation, device) -> str:
  try:
    d = scan.explain_dispatch(call, implementation=implementation, device=device)
  except ValueError as e:
    return f"ValueError #{_RULES.index(str(e))}" if str(e) in _RULES else f"ValueError {e}"
  form = lambda d: d.implementation + (f"/{d.get('chunk_size')}" if d.get("chunk_size") else "")
  grad = "" if d.grad is None else f" grad {form(d.grad)}"
  return f"{form(d)}{grad} #{_RULES.index(d.rule) if d.rule in _RULES else d.rule}"


@pytest.mark.parametrize("name", list(_RECORDED_CALLS))
def test_decisions_are_the_recorded_ones(name):
  call = _RECORDED_CALLS[name]
  for device_name, device in _DEVICES.items():
    got = [_outcome(call, impl, device) for impl in (None, *dispatch.registry_of(call).names())]
    assert got == _RECORDED[name, device_name], device_name


def test_the_decision_is_the_shared_one():
  from probjax.core.dispatch import Decision
  d = scan.explain_dispatch(_RECORDED_CALLS["mamba big state"], device=H200)
  assert scan.Decision is Decision and isinstance(d, Decision) and isinstance(d.grad, Decision)
  assert d.as_dict()["config"] == {"chunk_size": 32} and d.grad.config == ()
  assert str(d).startswith("chunked, chunk_size=32 (GPU: the Triton kernels cannot take it")
  assert "under grad associative" in str(d)
  # The SSD kernels asked for run their own backward; by default the chunked form differentiates.
  assert scan.explain_dispatch(SSD, implementation="triton", device=H200).grad is None
  assert scan.explain_dispatch(SSD, device=H200).grad == Decision("chunked", dispatch.GRAD_RULE_GPU,
                                                                  config={"chunk_size": 64})


def test_the_face_is_one_set_of_objects():
  from probjax.ops.scan import api
  assert sorted(scan.__all__) == sorted(api.__all__)
  for name in api.__all__:
    assert getattr(scan, name) is getattr(api, name), name


# -- lowering for sm_90 (Pallas -> Triton IR; Triton's own compilation needs the GPU) ----------

def _kernels(fn, *args):
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return sorted(set(re.findall(r"probjax_(?:mamba|ssd|rla)\w*", text)))


S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _loss(fn):
  return lambda *a: jnp.sum(fn(*a).astype(jnp.float32))


def test_mamba_kernel_lowers_for_sm90(fake_h200):
  x, A, B = S((2, 300, 100), BF16), S((100, 16), jnp.float32), S((2, 300, 16), BF16)
  fn = lambda x, A, B: scan.mamba_scan(x, x, A, B, B, z=x)
  assert _kernels(fn, x, A, B) == ["probjax_mamba_scan_fwd"]
  # Differentiated, by default and asked for, the kernels run forward (saving the
  # chunk-boundary states) and backward.
  assert _kernels(jax.grad(_loss(fn), argnums=(0, 1, 2)), x, A, B) == [
      "probjax_mamba_scan_bwd", "probjax_mamba_scan_fwd_res"]
  asked = lambda x, A, B: scan.mamba_scan(x, x, A, B, B, z=x, initial_state=jnp.zeros((2, 100, 16)),
                                          implementation="triton")
  assert _kernels(jax.grad(_loss(asked), argnums=(0, 1, 2)), x, A, B) == [
      "probjax_mamba_scan_bwd", "probjax_mamba_scan_fwd_res"]


def test_ssd_kernel_lowers_for_sm90(fake_h200):
  x, dt = S((2, 300, 8, 64), BF16), S((2, 300, 8), BF16)
  A, B = S((8,), jnp.float32), S((2, 300, 2, 128), BF16)
  fn = lambda x, dt, A, B: scan.ssd_scan(x, dt, A, B, B, implementation="triton")
  assert _kernels(fn, x, dt, A, B) == ["probjax_ssd_scan_fwd"]
  # Differentiated, asked for: the kernels forward (saving the chunk-boundary states) and
  # backward. By default the chunked form runs forward and backward (tuning/gpu.json "grad").
  assert _kernels(jax.grad(_loss(fn), argnums=(0, 1, 2, 3)), x, dt, A, B) == [
      "probjax_ssd_scan_bwd_grads", "probjax_ssd_scan_bwd_local", "probjax_ssd_scan_bwd_pass",
      "probjax_ssd_scan_fwd_res"]
  default = lambda x, dt, A, B: scan.ssd_scan(x, dt, A, B, B)
  assert _kernels(jax.grad(_loss(default), argnums=(0, 1, 2, 3)), x, dt, A, B) == []


def test_rla_kernels_lower_for_sm90(fake_h200):
  q, k = S((2, 300, 8, 64), BF16), S((2, 300, 2, 64), BF16)
  fn = lambda q, k: scan.residual_linear_attention(q, k, k, window_size=64)
  grad = lambda fn: jax.grad(lambda q, k: jnp.sum(fn(q, k).astype(jnp.float32) ** 2), argnums=(0, 1))
  # In bfloat16 the default is the kernels, forward and backward (faster than the chunked form);
  # asked for, the same. In float32 the default is the chunked XLA form's (no kernel).
  asked = lambda q, k: scan.residual_linear_attention(q, k, k, window_size=64, implementation="triton")
  for f in (fn, asked):
    assert _kernels(f, q, k) == ["probjax_rla_fwd", "probjax_rla_fwd_states"]
    assert _kernels(grad(f), q, k) == ["probjax_rla_bwd", "probjax_rla_bwd_states", "probjax_rla_fwd",
                                       "probjax_rla_fwd_states"]
  # Rows wider than 128 (features 256 here) and GQA 8:1: in bfloat16 the kernels; in float32
  # their backward needs more shared memory than sm_90 has at any chunk
  # (test_rla_triton_smem.py), so asked for they are refused, and the default is the chunked
  # form. Float32 (TF32 dots) at features 128 runs the kernels.
  qw, kw = S((1, 100, 8, 128), BF16), S((1, 100, 1, 128), BF16)
  assert len(_kernels(grad(asked), qw, kw)) == 4
  q32, k32 = S((1, 100, 8, 128), jnp.float32), S((1, 100, 1, 128), jnp.float32)
  with pytest.raises(ValueError, match="bytes of shared memory"):
    _kernels(grad(asked), q32, k32)
  assert _kernels(grad(fn), q32, k32) == []
  q32, k32 = S((1, 100, 8, 64), jnp.float32), S((1, 100, 1, 64), jnp.float32)
  assert len(_kernels(grad(asked), q32, k32)) == 4
