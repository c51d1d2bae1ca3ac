"""bench/scan.py runs on CPU at tiny shapes (--cpu-smoke), writes its rows and resumes."""

import json

import pytest

from bench import scan as bench_scan


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_smoke_writes_rows_and_resumes(tmp_path):
  out = tmp_path / "scan.json"
  argv = ["--cpu-smoke", "--cases", "rla", "--modes", "fwd", "--impls", "chunked,default",
          "--output", str(out)]
  bench_scan.main(argv)
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["impl"] for r in rows] == ["chunked", "default"]
  assert all(r["status"] == "ok" and r["ms"] > 0 and r["command"] for r in rows)
  # interpret mode dispatches as on a GPU, where float32 RLA below feature width 256 runs the
  # Triton kernels (the fastest measured), here emulated
  assert rows[1]["decision"].startswith("triton") and "GPU" in rows[1]["decision"], rows[1]["decision"]
  assert "float32, features 16 < 256" in rows[1]["decision"]
  bench_scan.main(argv + ["--append"])
  assert len(out.read_text().splitlines()) == 2


def test_kernel_profile_says_why_it_is_missing_off_the_gpu():
  import jax
  from bench import harness
  if jax.devices()[0].platform == "gpu":
    pytest.skip("off the GPU only")
  prof = harness.kernel_profile(lambda: 1.0, bench_scan.PROFILE_CALLS)
  assert set(prof) == {"device_ms_error"} and "GPU only" in prof["device_ms_error"]


def test_rla_peer_is_the_op():
  """The benchmark's plain chunked XLA peer computes RLA's linear branch (float32, GQA, a
  window past the first chunk)."""
  import jax.numpy as jnp
  import numpy as np
  from probjax.ops.scan import residual_linear_attention
  case = bench_scan.Case("rla", "rla", (2, 128, 4, 2, 8, 40))
  a = bench_scan.make_inputs(case, jnp.float32)
  np.testing.assert_allclose(bench_scan.rla_peer(**a, window_size=40, chunk=32),
                             residual_linear_attention(**a, window_size=40, implementation="scan"),
                             rtol=1e-5, atol=1e-5)


def test_peer_minutes_that_leave_no_jax_time_are_refused(tmp_path):
  """--peer-minutes keeps its minutes of --max-minutes for the torch peers; keeping all of them
  would run no JAX row, so the command refuses instead of writing the peers' rows alone."""
  out = tmp_path / "scan.json"
  with pytest.raises(SystemExit, match="--peer-minutes 1.5 keeps all of --max-minutes 1.5"):
    bench_scan.main(["--cpu-smoke", "--torch-peers", "--cases", "mamba2", "--modes", "fwd",
                     "--max-minutes", "1.5", "--output", str(out)])
  assert not out.exists() or not out.read_text().strip()
