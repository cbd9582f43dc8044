"""Worker: a 2-rank FSDP2 run, stopped and resumed in every way a long run is (tests/checkpoint/
test_fsdp2_long_runs.py). Usage: ``fsdp2_resume_window.py OUT_DIR MODE [ARGS]``, under torchrun with 2 gloo
processes unless said:

- ``full``: the uninterrupted run (``ref-rank<r>.pt``), then the same run saving a checkpoint directory
  after every micro-step of epoch 0 (``k<k>``; its result ``saving-rank<r>.pt``).
- ``resume K[,K...]``: builds everything afresh for each K, loads ``k<K>``, finishes (``resumed-<K>-...``).
- ``rundir NAME STOP [destroy]``: through ``RunDirectory(OUT_DIR/NAME, every_updates=1, background=True)``;
  the processes end after micro-step STOP without close() (``destroy``: by destroy_distributed() and
  ``os._exit``, which waits for nothing). ``signal NAME K``: one rank sends itself SIGTERM after
  micro-step K. ``rundir-resume NAME``: resumes NAME and finishes (``NAME-rank<r>.pt``).
- ``elastic``: without batch norm and dropout, the uninterrupted run (``elastic-ref-rank<r>.pt``) and a
  checkpoint after micro-step 4 (``elastic4``). ``one`` (plain python, no process group): loads
  ``elastic4`` into a plain model with ``@accumulate(8)`` and finishes (``one.pt``).

The run: Linear-BatchNorm-Tanh-Dropout-Linear, each Linear ``fully_shard``ed, then the whole
(``ddp_wrap(..., strategy="fsdp")``), batch statistics moving in every call, dropout drawing per rank,
``@accumulate(4, model=)`` over 10 micro-steps per epoch (windows of 4, 4 and a short 2 that ``epoch()``
flushes), 2 epochs, AdamW, a loader with one persistent worker per rank and random augmentation
(``sample_seeds=True``), a ``LossTracker`` per rank. Every rank's pending calls, RNG states, batch
statistics and tracker differ, so a rank resumed with another rank's state ends elsewhere.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from speedups import (
    LossTracker,
    RunDirectory,
    accumulate,
    ddp_wrap,
    destroy_distributed,
    distributed,
    fast_loader,
    init_distributed,
    load_checkpoint,
    save_checkpoint,
)
from tests._loading_data import Noisy

out, mode = Path(sys.argv[1]), sys.argv[2]
N, BATCH, EVERY, EPOCHS = 40, 2, 4, 2
# Another layout draws other dropout masks, and the gradient of a bias just before batch norm is rounding
# noise (its true value is 0), which AdamW scales up to whole steps: neither where the layout changes.
DROPOUT = 0.0 if mode in ("elastic", "one") else 0.3
torch.set_num_threads(1)
if mode != "one":  # "one": a plain process, no process group
    init_distributed()
RANK = torch.distributed.get_rank() if mode != "one" else 0


def build(sharded=True, every=EVERY):
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(16) if DROPOUT else nn.Identity()
    net = nn.Sequential(nn.Linear(6, 16), norm, nn.Tanh(), nn.Dropout(DROPOUT), nn.Linear(16, 1))
    if sharded:
        for layer in (net[0], net[4]):
            fully_shard(layer)
    model = ddp_wrap(net, strategy="fsdp") if sharded else net
    torch.manual_seed(100 + RANK)  # each rank its own stream: dropout masks and the workers' seeds differ
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    loader = distributed(fast_loader(Noisy(N), BATCH, shuffle=True, num_workers=1, sample_seeds=True))
    step = accumulate(every, opt, model=model)(lambda x, y: F.mse_loss(model(x), y))
    return model, opt, loader, step, LossTracker()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def result(model, opt, step, tracker):
    """What a run ends with, whole tensors (FSDP2's shards gathered): compared with torch.equal."""
    return {
        "weights": [full(p).detach().clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "optimizer": {k: {n: full(v) for n, v in s.items()} for k, s in opt.state_dict()["state"].items()},
        "updates": (step.step, step.num_updates),
        "tracker": tracker.state_dict(),
    }


def run(resume_from=None, save=False, sharded=True, every=EVERY, prefix="k"):
    model, opt, loader, step, tracker = build(sharded, every)
    state = dict(model=model, optimizer=opt, loader=loader, step=step, tracker=tracker)
    start = 0 if resume_from is None else load_checkpoint(resume_from, **state)["epoch"]
    for epoch in range(start, EPOCHS):
        for x, y in step.epoch(loader):
            tracker.update(step(x, y))
            if (save is True and epoch == 0) or (save and save is not True and step.step in save):
                save_checkpoint(out / f"{prefix}{step.step}", **state, epoch=epoch)
    return result(model, opt, step, tracker)


def run_directory(name, stop_at=None, signal_at=None, end_with="exit"):
    """Through ``RunDirectory(out / name, every_updates=1, background=True)``. ``stop_at``: end the process
    after that micro-step without close() (the last background save still in flight). ``signal_at``: rank
    ``signal_at % 2`` sends itself SIGTERM after that micro-step (micro-steps take 50 ms, so the ranks agree
    a few later); each rank writes ``stop-rank<r>.txt``: the micro-step it stopped after and its exit code.
    ``end_with="destroy"``: end by destroy_distributed() and ``os._exit``, not by the interpreter's exit."""
    model, opt, loader, step, tracker = build()
    run = RunDirectory(out / name, every_updates=1, background=True)
    state = dict(model=model, optimizer=opt, loader=loader, step=step, tracker=tracker)
    start = run.resume(**state).get("epoch", 0)
    resumed_at = step.step
    for epoch in range(start, EPOCHS):
        for x, y in step.epoch(loader):
            tracker.update(step(x, y))
            if signal_at is not None:
                time.sleep(0.05)
                if step.step == signal_at and signal_at % 2 == RANK:
                    os.kill(os.getpid(), signal.SIGTERM)
            try:
                run.after_step(epoch=epoch)
            except SystemExit as stop:
                (out / name / f"stop-rank{RANK}.txt").write_text(f"{step.step} {stop.code}")
                raise
            if step.step == stop_at:
                sys.stdout.flush()
                if end_with == "destroy":  # the group goes at once: destroy_distributed() waits for the save
                    destroy_distributed()
                    os._exit(0)
                sys.exit(0)  # no close(), no destroy_distributed(): the interpreter's exit waits for the save
    run.close()
    return {**result(model, opt, step, tracker), "resumed_at": resumed_at}


if mode == "full":
    torch.save(run(), out / f"ref-rank{RANK}.pt")
    torch.save(run(save=True), out / f"saving-rank{RANK}.pt")
elif mode == "elastic":  # no dropout: the reference, and a checkpoint after micro-step 4 (a boundary)
    torch.save(run(), out / f"elastic-ref-rank{RANK}.pt")
    run(save=(4,), prefix="elastic")
elif mode == "one":  # a plain model in one process, no process group: twice the window, the same batch
    torch.save(run(resume_from=out / "elastic4", sharded=False, every=2 * EVERY), out / "one.pt")
elif mode == "rundir":
    end_with = sys.argv[5] if len(sys.argv) > 5 else "exit"
    run_directory(sys.argv[3], stop_at=int(sys.argv[4]), end_with=end_with)
elif mode == "signal":
    run_directory(sys.argv[3], signal_at=int(sys.argv[4]))
elif mode == "rundir-resume":
    torch.save(run_directory(sys.argv[3]), out / f"{sys.argv[3]}-rank{RANK}.pt")
else:
    for k in sys.argv[3].split(","):
        torch.save(run(resume_from=out / f"k{k}"), out / f"resumed-{k}-rank{RANK}.pt")
if mode != "one":
    destroy_distributed()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
