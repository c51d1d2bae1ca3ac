"""bench/dit_step.py runs end to end on CPU (``--cpu-smoke``: tiny sizes) and resumes; its
variants, kernel summary and row fields."""

import pytest

from bench import dit_step, harness
from bench.harness import load_rows


def test_flops_convention():
  c = dit_step.CASES["S"]
  n_tok, n_ex = dit_step.matmul_params(c)
  assert c.tokens == 256 and n_tok == 12 * 12 * 384 ** 2 + 2 * 16 * 384
  f = dit_step.train_flops(c)
  assert f["attention_flops"] == 12 * 12 * 64 * 256 ** 2 * 384
  assert f["flops"] == f["dense_flops"] + f["attention_flops"] == 6 * (n_tok * 256 * 64 + n_ex * 64) + f["attention_flops"]


def test_variant_options():
  assert dit_step.variant_options("baseline") == dit_step.DEFAULTS
  mix = dit_step.variant_options("scanned.flat_adamw.xla_cmdbuf_off")
  assert mix["scan_layers"] is True and mix["optimizer"] == "flat" and mix["xla_flags"] == (
      "--xla_gpu_enable_command_buffer=",)
  with pytest.raises(ValueError, match="unknown"):
    dit_step.variant_options("scanned.nope")
  with pytest.raises(ValueError, match="optimizer set twice"):
    dit_step.variant_options("flat_adamw.adamw_mu_bf16")
  assert dit_step.impl_name("baseline") == "probjax" and dit_step.impl_name("scanned") == "probjax_scanned"


def test_kernel_summary():
  # Two steps' kernels: (start_us, duration_us, name).
  k = [(0, 300, "sm90_xmma_gemm_bf16"), (1, 100, "probjax_attention_fwd"), (2, 10, "loop_add_fusion"),
       (3, 300, "sm90_xmma_gemm_bf16"), (4, 100, "probjax_attention_fwd"), (5, 30, "loop_add_fusion"),
       (6, 60, "input_reduce_fusion")]
  s = harness.kernel_summary(k, steps=2, top=2)
  assert s["device_ms"] == pytest.approx(0.45) and s["kernels_per_step"] == 3.5
  assert s["kernel_ms_by_kind"] == pytest.approx({"attention": 0.1, "matmul": 0.3, "other": 0.05})
  assert s["top_kernels"] == [dict(name="sm90_xmma_gemm_bf16", ms_per_step=pytest.approx(0.3), count_per_step=1.0),
                              dict(name="probjax_attention_fwd", ms_per_step=pytest.approx(0.1), count_per_step=1.0)]


@pytest.mark.slow  # about two minutes on a shared 2-core CPU, most of it compiling
@pytest.mark.timeout(900)
def test_cpu_smoke_and_resume(tmp_path):
  out = str(tmp_path / "dit.json")
  argv = ["--cpu-smoke", "--quick", "--output", out, "--variants", "flat_adamw,xla_cmdbuf_off"]
  dit_step.main(argv)
  rows = load_rows(out)
  by = {(r["section"], r["impl"]): r for r in rows}
  train = ["probjax", "probjax_flat_adamw", "probjax_xla_cmdbuf_off", "flax"]
  assert sorted(i for s, i in by if s == "train") == sorted(train)   # baseline added as the reference
  for key in [("matmul", "jnp.dot")] + [("train", i) for i in train]:
    r = by[key]
    assert r["status"] == "ok" and r["ms"] > 0 and len(r["ms_all"]) == 3, r
    assert r["device"] and r["versions"]["jax"] and "dit_step" in r["command"] and r["commit"]
  for i in train:
    r = by[("train", i)]
    assert r["check"] == "ok" and r["check_rel_loss2_diff"] < dit_step.CHECK_REL and r["p10_ms"] <= r["p90_ms"]
    assert r["device_ms_error"].startswith("no kernel profile on platform cpu") and "device_ms" not in r
    assert r["flops"] > 0 and r["optimizer"]
  assert by[("train", "probjax_flat_adamw")]["optimizer"].endswith("on one flat vector")
  child = by[("train", "probjax_xla_cmdbuf_off")]
  assert "--xla_gpu_enable_command_buffer=" in child["xla_flags"] and child["child_s"] > 0
  assert by[("train", "probjax")]["variant"] == "baseline" and by[("train", "probjax")]["scan_layers"] is False
  dit_step.main(argv)
  assert len(load_rows(out)) == len(rows)  # every group already measured: nothing re-run


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_rows_have_the_kernel_profile(tmp_path):
  out = str(tmp_path / "dit.json")
  dit_step.main(["--cpu-smoke", "--quick", "--sections", "train", "--output", out, "--impls", "probjax",
                 "--variants", "scanned,xla_cmdbuf_off"])
  rows = {r["impl"]: r for r in load_rows(out)}
  assert sorted(rows) == ["probjax", "probjax_scanned", "probjax_xla_cmdbuf_off"]
  for r in rows.values():
    assert r["status"] == "ok" and r["check"] == "ok" and r["wall_over_device"] > 0, r
  for r in (rows["probjax"], rows["probjax_scanned"]):
    assert r["device_ms"] > 0 and r["kernels_per_step"] > 0, r
    assert 1 <= len(r["top_kernels"]) <= 24 and set(r["kernel_ms_by_kind"]) <= {"attention", "matmul", "other"}
  assert rows["probjax_xla_cmdbuf_off"]["device_ms_of"] == "probjax"   # the child is not profiled
