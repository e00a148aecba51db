"""Memory-aware op order for FX graphs.

* :func:`peak_bytes`: the peak of live tensor bytes when a ``GraphModule`` runs
  in its node order (:mod:`autosac.schedule.memory`);
* :func:`memory_aware_order`: the same graph in an order of least peak
  (:mod:`autosac.schedule.order`).
"""

from autosac.schedule.memory import peak_bytes
from autosac.schedule.order import OrderReport, memory_aware_order

__all__ = ["peak_bytes", "memory_aware_order", "OrderReport"]
