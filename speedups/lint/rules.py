"""The rules of ``python -m speedups.lint``: each reads a :class:`~.script.Script` and yields findings.

Each rule looks for one habit of hand-written loops, in the forms public scripts use, and stays quiet where
the script already does the right thing (a periodic ``.item()`` under ``if step % 100 == 0``, a loss scaled
and unscaled before clipping, a ``torch.save`` under ``if rank == 0``). The line each rule's reasoning rests
on is in its docstring; the tips' pages say the rest.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator

from speedups.lint.finding import Finding
from speedups.lint.script import Script, dotted

__all__ = ["RULES", "findings"]

Rule = Callable[[Script], Iterator[tuple[int, str, str]]]  # (line, topic, message)
_DEVICE_WORDS = ("device", "dev", "gpu", "cuda", "rank")


def _kwargs(call: ast.Call) -> dict[str, ast.expr]:
    return {k.arg: k.value for k in call.keywords if k.arg is not None}


def _const(node: ast.expr | None) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def loaders(s: Script) -> Iterator[tuple[int, str, str]]:
    """Tip 1: a ``DataLoader`` without workers loads each batch between steps, in the training process;
    workers without ``persistent_workers`` start again every epoch; a GPU script's loader without
    ``pin_memory`` copies from pageable memory (no overlap); one built inside a loop starts its workers
    anew each time."""
    gpu = s.gpu
    for call in s.calls():
        if s.method(call) != "DataLoader":
            continue
        kw = _kwargs(call)
        # Given through **kwargs: a setting the script names anywhere may be in them; one it never names, not.
        spread = any(k.arg is None for k in call.keywords)
        named = {k for k in ("num_workers", "persistent_workers", "pin_memory") if spread and s.has(k)}
        problems = []
        workers = kw.get("num_workers")
        if (workers is None and "num_workers" not in named) or _const(workers) == 0:
            problems.append("loads every batch in the training process, between steps (no workers)")
        elif _unset(kw, "persistent_workers", named):
            problems.append("starts its workers again every epoch (no persistent_workers=True)")
        if gpu and _unset(kw, "pin_memory", named):
            problems.append("copies to the GPU from pageable memory (no pin_memory=True)")
        if s.in_loop(call):
            problems.append("is built anew inside a loop, its workers and sampler started over each time")
        if problems:
            yield (call.lineno, "1", f"this DataLoader {'; '.join(problems)}: write fast_loader(dataset, "
                   f"batch_size, shuffle=...) once, before the loop (workers for this process's CPUs, pinned "
                   f"on a GPU, persistent, seeded)")  # fmt: skip


def _unset(kw: dict[str, ast.expr], name: str, named: set[str]) -> bool:
    """Whether keyword ``name`` is left out or ``False`` (an expression, ``pin_memory=use_cuda``, is set)."""
    value = kw.get(name)
    return (value is None and name not in named) or _const(value) is False


def host_syncs(s: Script) -> Iterator[tuple[int, str, str]]:
    """Tip 5: ``.item()``, ``.cpu()``, ``.numpy()``, ``float(loss)`` or ``print(loss)`` every step waits for
    the device (a host-device sync per step); a list that appends the loss keeps every step's graph alive."""
    for call in s.calls():
        keeps_graph = s.method(call) == "append" and call.args and dotted(call.args[0]) in s.losses
        if not s.per_batch(call) or (s.periodic(call) and not keeps_graph):
            continue  # a sync every N steps costs little; a graph kept every N steps still adds up
        name, args = s.method(call), call.args
        every = "step" if s.in_step(call) else "batch"
        receiver = dotted(call.func.value) if isinstance(call.func, ast.Attribute) else ""
        if name in ("item", "cpu", "numpy", "tolist") and not call.args:
            if name == "cpu" and not any(w in receiver for w in ("loss", "out", "pred", "logit", "acc")):
                continue  # .cpu() of other things (a batch for a metric library) is not the loss's sync
            yield (
                call.lineno,
                "5",
                f".{name}() waits for the device every {every} (a host-device sync): tracker = "
                f"LossTracker(); tracker.update(loss) keeps it on the device, read once per epoch (a metric: "
                f"sum it on the device, read it after the loop)",
            )
        elif name == "float" and args and dotted(args[0]) in s.losses:
            yield (
                call.lineno,
                "5",
                f"float({dotted(args[0])}) waits for the device every step: "
                f"tracker.update({dotted(args[0])}) keeps it on the device, read once per epoch",
            )
        elif name == "print" and any(dotted(a) in s.losses or _formats_a_loss(a, s) for a in args):
            yield (
                call.lineno,
                "5",
                "printing the loss waits for the device every step: print it every N "
                "steps, or tracker.update(loss) and print tracker.end_epoch()",
            )
        elif name == "append" and args and dotted(args[0]) in s.losses:
            yield (
                call.lineno,
                "5",
                f"appending {dotted(args[0])} keeps every step's autograd graph alive "
                f"(memory grows each step): tracker.update({dotted(args[0])}) keeps a detached sum",
            )


def _formats_a_loss(node: ast.expr, s: Script) -> bool:
    if isinstance(node, ast.JoinedStr):
        return any(isinstance(v, ast.FormattedValue) and dotted(v.value) in s.losses for v in node.values)
    return False


def accumulation(s: Script) -> Iterator[tuple[int, str, str]]:
    """Tip 4: accumulation written by hand (the loss divided by N, ``optimizer.step()`` every N calls): under
    DDP without ``no_sync`` every micro-step all-reduces; ``if (i + 1) % N == 0`` drops (or carries into the
    next epoch) the epoch's last short window."""
    divided = [n for n in ast.walk(s.tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)
               and dotted(n.left) in s.losses and s.in_step(n)]  # fmt: skip
    if not divided:
        return
    ddp = s.has("DistributedDataParallel", "DDP(")
    no_sync, flag = s.has("no_sync"), s.has("require_backward_grad_sync")
    for node in ast.walk(s.tree):
        if not (isinstance(node, ast.If) and "%" in ast.unparse(node.test)):
            continue
        steps = [c for c in ast.walk(node) if isinstance(c, ast.Call) and s.method(c) == "step"
                 and "sched" not in dotted(c.func)]  # fmt: skip
        if not steps:
            continue
        bugs = []
        if ddp and not (no_sync or flag):
            bugs.append("under DDP every micro-step all-reduces (no no_sync())")
        if not re.search(r"len\(|last|end|final", ast.unparse(node.test)):
            bugs.append("the epoch's last short window is dropped or carried into the next epoch")
        if not bugs and not flag:
            return  # written right: no_sync where DDP is, the short window applied
        said = f" ({'; '.join(bugs)})" if bugs else " (no_sync through DDP's private flag)"
        yield (node.lineno, "4", f"accumulation by hand{said}: @accumulate(N, optimizer) on a function "
               f"returning the loss divides it, steps every N calls, applies the short last window and skips "
               f"DDP's all-reduce between boundaries")  # fmt: skip
        return
    if ddp and no_sync:
        return  # micro-steps in a loop of their own, DDP's no_sync around them: written right
    first = min(divided, key=lambda n: n.lineno)
    how = (
        " (no_sync through DDP's private require_backward_grad_sync)" if flag
        else " (under DDP every micro-step all-reduces: no no_sync())" if ddp else ""
    )  # fmt: skip
    yield (first.lineno, "4", f"accumulation by hand{how}: @accumulate(N, optimizer) on a function returning "
           f"the loss is the same in one line, the short last window and DDP's no_sync included")  # fmt: skip


def device_copies(s: Script) -> Iterator[tuple[int, str, str]]:
    """Tip 6: a ``.to(device)`` per tensor in the step copies synchronously from pageable memory; a hard-coded
    ``"cuda"`` fails without CUDA and puts every rank on GPU 0."""
    lines: set[int] = set()
    for call in s.calls():
        if not s.per_batch(call) or call.lineno in lines:
            continue
        name = s.method(call)
        receiver = dotted(call.func.value) if isinstance(call.func, ast.Attribute) else ""
        if any(w in receiver.lower() for w in ("model", "net", "self", "module")):
            continue
        moves = name == "cuda" or (name == "to" and call.args and _names_a_device(call.args[0]))
        if name == "type" and call.args:  # .type(torch.cuda.FloatTensor), also through a name for it
            moves = "cuda" in ast.unparse(s.value_of(call.args[0], call)).lower()
        if moves and _const(_kwargs(call).get("non_blocking")) is not True:
            lines.add(call.lineno)
            what = receiver if receiver.isidentifier() else "batch"
            write = "x, y = to_device((x, y))" if _paired(s, call) else f"{what} = to_device({what})"
            yield (call.lineno, "6", f"a synchronous copy per tensor from pageable memory: {write} moves any "
                   f"nesting (tuples, dicts), non-blocking from the loader's pinned memory")  # fmt: skip
    for call in s.calls():
        one = dotted(call.func) in ("torch.device", "device") and len(call.args) == 1
        if one and _is_cuda(call.args[0]) and not s.gpu_guarded(call):
            yield (
                call.lineno,
                "6",
                "a hard-coded CUDA device fails on a machine without one: device = resolve_device(None) "
                "(cuda:LOCAL_RANK under torchrun, else cuda, else mps, else cpu)",
            )


def _paired(s: Script, call: ast.Call) -> bool:
    """Whether ``call`` is one of several copies on the right of one assignment (``x, y = ...``)."""
    parent = s.parent.get(call)
    return isinstance(parent, ast.Tuple) and isinstance(s.parent.get(parent), ast.Assign)


def _names_a_device(node: ast.expr) -> bool:
    text = ast.unparse(node).lower()
    return _is_cuda(node) or any(w in text for w in _DEVICE_WORDS)


def _is_cuda(node: ast.expr) -> bool:
    value = _const(node)
    return isinstance(value, str) and value.split(":")[0] == "cuda"


def precision(s: Script) -> Iterator[tuple[int, str, str]]:
    """Tip 7: fp32 training where bf16/fp16 autocast runs the matrix products several times faster; a
    GradScaler's gradients clipped before ``unscale_`` (the threshold meets gradients times the scale);
    ``model.half()`` (fp16 weights lose small updates, and nothing scales the loss)."""
    mixed = s.has("autocast", "mixed_precision", "bf16-mixed", "16-mixed", "mixed_precision=")
    backwards = sorted((c for c in s.calls() if s.method(c) == "backward"), key=lambda c: c.lineno)
    if backwards and not mixed and not s.has(".half()", "bfloat16"):
        yield (backwards[0].lineno, "7", "trains in fp32: on a GPU (or a CPU with AVX-512 BF16/AMX: "
               "python -m speedups.doctor) bf16 autocast runs the matrix products several times faster: "
               "`with mixed_precision():` around the forward and loss (fp16 with loss scaling where bf16 is "
               "missing)")  # fmt: skip
    if s.has("GradScaler"):
        unscaled = [c.lineno for c in s.calls() if s.method(c) == "unscale_"]
        for call in s.calls():  # no unscale_, or only after the clip
            if s.method(call) in ("clip_grad_norm_", "clip_grad_value_") and not any(
                line < call.lineno for line in unscaled
            ):
                yield (call.lineno, "7", "clips the scaled gradients (GradScaler, no "
                       "scaler.unscale_(optimizer) before): the threshold meets gradients times the loss "
                       "scale; @accumulate(..., max_grad_norm=) with mixed_precision('fp16') unscales "
                       "first")  # fmt: skip
    for call in s.calls():
        if dotted(call.func) in ("torch.cuda.amp.GradScaler", "torch.cuda.amp.autocast"):
            new = f"torch.amp.{s.method(call)}('cuda')"
            yield (call.lineno, "7", f"{dotted(call.func)} is deprecated ({new}): "
                   f"mixed_precision('fp16') makes the autocast and the GradScaler, and unscales before "
                   f"clipping")  # fmt: skip
    for call in s.calls():
        receiver = dotted(call.func.value) if isinstance(call.func, ast.Attribute) else ""
        if s.method(call) == "half" and any(w in receiver.lower() for w in ("model", "net", "module")):
            yield (
                call.lineno,
                "7",
                "fp16 weights: updates below fp16's resolution vanish and nothing scales "
                "the loss: keep fp32 weights and autocast the forward (mixed_precision('fp16'))",
            )


def parallel(s: Script) -> Iterator[tuple[int, str, str]]:
    """Tips 8 and 9: ``nn.DataParallel`` drives every GPU from one process (threads under the GIL, the model
    copied to each GPU every step); a ``DistributedSampler`` without ``set_epoch`` shuffles every epoch
    alike; layers moved to ``"cuda:1"`` by hand copy activations at each seam unchecked."""
    for call in s.calls():
        name = s.method(call)
        if name == "DataParallel":
            yield (
                call.lineno,
                "9",
                "one process drives every GPU (threads under the GIL, the model copied to "
                "each GPU every step): model = ddp_wrap(model), launched with torchrun",
            )
        elif name == "DistributedSampler" and not s.has("set_epoch") and _shuffles(call):
            yield (
                call.lineno,
                "9",
                "shuffles every epoch the same way (no sampler.set_epoch(epoch)): "
                "loader = distributed(loader) advances the epoch itself, and saves its position",
            )
        elif name == "to" and call.args and re.fullmatch(r"cuda:[1-9]\d*", str(_const(call.args[0]))):
            yield (
                call.lineno,
                "8",
                f"places layers on a GPU by hand (.to({_const(call.args[0])!r})): "
                f"shard_model(model, {{'encoder': 0, 'decoder': 1}}) moves each part and its inputs, checked",
            )


def _shuffles(call: ast.Call) -> bool:
    """Whether a sampler shuffles (its default): ``shuffle=False`` draws nothing per epoch."""
    return _const(_kwargs(call).get("shuffle")) is not False


def checkpoints(s: Script) -> Iterator[tuple[int, str, str]]:
    """Checkpoints: ``torch.save`` on every rank writes one file from all ranks at once; weights alone (no
    optimizer), or no data position and RNG states, resume a different run."""
    ddp = s.has("DistributedDataParallel", "DDP(", "init_process_group")
    for call in s.calls():
        if dotted(call.func) != "torch.save" or not call.args:
            continue
        what = s.value_of(call.args[0], call)
        if ddp and not s.guarded_by_rank(call):
            yield (
                call.lineno,
                "checkpoints",
                "every rank writes the same file at once: save_checkpoint(path, "
                "model=..., optimizer=...) on every rank writes once, from rank 0, with each rank's state",
            )
            continue
        if not (
            isinstance(what, ast.Dict) or (isinstance(what, ast.Call) and s.method(what) == "state_dict")
        ):
            continue  # a variable: what it holds is not known here
        if not s.in_loop(call) and not s.in_function_called_in_a_loop(call):
            continue  # once, after training: an export of the result, not a checkpoint to resume from
        text = ast.unparse(what).lower()
        missing = [label for label, words in (
            ("the optimizer", ("optim",)),
            ("the data position", ("loader", "sampler", "iter", "step", "batch", "epoch")),
            ("the GradScaler's scale", ("scaler",) if s.has("GradScaler") else ("",)),
            ("the RNG states", ("rng", "random", "generator", "seed")),
        ) if not any(w in text for w in words)]  # fmt: skip
        if missing:
            yield (call.lineno, "checkpoints", f"the checkpoint lacks {', '.join(missing)}: a resumed run "
                   f"is another run; save_checkpoint(path, model=model, optimizer=optimizer, loader=loader, "
                   f"step=...) resumes bit for bit")  # fmt: skip


def compiling(s: Script) -> Iterator[tuple[int, str, str]]:
    """``fast_kernels``: a fixed-shape conv net on a GPU without ``cudnn.benchmark`` (cuDNN's algorithm by
    heuristic); ``compile_blocks``: ``torch.compile`` of a whole model whose blocks repeat (compile time
    grows with depth)."""
    convs = [c for c in s.calls() if s.method(c) in ("Conv2d", "Conv3d")]
    if convs and s.gpu and not s.has("cudnn.benchmark", "fast_kernels"):
        yield (_built(s, convs[0]), "fast_kernels", "cuDNN picks convolution algorithms by heuristic "
               "(cudnn.benchmark off): fast_kernels(model) times them for the fixed input shape and uses "
               "channels_last")  # fmt: skip
    repeats = re.search(r"(\w+)\s*=\s*(?:nn\.)?ModuleList\(\s*\[[^\]]*for\s+\w+\s+in\s+range", s.source)
    for call in s.calls():
        if dotted(call.func) == "torch.compile" and repeats:
            yield (
                call.lineno,
                "compile_blocks",
                f"compiles the whole model, each repeated block traced "
                f"again: compile_blocks(model, '{repeats.group(1)}.*') compiles one block once (faster "
                f"start-up; measure the step, whole-model compile can be a few % faster per step)",
            )


def _built(s: Script, node: ast.AST) -> int:
    """The line where the model holding ``node`` is built (``model = Net()``), else ``node``'s own line."""
    owner = next((a for a in s.ancestors(node) if isinstance(a, ast.ClassDef)), None)
    if owner is not None:
        made = [c.lineno for c in s.calls() if s.method(c) == owner.name]
        if made:
            return min(made)
    return node.lineno  # type: ignore[attr-defined]


def frameworks(s: Script) -> Iterator[tuple[int, str, str]]:
    """Migration: a loop run through Accelerate's or Fabric's object takes each tip from that object, and
    two of its habits turn wrong in a ported loop: the schedule multiplied by ``num_processes`` (a prepared
    scheduler steps once per process), ``save_state`` on the main process alone."""
    for node in ast.walk(s.tree):
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Mult)
            and "num_processes" in ast.unparse(node)
        ):
            yield (node.lineno, "migration", "the schedule multiplied by num_processes (Accelerate steps a "
                   "prepared scheduler once per process): @accumulate(..., scheduler=) steps it once per "
                   "optimizer step, "
                   "so a ported loop drops the factor")  # fmt: skip
    for call in s.calls():
        if s.method(call) == "save_state" and s.guarded_by_rank(call):
            yield (call.lineno, "checkpoints", "save_state on the main process alone: save_checkpoint(path, "
                   "model=..., optimizer=..., loader=..., step=...) on every rank writes once, from rank 0, "
                   "with every rank's RNG states and the loader's position")  # fmt: skip
    for call in s.calls():
        if s.method(call) in ("Accelerator", "Fabric"):
            yield (
                call.lineno,
                "migration",
                f"the loop runs through {s.method(call)}: each of its calls has a "
                f"speedups piece that keeps the loop yours (prepare -> ddp_wrap/distributed, backward and "
                f"accumulate -> @accumulate, autocast -> mixed_precision)",
            )


RULES: tuple[Rule, ...] = (loaders, host_syncs, accumulation, device_copies, precision, parallel, checkpoints,
                           compiling, frameworks)  # fmt: skip
"""Every rule, in the order their findings are listed for one line."""


def findings(script: Script) -> list[Finding]:
    """Every rule's findings for ``script``, one per line and topic, in line order."""
    seen: dict[tuple[int, str], Finding] = {}
    for rule in RULES:
        for line, topic, message in rule(script):
            seen.setdefault((line, topic), Finding(script.path, line, topic, message))
    return sorted(seen.values(), key=lambda f: (f.line, f.topic))
