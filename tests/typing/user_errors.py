"""A user's script with three mistakes that a type checker must report (tests/test_typing.py
checks mypy's errors against the ``# error:`` comments: the line, and mypy's error code).
Through a lazy ``__getattr__`` they were all ``Any`` and passed silently. Nothing runs on
import."""

import jax

import probjax
import probjax.nn


def mistakes() -> None:
  q = jax.numpy.ones((1, 8, 2, 16))
  probjax.dot_product_atention(q, q, q)  # error: attr-defined
  probjax.dot_product_attention(q, q, q, implementation=3)  # error: arg-type
  probjax.nn.TransformerLM(vocab_size=256, features=64, num_layers=2, num_heads=4)  # error: call-arg
