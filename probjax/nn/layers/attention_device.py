"""The per-device defaults of ``implementation=None`` (the name the documentation uses): the
tables live with the dispatch, in :mod:`probjax.ops.attention.tuning`."""

from probjax.ops.attention.tuning import (DEVICE_DEFAULTS, TUNING_DIR, DeviceDefaults,  # noqa: F401
                                          load, lookup)
