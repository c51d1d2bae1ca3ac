import jax
import pytest

from bench import attention_launches


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the refusal is off the GPU")
def test_refuses_off_the_gpu(tmp_path):
  with pytest.raises(SystemExit, match="GPU"):
    attention_launches.main(["--output", str(tmp_path / "a.json")])
  assert not (tmp_path / "a.json").exists()
