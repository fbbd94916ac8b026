"""Which prefill worker holds which image in its image cache, as far as this gateway knows: learned from
the workers' load reports (image-cache entries added and evicted, or "my cache was emptied") and from this
gateway's own prefills. Keys are (tenant, image hash): a tenant's images are its own. Bounded: the least
recently noted entries are forgotten first (``capacity``)."""

from __future__ import annotations

from collections import OrderedDict

from vlkv.common.reuse import ANONYMOUS
from vlkv.v1 import worker_pb2

MAX_IMAGE_HOLDERS = 65536  # (tenant, image hash) -> prefill worker entries a gateway remembers

Key = tuple[str, str]


class ImageIndex:
    def __init__(self, capacity: int = MAX_IMAGE_HOLDERS) -> None:
        self.capacity = capacity
        self._holder: OrderedDict[Key, str] = OrderedDict()  # least recently noted first
        self._by_worker: dict[str, set[Key]] = {}

    def __len__(self) -> int:
        return len(self._holder)

    def note(self, address: str, images: tuple[str, ...], tenant: str = "") -> None:
        """``address`` prefilled these images of ``tenant`` (it holds them now)."""
        tenant = tenant or ANONYMOUS
        self._note(address, [(tenant, image) for image in images])

    def report(self, address: str, load: worker_pb2.WorkerLoad) -> None:
        """A prefill worker's report: its image-cache entries added and evicted since its last one."""
        if load.images_full:  # the report lists the whole cache: forget what we thought it held
            for key in self._by_worker.pop(address, ()):
                del self._holder[key]
        for d in load.images_evicted:
            self._drop((d.tenant or ANONYMOUS, d.image_hash), address)
        if load.images_added:
            self._note(address, [(d.tenant or ANONYMOUS, d.image_hash) for d in load.images_added])

    def forget(self, address: str) -> None:
        """The worker left: none of its entries count."""
        for key in self._by_worker.pop(address, ()):
            del self._holder[key]

    def held(self, images: tuple[str, ...], tenant: str = "") -> dict[str, int]:
        """address -> how many of ``images`` (of ``tenant``) it holds."""
        tenant = tenant or ANONYMOUS
        held: dict[str, int] = {}
        for image in images:
            address = self._holder.get((tenant, image))
            if address is not None:
                held[address] = held.get(address, 0) + 1
        return held

    def _note(self, address: str, keys: list[Key]) -> None:
        for key in keys:
            old = self._holder.get(key)
            if old is not None and old != address:
                self._by_worker[old].discard(key)
            self._holder[key] = address
            self._holder.move_to_end(key)
            self._by_worker.setdefault(address, set()).add(key)
        while len(self._holder) > self.capacity:
            key, old = self._holder.popitem(last=False)
            self._by_worker[old].discard(key)

    def _drop(self, key: Key, address: str) -> None:
        if self._holder.get(key) == address:
            del self._holder[key]
            self._by_worker[address].discard(key)
