"""tilec: a torch.compile backend that emits fused Triton kernels.

``torch.compile(model, backend="tilec")`` works once the package is installed
(it registers a ``torch_dynamo_backends`` entry point).  ``tilec.stats()``
reports what was compiled; ``tilec.reset_stats()`` clears it;
``tilec.programs()`` gives the compiled programs themselves (their launches,
per-kernel bytes and FLOPs, and optional per-kernel timing).
"""

from tilec import versions
from tilec.backend import tilec_backend
from tilec.pipeline import programs
from tilec.stats import reset_stats, stats

__all__ = ["tilec_backend", "stats", "reset_stats", "programs"]

versions.check_installed()
