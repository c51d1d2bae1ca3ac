"""The one Decision every op returns (probjax/core/dispatch.py)."""

import json

import pytest

from probjax.core.dispatch import Decision


def test_config_reads_and_merges():
  d = Decision("triton", "rule 7", config={"split_kv": 4}, backward="triton_fused")
  assert d.get("split_kv") == 4 and d.get("chunk_size") is None and d.get("chunk_size", 64) == 64
  e = d.replace(config={"chunk_size": 32}, rule="requested")
  assert e.config == (("split_kv", 4), ("chunk_size", 32)) and e.rule == "requested"
  assert d.config == (("split_kv", 4),)  # frozen: the original is unchanged
  with pytest.raises(ValueError, match="repeat"):
    Decision("xla", "r", config=(("a", 1), ("a", 2)))


def test_str_and_dict_show_everything_chosen():
  grad = Decision("cudnn", "rule 4")
  d = Decision("mosaic", "rule 3", config={"block": 128}, grad=grad)
  assert str(d) == "mosaic, block=128 (rule 3); under grad cudnn (rule 4)"
  row = d.as_dict()
  assert row == {"implementation": "mosaic", "rule": "rule 3", "config": {"block": 128}, "backward": None,
                 "grad": {"implementation": "cudnn", "rule": "rule 4", "config": {}, "backward": None, "grad": None}}
  json.dumps(row)
  nested = Decision("xla", "r", config={"attention": Decision("cudnn", "rule 4")})
  assert nested.as_dict()["config"]["attention"] == "cudnn (rule 4)"
  assert hash(d) == hash(Decision("mosaic", "rule 3", config={"block": 128}, grad=grad))
