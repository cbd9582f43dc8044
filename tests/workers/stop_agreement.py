"""Worker: 2 ranks call StopOnSignal.requested() once per 2 ms "micro-step"; rank 1 sends itself SIGUSR1 at
call 200 (rank 0 gets nothing). Each rank prints the call at which it stopped, the agreement rounds it ran
(all-reduces on the agreement's own group, counted) and the signal it received. The agreement's clock is
the calls' count (2 ms each): the interval it sets (0.2 s of calls) is work, whatever the machine's speed."""

import itertools
import os
import signal
import sys
import types

import torch
import torch.distributed as dist

from speedups import StopOnSignal, destroy_distributed, init_distributed, rank
from speedups._helpers import agreement
from tests._dist import say

torch.set_num_threads(1)
_reads = itertools.count(1)
agreement.time = types.SimpleNamespace(monotonic=lambda: 0.002 * next(_reads))  # one read per call: 2 ms
init_distributed()
stop = StopOnSignal()
real_all_reduce = dist.all_reduce
rounds = [0]


def counting_all_reduce(tensor, *args, **kwargs):
    if kwargs.get("group") is stop._agreement.group:
        rounds[0] += 1
    return real_all_reduce(tensor, *args, **kwargs)


dist.all_reduce = counting_all_reduce
stopped_at = None
for call in range(5000):
    if call == 200 and rank() == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    if stop.requested():
        stopped_at = call
        break
dist.all_reduce = real_all_reduce
name = None if stop.received is None else stop.received.name
say(f"rank{rank()} stopped_at={stopped_at} rounds={rounds[0]} received={name}")
stop.close()
destroy_distributed()
sys.stdout.flush()
os._exit(0)
