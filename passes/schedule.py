"""Memory-aware schedule for fully_shard: one order for the whole step that bounds what is alive.

The compiler sees the whole step, so it decides when every parameter is gathered, when every
gradient is reduced and when every optimizer update runs. The rule (docs/fully_shard.md):

1. Compute (forward, backward) keeps its traced order.
2. Parameter all-gathers are issued in order of use, each as soon as the gathered parameters
   fetched ahead of their use stay within ``prefetch_cap_mb`` (one is always allowed ahead);
   the backward's gathers wait until the forward has used all of its own. A gather is waited on just before its first use, so a
   gathered parameter lives from there to its last use.
3. A gradient's reduce-scatter (with the pad / division / bucket copy that build its input) is
   issued as soon as the gradient is complete, so the full-size gradient dies then. It is
   waited on when the full-size gradients still being reduced would pass ``reduce_cap_mb``
   with the next one (oldest first), or at its first reader.
4. Every optimizer update that reads reduced gradients runs as soon as everything it reads is
   complete, so a gradient shard dies right after its update. Optimizer state the step
   creates (the first step's ``zeros_like`` of the shards) is made first: it outlives the
   step, so it is allocated before any temporary rather than between them.
5. No node moves across a read or write of the same storage, and a collective reads its input
   until its wait (passes/dependencies.py).
"""

from __future__ import annotations

import torch.fx as fx

from . import meta
from .collectives import c10d
from .subgraph import tensor_bytes
from .dependencies import step_dependencies, views_of
from .memory_plan import alias_source

MB = 2**20
_GRADIENT_COLLECTIVES = (c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)


def schedule_for_memory(gm: fx.GraphModule, *, prefetch_cap_mb: float | None = 16.0,
                        reduce_cap_mb: float | None = 16.0, overlap: bool = True,
                        updates_in_backward: bool = True) -> fx.GraphModule:
    """Order the whole step by the rule above.

    ``prefetch_cap_mb``: bytes of gathered parameters fetched ahead of their use, beyond the
    next one (0 or None: each gather is issued just before its wait). ``reduce_cap_mb``: bytes
    of full-size gradients whose reduce-scatter (or 0-d all_reduce) is issued but not yet
    waited on, beyond the newest (0 or None: each is waited on right after it is issued).
    ``overlap=False`` waits on every collective right after issuing it.
    ``updates_in_backward=False`` leaves the optimizer after the backward (rule 4 off: for a
    backend that cannot compile across an optimizer kernel).

    Reads: collective issue / wait nodes (COLLECTIVE meta, REGION), node.meta["val"], op schemas.
    Writes: node order only.
    """
    graph = gm.graph
    out = _Schedule(graph, int((prefetch_cap_mb or 0) * MB), int((reduce_cap_mb or 0) * MB),
                    overlap, updates_in_backward).order()
    assert len(out) == len(graph.nodes) == len(set(out)), "the schedule must place every node once"
    anchor = None
    for node in out:
        if anchor is not None and anchor.next is not node:
            anchor.append(node)
        anchor = node
    graph.lint()
    gm.recompile()
    return gm


def _wait_of(issue: fx.Node) -> fx.Node | None:
    waits = [u for u in issue.users if u.target is c10d.wait_tensor.default]
    return waits[0] if len(waits) == 1 and len(issue.users) == 1 else None


class _Schedule:
    """The state of one ordering: what each node waits for, what is emitted, what is in flight."""

    def __init__(self, graph: fx.Graph, prefetch_cap: int, reduce_cap: int, overlap: bool,
                 updates_in_backward: bool):
        self.graph, self.prefetch_cap, self.reduce_cap, self.overlap = (
            graph, prefetch_cap, reduce_cap, overlap)
        nodes = self.nodes = list(graph.nodes)
        self.pos = {n: i for i, n in enumerate(nodes)}
        deps = self.deps = step_dependencies(graph)
        users: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
        for n, before in deps.items():
            for d in before:
                users[d].append(n)
        gathers = self.gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default
                                  and n.meta.get(meta.REGION) != meta.Region.OPTIMIZER and _wait_of(n)]
        reductions = self.reductions = [
            n for n in nodes if n.target in _GRADIENT_COLLECTIVES and _wait_of(n)
            and n.meta.get(meta.REGION) == meta.Region.BACKWARD
            and (n.meta.get(meta.COLLECTIVE) or {}).get("params")]
        self.waits = {_wait_of(n): n for n in gathers + reductions}
        optimizer = [n for n in nodes if n.op == "call_function"
                     and n.meta.get(meta.REGION) == meta.Region.OPTIMIZER]
        self.groups = {issue: _with_feeders(issue, deps, users) for issue in gathers + reductions}
        self.deferred = set(self.waits) | set(optimizer) | {n for g in self.groups.values() for n in g}
        after_gradient = _after(nodes, deps, {_wait_of(n) for n in reductions})
        self.updates = [n for n in optimizer if n in after_gradient
                        and n.meta.get(meta.ROLE) is None and updates_in_backward]
        update_groups = {n: _optimizer_closure(n, deps) for n in self.updates}
        self.needs = {n: {d for m in g for d in deps[m]} - g
                      for n, g in {**self.groups, **update_groups}.items()}
        self.sizes = {g: tensor_bytes(_wait_of(g).meta.get("val")) or 0 for g in gathers}  # gathered
        self.sizes.update({r: tensor_bytes(r.args[0].meta.get("val")) or 0 for r in reductions})
        self.forward_gathers = {_wait_of(g) for g in gathers
                                if g.meta.get(meta.REGION) == meta.Region.FORWARD}
        self.out: list[fx.Node] = []
        self.done: set[fx.Node] = set()
        self.ahead = self.unreduced = 0  # bytes gathered ahead of use; full gradients in flight
        self.in_flight: list[fx.Node] = []  # gradient collectives issued, not waited on

    def order(self) -> list[fx.Node]:
        """Every node, in the order the rule gives."""
        for node in self.nodes:
            if node.op == "placeholder":
                self.emit(node)
        for node in _persistent_results(self.graph):
            self.emit(node)
        for node in self.nodes:
            if node in self.done or node in self.deferred or node.op == "output":
                continue
            self.emit(node)
            while self.push():
                pass
        for node in self.nodes:  # what nothing pulled (updates whose results nobody reads), then the output
            self.emit(node)
        return self.out

    def emit(self, node: fx.Node) -> None:
        """Emit ``node`` after whatever it depends on that is not emitted yet (graph order)."""
        done, pending, todo = self.done, set(), [node]
        while todo:
            n = todo.pop()
            if n not in done and n not in pending:
                pending.add(n)
                todo.extend(self.deps[n])
        for n in sorted(pending, key=self.pos.__getitem__):
            if n in done:  # a view emitted with its wait just before
                continue
            done.add(n)
            self.out.append(n)
            self._account(n)
            if n in self.groups and (not self.overlap or (n in self.reductions and not self.reduce_cap)):
                self.emit(_wait_of(n))

    def _account(self, n: fx.Node) -> None:
        """Bytes in flight after emitting ``n``; a wait's views follow it."""
        if n in self.gathers:
            self.ahead += self.sizes[n]
        elif n in self.reductions:
            self.unreduced += self.sizes[n]
            self.in_flight.append(n)
        elif n in self.waits:
            issue = self.waits[n]
            if issue in self.gathers:
                self.ahead -= self.sizes[issue]
            else:
                self.unreduced -= self.sizes[issue]
                self.in_flight.remove(issue)
            for view in views_of(n):  # a bucket's per-parameter slices cost nothing
                if view not in self.done and self.deps[view] <= self.done:
                    self.done.add(view)
                    self.out.append(view)

    def push(self) -> bool:
        """Issue what the rule lets go now; True if anything was emitted."""
        done, needs = self.done, self.needs
        for issue in self.reductions:
            if issue not in done and needs[issue] <= done:
                while self.in_flight and self.unreduced + self.sizes[issue] > self.reduce_cap:
                    self.emit(_wait_of(self.in_flight[0]))
                self.emit(issue)
                return True
        for update in self.updates:
            if update not in done and needs[update] <= done:
                self.emit(update)
                return True
        issue = next((g for g in self.gathers if g not in done), None)
        if (issue is not None and needs[issue] <= done and self.prefetch_cap
                and (self.ahead == 0 or self.ahead + self.sizes[issue] <= self.prefetch_cap)
                and (issue.meta.get(meta.REGION) != meta.Region.BACKWARD
                     or self.forward_gathers <= done)):
            self.emit(issue)
            return True
        return False


def _persistent_results(graph: fx.Graph) -> list[fx.Node]:
    """Tensors the step makes from its inputs alone and returns (the optimizer state a first
    step creates): made first, so these long-lived blocks are allocated before any of the
    step's temporaries and do not end up scattered between them."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    out = []
    for value in output.all_input_nodes:
        while (source := alias_source(value)) is not None:
            value = source
        if value.op == "call_function" and all(a.op == "placeholder" for a in value.all_input_nodes):
            out.append(value)
    return out


def _with_feeders(issue: fx.Node, deps, users) -> set[fx.Node]:
    """The collective ``issue`` and the nodes computed only for it (a bucket's ``cat``, the
    division and padding of a gradient): they move with it."""
    group, todo = {issue}, list(deps[issue])
    while todo:
        n = todo.pop()
        if n in group or n.op != "call_function" or n.meta.get(meta.ROLE) == meta.Role.GRAD:
            continue
        if all(u in group for u in users[n]):
            group.add(n)
            todo.extend(deps[n])
    return group


def _optimizer_closure(update: fx.Node, deps) -> set[fx.Node]:
    """``update`` and the optimizer-region nodes (not collectives) it depends on: they run with it."""
    group, todo = set(), [update]
    while todo:
        n = todo.pop()
        if n in group or n.meta.get(meta.REGION) != meta.Region.OPTIMIZER or n.op != "call_function":
            continue
        if n is not update and n.meta.get(meta.ROLE) == meta.Role.COLLECTIVE:
            continue
        group.add(n)
        todo.extend(deps[n])
    return group


def _after(nodes: list[fx.Node], deps, sources: set[fx.Node]) -> set[fx.Node]:
    """The nodes that depend on one of ``sources`` (graph order is a topological order)."""
    reached = set(sources)
    for n in nodes:
        if n not in reached and any(d in reached for d in deps[n]):
            reached.add(n)
    return reached
