"""The scan room's backends, one module (or package) each; :mod:`probjax.ops.scan.registry`
lists them. No backend imports another: shared math lives in
:mod:`probjax.ops.scan.chunked_math`."""
