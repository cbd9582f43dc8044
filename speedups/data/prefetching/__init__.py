"""Batches on the device one step ahead: :func:`prefetch_to_device` and the copy strategies it picks from."""

from speedups.data.prefetching.batch_copy import BatchCopy
from speedups.data.prefetching.device_prefetcher import DevicePrefetcher, prefetch_to_device
from speedups.data.prefetching.pass_through import PassThrough
from speedups.data.prefetching.side_stream import SideStreamCopy

__all__ = ["BatchCopy", "DevicePrefetcher", "PassThrough", "SideStreamCopy", "prefetch_to_device"]
