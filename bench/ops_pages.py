"""The performance pages of the ops and layers other than attention, from their results only.

  python -m bench.ops_pages        # bench/results/<device>/{moe,scan,mla,isab,lm_step,dit_step}.json
                                   #   -> docs/dev/<page>.md (one page per suite; norm.json's page
                                   #   only once a device has rows)

``python -m bench.benchmark_figures`` (``make docs``) calls :func:`build` too. Each page is one
table per (device, group of rows): a row per measured case, a column per implementation
(median ms; ``OOM``, ``unsup.``, ``error`` where the row failed, ``—`` where it was not
measured), then the default's time over the fastest other implementation's where the suite has
a default, the suite's own rate (TFLOP/s, TB/s or MFU, with its convention) and, where the rows
carry a kernel profile, the default's kernel time per step by kind (attention / matmul / other). Below each
table: the commands and commits the rows came from, so every number can be measured again.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import sys

from bench.benchmark_figures import DOCS_DIR, DTYPE_SHORT, STATUS_CELL, fmt_ms, md_table
from bench.harness import RESULTS_DIR, load_rows


@dataclasses.dataclass(frozen=True)
class Page:
  """One suite's page.

  Attributes:
    suite: the results file's name (``bench/results/<device>/<suite>.json``).
    title: the page's heading.
    page: the generated file's name under docs/dev/.
    group: the row fields that make one table (e.g. the MoE suite and mode).
    case: the row fields that make one table row (e.g. the token count and routing).
    default: the implementation names of the default's rows; in each table the first present is
      the default (none present: no default column).
    rate: (row field, column label, format) of the rate shown for the default (or the first
      implementation), or None.
    intro: what the suite measures and its rate's convention.
  """
  suite: str
  title: str
  page: str
  group: tuple[str, ...]
  case: tuple[str, ...]
  default: tuple[str, ...]
  rate: tuple[str, str, str] | None
  intro: str


PAGES = (
    Page("moe", "Mixture of experts and grouped matmul", "moe-performance.md",
         group=("suite", "mode", "dtype"), case=("size", "dist", "shape"), default=("auto",),
         rate=("tflops", "TFLOP/s", "{:.3g}"),
         intro=("`python -m bench.moe`: the grouped matmul (`gmm`: forward, `d_lhs`, `d_rhs`) over "
                "uniform and Zipf group sizes, and the MoE layer (`moe_fwd`, `moe_train`: a training "
                "step) for every dispatch (`auto` is the default). TFLOP/s count 2·m·k·n per "
                "grouped matmul over the rows routed.")),
    Page("scan", "Scans: Mamba-1, SSD and RLA", "scan-performance.md",
         group=("case", "mode", "dtype"), case=("shape",), default=("default",), rate=None,
         intro=("`python -m bench.scan`: every backend of `mamba_scan` (`mamba1`), `ssd_scan` "
                "(`mamba2`) and `residual_linear_attention` (`rla`) in one process, rotating "
                "rounds; `default` is `implementation=None`. Shapes: Mamba-1 [B, L, D, N]; SSD "
                "[B, L, H, P, G, N]; RLA [B, T, H, Hkv, D, window].")),
    Page("mla", "Multi-head latent attention", "mla-performance.md",
         group=("suite", "mode", "dtype"), case=("case",), default=("mla_absorbed", "mla_expanded"),
         rate=("tflops", "TFLOP/s", "{:.3g}"),
         intro=("`python -m bench.mla`: the expanded form (training and prefill; q/k head_dim 192, "
                "v 128) against attention's backends and peers with V padded, and the absorbed "
                "decode (latent 512 + rope 64, 128 heads) against XLA forms. `mla_expanded` and "
                "`mla_absorbed` are `probjax.ops.mla.mla` with `implementation=None` (their rows "
                "record the decision). TFLOP/s: 4·B·H·Tq·Tk·d of the form computed (causal "
                "halved).")),
    Page("isab", "Set attention (ISAB)", "isab-performance.md",
         group=("mode", "dtype"), case=("case",), default=("probjax_default",),
         rate=("tflops", "TFLOP/s", "{:.3g}"),
         intro=("`python -m bench.isab`: the induced set attention block on padded sets, every "
                "attention implementation and peers. TFLOP/s: the attention matmuls only, padded "
                "sizes (each row's `flop_convention`).")),
    Page("lm_step", "Language model steps", "lm-performance.md",
         group=("section",), case=("case",), default=("probjax",), rate=("mfu", "MFU", "{:.1%}"),
         intro=("`python bench/lm_step.py`: a decoder-only transformer's training step (plain and "
                "packed documents) and decoding, probjax against the same model on jax.nn's "
                "attention and flax's; `matmul` is the device's measured bf16 matmul rate. MFU: "
                "model FLOPs per step (6·params·tokens plus attention) over the bf16 dense peak. "
                "Layer stack: the rows measured up to 5266542 ran `nnx.scan` unless named "
                "`_unrolled`; the model's default is now the unrolled loop, so later rows run it "
                "unless named `_scanned` (their `scan_layers` field says which).")),
    Page("dit_step", "Diffusion transformer steps", "dit-performance.md",
         group=("section",), case=("case",), default=("probjax",), rate=("mfu", "MFU", "{:.1%}"),
         intro=("`python bench/dit_step.py`: DiT training steps (S/2 and B/2 at 256 tokens), "
                "probjax (also with the layers scanned) against the same model on jax.nn's "
                "attention and flax's. MFU as on the language-model page.")),
)

# Suites whose page is written only once a device has rows (build() skips them before).
MEASURED_ONLY = (
    Page("norm", "Norms: RMS, layer norm and adaLN", "norm-performance.md",
         group=("mode", "dtype"), case=("case",), default=("default",), rate=("gb_s", "GB/s", "{:.0f}"),
         intro=("`python -m bench.norm`: `rms_norm` and `layer_norm` (with and without `residual=`) and "
                "`adaln_modulate` on `implementation=\"xla\"` (XLA's fusion of the formula), `\"triton\"` "
                "(the Pallas-Triton row kernels) and `default` (`implementation=None`), in one process, "
                "rotating rounds. Cases `<shape>/<op>`: `lm` 8 x 2048 tokens, d 768; `dit` DiT-B/2's 64 x "
                "256 tokens, d 768, adaLN shift/scale per batch element; `wide` 8192 tokens, d 4096. "
                "GB/s: the bytes of the inputs read once plus the outputs written once (`fwd_bwd`: also "
                "the cotangents read and every input's gradient written) over the time.")),
    Page("lce", "Fused linear cross-entropy", "lce-performance.md",
         group=("dtype",), case=("case",), default=("fused",), rate=None,
         intro=("`python -m bench.linear_cross_entropy`: the mean loss's value and gradients (x and the "
                "head) of `linear_cross_entropy` on its XLA backend at the default tile (`fused`), at "
                "given tiles (`fused_<tokens>x<vocab>`; `xall`: the whole vocabulary, whose rows compute "
                "the gradients in the forward sweep), its Triton kernels (`triton`) and the logits "
                "materialised in float32 (`unfused`), one compiled program each, rotating rounds. Cases "
                "(tokens x d x vocab, bf16): `lm_head` 16384 x 768 x 32768, `big_vocab` 8192 x 1024 x "
                "131072. Each row also has `temp_bytes`, XLA's temporary memory of the program. `fused` "
                "is the default of the row's commit: 1024 x 4096 before 5266542 (from then 1024 tokens x "
                "the whole vocabulary for a mean loss), except at d4a92c0, whose default was a rule "
                "under validation (the whole vocabulary for a mean loss, the token tile from a 128 MiB "
                "budget for its float32 logits), withdrawn after its validation sample; each row's "
                "`chunk_tokens`/`chunk_vocab` say which tile ran.")),
    Page("lce_validate", "Fused linear cross-entropy: the default tile on drawn cases", "lce-validation.md",
         group=("dtype",), case=("case",), default=("fused",), rate=None,
         intro=("The rows of the fused-loss page (same implementations and conventions) on 12 (tokens, d, "
                "vocabulary) cases drawn at random (tokens 2048-65536 and vocabularies 8000-262144 "
                "log-uniform, d from 512 to 4096), each sample drawn after the rule it validates. H100: "
                "`python -m bench.linear_cross_entropy --sample 12 --seed 212092681 --append`, after the "
                "first rule was fitted on the fused-loss page's two cases (`bench/tuning/lce/validate_seed.json`); "
                "`fused` is that rule (d4a92c0: the whole vocabulary, the token tile from a 128 MiB budget), "
                "`fused_1024x4096` the default before and after it. H200: seed 44243335 with `--tiles "
                "512xall,1024xall,2048xall,1024x4096 --skip triton,fused`, after the second rule "
                "(`bench/lce_rule.py`, scored offline: `python -m bench.lce_rule <rows>`) was written "
                "(`bench/tuning/lce/validate2_seed.json`); the default was 1024 x 4096. H100, third sample: "
                "seed 1373447062 with the same tiles, after the fixed 1024 x whole-vocabulary tile was "
                "proposed (`bench/tuning/lce/validate3_seed.json`); it became the default for a mean or "
                "sum loss (5266542) by the criterion declared before (`docs/dev/decisions.md`). Each "
                "row's `chunk_tokens`/`chunk_vocab` say which tile ran.")),
)


def _device_slug(path: str) -> str:
  return os.path.basename(os.path.dirname(path))


def _value(row: dict, field: str):
  v = row.get(field)
  if field == "dtype" and v is not None:
    return DTYPE_SHORT.get(v, v)
  return "—" if v is None else v


def _ms_cell(row: dict | None) -> str:
  if row is None:
    return "—"
  if row.get("status") != "ok" or row.get("ms") is None:
    return STATUS_CELL.get(row.get("status"), str(row.get("status", "?")))
  return fmt_ms(row["ms"])


def _impl_order(impls, default):
  """The default first, then probjax's own implementations, then peers, each alphabetical."""
  def key(i):
    peer = i.startswith(("jaxnn", "torch", "tokamax", "flax", "jax_", "jnp"))
    return (i != default, peer, i)
  return sorted(impls, key=key)


def table(page: Page, rows: list[dict]) -> str:
  """The markdown table of one group's rows: a row per case, a column per implementation, then
  the default over the fastest other implementation and the rate."""
  present = {r["impl"] for r in rows}
  default = next((d for d in page.default if d in present), None)
  impls = _impl_order(present, default)
  by_case = collections.OrderedDict()
  for r in rows:
    by_case.setdefault(tuple(str(_value(r, f)) for f in page.case), {})[r["impl"]] = r
  header = list(page.case) + [f"{i} ms" for i in impls]
  if default:
    header.append("default / fastest other")
  if page.rate:
    header.append(f"{page.rate[1]} ({default or impls[0]})")
  kinds = any(r.get("kernel_ms_by_kind") for r in rows)
  if kinds:
    header.append(f"kernel ms attention / matmul / other ({default or impls[0]})")
  body = []
  for case, got in by_case.items():
    line = list(case) + [_ms_cell(got.get(i)) for i in impls]
    ok = {i: r["ms"] for i, r in got.items() if r.get("status") == "ok" and r.get("ms")}
    if default:
      others = [v for i, v in ok.items() if i != default]
      line.append(f"{ok[default] / min(others):.2f}" if default in ok and others else "—")
    if page.rate:
      field, _, fmt = page.rate
      first = got.get(default or impls[0]) or next(iter(got.values()))
      v = first.get(field) if first.get("status") == "ok" else None
      line.append(fmt.format(v) if isinstance(v, (int, float)) else "—")
    if kinds:
      k = (got.get(default or impls[0]) or {}).get("kernel_ms_by_kind") or {}
      line.append(" / ".join(fmt_ms(k.get(kind)) for kind in ("attention", "matmul", "other")) if k else "—")
    body.append(line)
  return md_table(header, body)


def page_text(page: Page, results_dir: str) -> str:
  """The whole page of ``page``'s suite from every device's results file."""
  parts = [f"# {page.title}", "",
           f"<!-- generated by `python -m bench.ops_pages` from bench/results/<device>/{page.suite}.json; "
           "do not edit -->", "", page.intro, ""]
  paths = sorted(glob.glob(os.path.join(results_dir, "*", f"{page.suite}.json")))
  if not paths:
    return "\n".join(parts + ["_Not measured yet._"]) + "\n"
  for path in paths:
    rows = [r for r in load_rows(path) if isinstance(r, dict) and r.get("impl")]
    devices = sorted({r.get("device", "?") for r in rows})
    parts += [f"## {', '.join(devices)}", ""]
    groups = collections.OrderedDict()
    for r in rows:
      groups.setdefault(tuple(str(_value(r, f)) for f in page.group), []).append(r)
    for g, rr in groups.items():
      parts += [f"### {' · '.join(g)}", "", table(page, rr), ""]
    sources = sorted({(r.get("command", "?"), str(r.get("commit", "?"))) for r in rows})
    parts += ["Measured with:", ""] + [f"- `{c}` at {k}" for c, k in sources] + [""]
  return "\n".join(parts).rstrip() + "\n"


DISPATCH_PAGE = "dispatch-performance.md"
DISPATCH_OPS = ("attention", "mla", "grouped_matmul", "mamba_scan", "ssd_scan", "residual_linear_attention")


def dispatch_page_text(results_dir: str) -> str:
  """The measured-dispatch page: per device and op, the report of
  ``bench/results/<device>/dispatch_<op>_fit.json`` and, where measured, ``…_validate.json``
  (:mod:`bench.dispatch_sample` for attention, :mod:`bench.dispatch_ops` for the others)."""
  parts = ["# Measured dispatch", "",
           "<!-- generated by `python -m bench.ops_pages` from bench/results/<device>/dispatch_<op>_{fit,validate}.json; "
           "do not edit -->", "",
           "The default against the fastest exact path on calls drawn at random (`bench/dispatch_sample.py`, "
           "`bench/dispatch_ops.py`: the distributions, seeds and protocol), every path timed in one process in "
           "rotating rounds. The fit sample's rows fitted the rules (its default column is the default "
           "before that fit); the validation sample was drawn after the fit and measured with the fitted default. \"its pick requested/best\" times the path the "
           "default chose, requested explicitly, against the best: the decision's regret without the "
           "spread between two rows of one kernel.", ""]
  found = False
  for dev_dir in sorted(glob.glob(os.path.join(results_dir, "*"))):
    for op in DISPATCH_OPS:
      fit, val = (os.path.join(dev_dir, f"dispatch_{op}_{part}.json") for part in ("fit", "validate"))
      if not os.path.exists(fit):
        sections = _other_device_sections(
            op, sorted(glob.glob(os.path.join(dev_dir, f"dispatch_{op}_validate*.json"))), results_dir)
        found = found or bool(sections)
        parts += sections
        continue
      found = True
      fit_rows = _dispatch_rows(op, fit)
      val_rows = _dispatch_rows(op, val) if os.path.exists(val) else None
      rows = fit_rows + (val_rows or [])
      devices = ", ".join(sorted({r.get("device", "?") for r in rows}))
      parts += _report_section(f"## {op} · {devices}", [], _dispatch_report(op, fit_rows, val_rows), rows)
      for n, word in ((2, "second"), (3, "third")):
        later = os.path.join(dev_dir, f"dispatch_{op}_validate{n}.json")
        if not val_rows or not os.path.exists(later):
          break
        rows_n = _dispatch_rows(op, later)
        intro = ["Drawn after the rules were refitted on every earlier sample (the \"fit\" columns below are "
                 "those samples together, each with the default it was measured with).", ""]
        parts += _report_section(f"### {op} · {devices} · {word} validation", intro,
                                 _dispatch_report(op, rows, rows_n), rows_n)
        rows = rows + rows_n
  if not found:
    parts.append("_Not measured yet._")
  return "\n".join(parts).rstrip() + "\n"


def _other_device_sections(op: str, paths: list[str], results_dir: str) -> list[str]:
  """Sections for validation samples measured on a device whose folder has no fit sample of
  ``op``: each against the samples of the devices that have one (those the rules were fitted on)."""
  earlier = [r for dev in sorted(glob.glob(os.path.join(results_dir, "*")))
             if os.path.exists(os.path.join(dev, f"dispatch_{op}_fit.json"))
             for path in sorted(glob.glob(os.path.join(dev, f"dispatch_{op}_*.json")))
             if re.fullmatch(rf"dispatch_{op}_(fit|validate\d*)\.json", os.path.basename(path))
             for r in _dispatch_rows(op, path)]
  out = []
  for path in paths:
    rows = _dispatch_rows(op, path)
    seeds = {r.get("seed") for r in rows}
    reference = [r for r in earlier if r.get("seed") not in seeds]  # the same sample on another device is no fit
    if not rows or not reference:
      continue
    devices = ", ".join(sorted({r.get("device", "?") for r in rows}))
    name = os.path.basename(path)[len(f"dispatch_{op}_"):-len(".json")]
    intro = [f"`{name}` measured on this device alone; the \"fit\" columns are the samples of the devices "
             "the rules were fitted on (other samples only), each with the default it was measured with.", ""]
    out += _report_section(f"## {op} · {devices} · {name}", intro, _dispatch_report(op, reference, rows), rows)
  return out


def _dispatch_rows(op: str, path: str) -> list[dict]:
  """One sample's rows of ``op`` (:mod:`bench.dispatch_sample` for attention, :mod:`bench.dispatch_ops`
  for the others)."""
  from bench import dispatch_ops, dispatch_sample
  return dispatch_sample.load_rows(path) if op == "attention" else dispatch_ops.load_rows(path, dispatch_ops.SPECS[op])


def _dispatch_report(op: str, fit_rows: list[dict], val_rows: list[dict] | None) -> str:
  """The Markdown report of ``op``'s rows fitted on (``fit_rows``) and validated on (``val_rows``)."""
  from bench import dispatch_ops, dispatch_sample
  if op == "attention":
    return dispatch_sample.markdown(dispatch_sample.build_report(fit_rows, val_rows))
  spec = dispatch_ops.SPECS[op]
  return dispatch_ops.markdown(spec, dispatch_ops.build_report(spec, fit_rows, val_rows))


def _report_section(heading: str, intro: list[str], text: str, rows: list[dict]) -> list[str]:
  """A report under ``heading``: its own title dropped and its headings moved below the heading's
  level, then the commands and commits its ``rows`` were measured with."""
  level = heading.split(" ", 1)[0]
  body = "\n".join(level + l if l.startswith("#") else l for l in text.split("\n", 1)[1].splitlines())
  sources = sorted({(r.get("command", "?"), str(r.get("commit", "?"))) for r in rows})
  return ([heading, "", *intro, body.strip(), "", "Measured with:", ""]
          + [f"- `{c}` at {k}" for c, k in sources] + [""])


def build(results_dir: str = RESULTS_DIR, docs_dir: str = DOCS_DIR) -> list[str]:
  """Writes every page of :data:`PAGES`, those of :data:`MEASURED_ONLY` whose suite has rows, and
  the measured-dispatch page (:func:`dispatch_page_text`) into ``docs_dir``; returns their paths."""
  out = []
  path = os.path.join(docs_dir, DISPATCH_PAGE)
  with open(path, "w") as f:
    f.write(dispatch_page_text(results_dir))
  out.append(path)
  measured = [p for p in MEASURED_ONLY
              if any(load_rows(f) for f in glob.glob(os.path.join(results_dir, "*", f"{p.suite}.json")))]
  for page in (*PAGES, *measured):
    path = os.path.join(docs_dir, page.page)
    with open(path, "w") as f:
      f.write(page_text(page, results_dir))
    out.append(path)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--results-dir", default=RESULTS_DIR)
  p.add_argument("--docs-dir", default=DOCS_DIR)
  args = p.parse_args(argv)
  print(json.dumps(build(args.results_dir, args.docs_dir), indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
