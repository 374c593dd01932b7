"""DeepSpeed imported without the optional MLflow import of its autotuner.

`import deepspeed` loads `deepspeed.autotuning.autotuner`, which tries `import mlflow` only to log
autotuning experiments, a feature raypai never runs; importing MLflow costs CPU that every trainer
actor and Ray Train worker would pay, and that roles sharing the cores wait for
(benchmarks/history/asides.md). The import is refused for the time of DeepSpeed's own import (its
autotuner then records MLflow as absent) and allowed again straight after, so code in the same
process that does use MLflow imports it as usual.
"""

from __future__ import annotations

import sys


def import_deepspeed():
    """The `deepspeed` module (imported once per process)."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # `import mlflow` raises ImportError while this entry stands
    try:
        import deepspeed
    finally:
        if sys.modules.get("mlflow", False) is None:
            del sys.modules["mlflow"]
    return deepspeed
