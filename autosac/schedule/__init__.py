"""Memory-aware op order for FX graphs.

* :func:`peak_bytes`: the peak of live tensor bytes when a ``GraphModule`` runs
  in its node order (:mod:`autosac.schedule.memory`);
* :func:`memory_aware_order`: the same graph in an order of least peak
  (:mod:`autosac.schedule.order`);
* :func:`memory_aware_backend`: a ``torch.compile`` backend running the
  forward and backward graphs in such orders.
"""

from autosac.schedule.memory import peak_bytes
from autosac.schedule.order import OrderReport, memory_aware_backend, memory_aware_order

__all__ = ["peak_bytes", "memory_aware_order", "memory_aware_backend", "OrderReport"]
