"""parakit: the reference library of the Parakit course on parallel training in PyTorch."""
from parakit.comm import CommLog, ring_all_reduce
from parakit.devices import device
from parakit.launcher import CollectiveHang, LaunchError, LaunchTimeout, RankDied, RankError, launch, shutdown

__all__ = ["launch", "device", "shutdown", "CommLog", "ring_all_reduce", "LaunchError", "RankError",
           "RankDied", "CollectiveHang", "LaunchTimeout", "load_ipython_extension"]


def load_ipython_extension(ipython):
    """`%load_ext parakit` registers the `%%ranks N` cell magic."""
    from parakit.magic import register
    register(ipython)
