"""What the check knows of one script: its syntax tree, parents, loops, names, read from the source alone."""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterator

__all__ = ["Script", "dotted"]


def dotted(node: ast.AST) -> str:
    """``a.b.c`` for a chain of names and attributes (calls and subscripts in it kept as ``()``/``[]``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return f"{dotted(node.func)}()"
    if isinstance(node, ast.Subscript):
        return f"{dotted(node.value)}[]"
    return ""


class Script:
    """A parsed script and the facts the rules share.

    Attributes:
        path: the path as given. source: its text. tree: its ``ast`` module.
        losses: names whose ``.backward()`` is called (``loss`` in ``(loss / 4).backward()``).
        step_loops: the innermost loops that run a backward (directly or through a function they call).
        step_functions: functions with a backward and no loop of their own around it (called per step).

    Raises:
        SyntaxError: the source does not parse (with the file's line).
    """

    def __init__(self, path: str, source: str) -> None:
        self.path, self.source = path, source
        self.tree = ast.parse(source, filename=path)
        self.code = _without_comments(source)  # what has() searches: the code, not what comments say
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        stepping = [c for c in self.calls() if self.method(c) == "backward"]
        self.losses: set[str] = set()
        for c in stepping:  # loss.backward(), (loss / n).backward(), accelerator.backward(loss)
            receiver = c.func.value if isinstance(c.func, ast.Attribute) else c.func
            if c.args and dotted(receiver) in ("accelerator", "self.accelerator", "fabric", "self.fabric"):
                self.losses |= _loss_names(c.args[0])
            else:
                self.losses |= _loss_names(receiver)
        self.step_functions = [
            f for f in ast.walk(self.tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and any(self.inside(c, f) and not self.loops_between(c, f) for c in stepping)
        ]  # fmt: skip
        step_names = {f.name for f in self.step_functions}
        loops = [n for n in ast.walk(self.tree) if isinstance(n, (ast.For, ast.While, ast.AsyncFor))]
        stepping_loops = [
            loop for loop in loops
            if any(self.inside(c, loop) for c in stepping)
            or any(self.inside(c, loop) and dotted(c.func).split(".")[-1] in step_names for c in self.calls())
        ]  # fmt: skip
        self.step_loops = [
            loop for loop in stepping_loops
            if not any(o is not loop and self.inside(o, loop) for o in stepping_loops)
        ]  # fmt: skip
        # Loops over a loader without a backward (evaluation): what they do, they do every batch too.
        self.batch_loops = [
            loop for loop in loops if isinstance(loop, (ast.For, ast.AsyncFor))
            and "loader" in ast.unparse(loop.iter).lower() and loop not in stepping_loops
        ]  # fmt: skip
        self.losses |= self._derived(self.losses)

    # ------------------------------------------------------------------------------------------ queries
    def calls(self) -> Iterator[ast.Call]:
        return (n for n in ast.walk(self.tree) if isinstance(n, ast.Call))

    @staticmethod
    def method(call: ast.Call) -> str:
        """The called name's last part: ``step`` for ``optimizer.step()``."""
        return dotted(call.func).split(".")[-1]

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        while node in self.parent:
            node = self.parent[node]
            yield node

    def inside(self, node: ast.AST, outer: ast.AST) -> bool:
        return any(a is outer for a in self.ancestors(node))

    def loops_between(self, node: ast.AST, outer: ast.AST) -> bool:
        """Whether a loop lies between ``node`` and its ancestor ``outer``."""
        for a in self.ancestors(node):
            if a is outer:
                return False
            if isinstance(a, (ast.For, ast.While, ast.AsyncFor)):
                return True
        return False

    def in_step(self, node: ast.AST) -> bool:
        """Whether ``node`` runs once per step: in a step loop, or in a step function."""
        return any(self.inside(node, r) for r in (*self.step_loops, *self.step_functions))

    def per_batch(self, node: ast.AST) -> bool:
        """Whether ``node`` runs once per batch: per step, in a loop over a loader (evaluation), or in a
        function one of those calls (``get_batch()``)."""
        if self._in_batch_region(node):
            return True
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
        function = next((a for a in self.ancestors(node) if isinstance(a, kinds)), None)
        if function is None or self.loops_between(node, function):
            return False
        return any(self.method(c) == function.name and self._in_batch_region(c) for c in self.calls())

    def _in_batch_region(self, node: ast.AST) -> bool:
        return self.in_step(node) or any(self.inside(node, loop) for loop in self.batch_loops)

    def _derived(self, losses: set[str]) -> set[str]:
        """Names assigned from a loss (``errD = errD_real + errD_fake``) or from a loss function's call
        (``loss = criterion(out, y)``): they hold a graph too."""
        found = set(losses)
        assigns = [n for n in ast.walk(self.tree) if isinstance(n, ast.Assign) and len(n.targets) == 1]
        for _ in range(3):  # a short chain of sums
            for node in assigns:
                target = dotted(node.targets[0])
                if not target or target in found:
                    continue
                names = {dotted(n) for n in ast.walk(node.value) if isinstance(n, (ast.Name, ast.Attribute))}
                called = isinstance(node.value, ast.Call) and any(
                    w in dotted(node.value.func).lower() for w in ("loss", "criterion")
                )
                if called or (names & found and not isinstance(node.value, ast.Call)):
                    found.add(target)
        return found - losses

    def gpu_guarded(self, node: ast.AST) -> bool:
        """Whether ``node`` runs only where CUDA is there (``if torch.cuda.is_available():``, an ``else``
        of a test on it, a conditional expression on it)."""
        for a in self.ancestors(node):
            if isinstance(a, (ast.If, ast.IfExp)) and "cuda" in ast.unparse(a.test):
                return True
        return False

    def in_loop(self, node: ast.AST) -> bool:
        return any(isinstance(a, (ast.For, ast.While, ast.AsyncFor)) for a in self.ancestors(node))

    def in_function_called_in_a_loop(self, node: ast.AST) -> bool:
        """Whether ``node`` is in a function (``def save(...)``) that some loop of the script calls."""
        names = {
            a.name for a in self.ancestors(node) if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        return any(self.method(c) in names and self.in_loop(c) for c in self.calls())

    def periodic(self, node: ast.AST) -> bool:
        """Whether ``node`` sits under an ``if`` that runs every so many steps (``if i % 100 == 0``), or only
        on one rank's logging path: what such a branch costs is paid once in a while."""
        for a in self.ancestors(node):
            if isinstance(a, (ast.For, ast.While, ast.FunctionDef)):
                return False
            if isinstance(a, ast.If):
                test = ast.unparse(a.test).lower()
                if "%" in test or any(
                    w in test for w in ("log", "interval", "every", "print", "eval", "verbose")
                ):
                    return True
        return False

    @property
    def gpu(self) -> bool:
        """Whether the code itself uses CUDA (``torch.cuda...``, ``.cuda()``, a ``"cuda"`` or ``"cuda:N"``
        device, the ``nccl`` backend), not a mention in a comment or a help text."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and dotted(node).startswith("torch.cuda"):
                return True
            if isinstance(node, ast.Call) and self.method(node) == "cuda":
                return True
            text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
            if text is not None and (text == "nccl" or text.split(":")[0] == "cuda"):
                return True
        return False

    def has(self, *words: str) -> bool:
        """Whether any of ``words`` appears in the code (names, attributes, strings; not in comments)."""
        return any(w in self.code for w in words)

    def guarded_by_rank(self, node: ast.AST) -> bool:
        """Whether ``node`` runs under an ``if`` on the rank (``if rank == 0``, ``if master_process``), also
        where every call of the function it is in is (``if args.rank == 0: save_checkpoint(...)``)."""
        words = ("rank", "master", "main_process", "is_main", "local_main", "global_zero", "process_index")
        for a in self.ancestors(node):
            if isinstance(a, ast.If) and any(w in ast.unparse(a.test).lower() for w in words):
                return True
            if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(w in a.name.lower() for w in ("master", "main_process")):
                    return True
                calls = [c for c in self.calls() if self.method(c) == a.name]
                return bool(calls) and all(self.guarded_by_rank(c) for c in calls)
        return False

    def value_of(self, node: ast.expr, at: ast.AST) -> ast.expr:
        """What a name stands for at ``at``: the value last assigned to it before that line, or, for a
        parameter of the function ``at`` is in, the argument its only call passes; else ``node`` itself."""
        if not isinstance(node, ast.Name):
            return node
        line = getattr(at, "lineno", 0)
        assigned = [
            n for n in ast.walk(self.tree) if isinstance(n, ast.Assign) and n.lineno < line
            and any(isinstance(t, ast.Name) and t.id == node.id for t in n.targets)
        ]  # fmt: skip
        if assigned:
            return max(assigned, key=lambda n: n.lineno).value
        for a in self.ancestors(at):
            if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [arg.arg for arg in a.args.args]
                calls = [c for c in self.calls() if self.method(c) == a.name]
                if node.id in names and len(calls) == 1 and names.index(node.id) < len(calls[0].args):
                    return calls[0].args[names.index(node.id)]
                break
        return node


def _loss_names(node: ast.AST) -> set[str]:
    """The loss a ``.backward`` receiver is made of: ``loss`` in ``loss``, ``(loss / n)``,
    ``scaler.scale(loss)``; ``out.loss`` in ``out.loss``."""
    if isinstance(node, (ast.Name, ast.Attribute)):
        name = dotted(node)
        return {name} if name and name not in ("self",) else set()
    if isinstance(node, ast.BinOp):
        return _loss_names(node.left)
    if isinstance(node, ast.Call):
        return {name for a in node.args for name in _loss_names(a)}
    return set()


def _without_comments(source: str) -> str:
    """``source`` with each comment blanked (the rest, lines and columns as they were)."""
    lines = source.splitlines(keepends=True)
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                (row, start), (_, end) = token.start, token.end
                line = lines[row - 1]
                lines[row - 1] = line[:start] + " " * (end - start) + line[end:]
    except (tokenize.TokenError, SyntaxError):
        return source
    return "".join(lines)
