"""A CPU memory meter for tests: the peak bytes of tensor storage allocated inside a block.

    with PeakBytes() as m:
        loss = f(x); loss.backward()
    m.peak   # bytes: the most storage alive at once among the tensors the block's ops created

Every op's outputs pass through a TorchDispatchMode (forward and autograd's backward alike); each
new storage is tracked by a weak reference to the storage itself (not to the Python tensor, which
may die while autograd still holds the storage), so a tensor saved for backward counts until
backward frees it. Storage that existed before the block (inputs, parameters) is not counted; a
gradient accumulated into .grad stays counted. Views and in-place results allocate nothing and are skipped.
"""
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live, self.peak, self.largest = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view or an in-place op: no new storage
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st.data_ptr() not in self.live and st.nbytes():
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                    self.largest = max(self.largest, st.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out
