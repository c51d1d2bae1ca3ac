"""bench/lm_hlo.py runs end to end on the small model (CPU) and reads custom calls from HLO text."""

import json

from bench import lm_hlo


def test_custom_calls_name_their_computation():
  text = """%fused_a (p0: f32[2]) -> f32[2] {
  %c = f32[2] custom-call(%p0), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI
}

ENTRY %main.9 (x: f32[2]) -> f32[2] {
  %g = f32[2] custom-call(%x), custom_call_target="__cublas$gemm"
}"""
  assert lm_hlo.custom_calls(text) == [dict(computation="fused_a", target="mosaic_gpu_v2"),
                                       dict(computation="main.9", target="__cublas$gemm")]


def test_small(tmp_path):
  out = tmp_path / "lm_hlo.json"
  assert lm_hlo.main(["--small", "--output", str(out), "--implementation", "default,xla,cudnn"]) == 0
  rows = {r["impl"]: r for r in map(json.loads, out.read_text().splitlines())}
  assert rows["default"]["case"] == "small" and rows["default"]["status"] == "ok" and rows["default"]["commit"]
  assert isinstance(rows["xla"]["by_target_and_computation"], list)
  assert rows["cudnn"]["status"].startswith("failed: ")  # no cuDNN on a CPU: the row says why
