"""The block program: a DenseFormer's blocks, sub-layer by sub-layer, and the depth
connections that form each sub-layer's input, written down once and run by one interpreter.

Index conventions (pretrain/model/dwa_pattern.py): blocks are numbered 1..d, X_0 is the
embedding output, block i maps Y_{i-1} to X_i, and the DWA after block i (if any) is
Y_i = sum_{j in S_i} alpha[i, j] X_j. Inside block i, the attention sub-layer maps Y_{i-1} to
H_i and the MLP sub-layer maps H_i to X_i (pretrain/model/layers.py `Block`).

A program (`StageProgram`) covers blocks first..last: a whole model is the one stage 1..d,
receiving and sending nothing; a pipeline stage (parallel/strategies/stage_state.py chooses what
crosses its boundaries) receives raw X_j and partial sums and sends the same. Its entries:

- `Step`: one layer to run, block i whole (`layer="block"`) or one of its sub-layers
  (`"attention"`, `"mlp"`), and the `Source` of its input. A block runs whole unless a
  connection sits between its sub-layers (no DenseFormer has one today), so that a compiled
  block (`train.compile: blocks`) or a checkpoint unit still wraps the whole Block module.
- `Source`: how an input (or an outgoing tensor) is formed: `x` is X_j itself, `h` is H_i
  (the stream between block i's sub-layers), `dwa` is the DWA after block `index`: the
  received partial sum (if `base`) plus alpha[index, j] X_j for j in `terms`. Any other kind
  names a connection that the connection state forms (see `Connections`).

`ProgramRun` is the interpreter: it runs steps in order, holds the X_j that later sources
read (and drops each after its last reader, `StageProgram.drops`), and leaves the
arithmetic of the connections to a pluggable connection state: buffered or functional DWAs
in training (pretrain/model/dwa.py), the prefill and decoding states of a cached forward
(pretrain/model/dwa_inference.py). Activation checkpointing (parallel/strategies/checkpointing.py)
runs units of consecutive blocks, slices of the same steps, through the same interpreter.
Everything here except `ProgramRun` is plain Python.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from pretrain.model.dwa_pattern import DWAPattern

# How a stage boundary's state is chosen (parallel.pp_transfer): the fewest tensors, or the
# raw X_j (the reference); parallel/strategies/stage_state.py for the DWA,
# pretrain/model/attnres_program.py for Attention Residuals.
TRANSFER_MODES = ("optimal", "raw")


class Item(NamedTuple):
    """One tensor crossing a stage boundary: `("x", j)` is X_j itself; `("sum", c)` is the
    DWA after block c summed over its X_j with j <= the boundary (Y_c when c is the boundary
    block). Attention Residuals (pretrain/model/attnres_program.py) also send `("state", c)`,
    consumer c's softmax-weighted mean over the sources before the boundary, and `("lse",
    n)`, the log-sum-exps of the n states: the one tensor that is per token, not hidden-size.
    MUDD (pretrain/model/mudd_program.py) sends `("mudd_s", i)`, stream s of mix M_i summed
    over its X_j with j <= the boundary (static weights)."""

    kind: Literal["x", "sum", "state", "lse", "mudd_q", "mudd_k", "mudd_v", "mudd_r"]
    index: int

    def __str__(self) -> str:
        if self.kind == "x":
            return f"X_{self.index}"
        if self.kind.startswith("mudd_"):
            return f"M_{self.index}.{self.kind[len('mudd_'):]}"
        return f"lse[{self.index}]" if self.kind == "lse" else f"{self.kind}_{self.index}"


@dataclass(frozen=True)
class Source:
    """How to form one tensor: X_j itself (`kind="x"`), H_i (`"h"`), or for the DWA after
    block `index`, the received partial sum (if `base`) plus alpha[index, j] X_j for j in
    `terms` (X_j received raw or computed here). Another kind is a connection that the
    connection state forms, from the held X_j in `terms` and the live stream."""

    kind: str
    index: int
    base: bool = False
    terms: tuple[int, ...] = ()

    @property
    def alpha_index(self) -> tuple[int, slice]:
        """Where alpha[index, j] for j in `terms` sit in the (d, d + 1) matrix: one strided
        slice of row index - 1 (the terms are a run of one residue class)."""
        step = self.terms[1] - self.terms[0] if len(self.terms) > 1 else 1
        return self.index - 1, slice(self.terms[0], self.terms[-1] + 1, step)


class Step(NamedTuple):
    """Run block `block`'s `layer` on the tensor `input` forms: the whole block (its output
    X_i), its attention sub-layer (H_i) or its MLP sub-layer (X_i, from H_i); or, for a
    connection that reads sub-layer outputs (Attention Residuals), one sub-layer's branch
    without its skip (`attention_branch`, `mlp_branch`), whose output is X_`out`, plus
    X_`residual` when that is set; or, with `write` (Hyper-Connections, whose X_j is an
    n-stream state), the connection state's `write` of the branch output into X_`residual`."""

    block: int
    layer: Literal["block", "attention", "mlp", "attention_branch", "mlp_branch"]
    input: Source
    out: int | None = None
    residual: int | None = None
    write: bool = False

    @property
    def output(self) -> tuple[str, int]:
        if self.out is not None:
            return "x", self.out
        return ("h" if self.layer == "attention" else "x"), self.block


@dataclass(frozen=True)
class StageProgram:
    """Blocks first..last of a d-block model: what the stage receives, the steps it runs,
    and what it sends (or, on the last stage, the model output Y_d)."""

    first: int
    last: int
    n_layers: int
    incoming: tuple[Item, ...]  # empty on the first stage (it starts from the embedding)
    steps: tuple[Step, ...]
    outgoing: tuple[Item, ...]  # empty on the last stage
    outgoing_sources: tuple[Source, ...]  # the Y_d source alone on the last stage

    # Derived once (`__post_init__`), read on every forward.
    sources: tuple[Source, ...] = field(init=False, repr=False, compare=False)
    reads: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    held: frozenset[int] = field(init=False, repr=False, compare=False)
    drops: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    block_steps: Mapping[int, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """The tables: `sources`, every source in the order they are formed (each step's
        input, then the outgoing ones); `reads`, per source the held X_j it reads (a
        connection's terms, and X_j itself for an `x` source that does not take it from
        the stream, the previous step's output); `held`, the X_j some source reads so;
        `drops`, per source the held X_j no later source reads (dropped once it is
        formed); `block_steps[i]`, [start, stop) of block i's steps."""
        sources = tuple(step.input for step in self.steps) + self.outgoing_sources
        # The stream (the latest output) as each source is formed.
        stream = [("x", self.first - 1)] + [step.output for step in self.steps]
        stream += stream[-1:] * (len(self.outgoing_sources) - 1)
        reads = []
        for n, src in enumerate(sources):
            if src.kind == "x":
                reads.append(() if stream[n] == ("x", src.index) else (src.index,))
            else:
                reads.append(() if src.kind == "h" else src.terms)
        last = {j: n for n, js in enumerate(reads) for j in js}
        drops = tuple(tuple(sorted(j for j, n_last in last.items() if n_last == n))
                      for n in range(len(reads)))
        spans: dict[int, tuple[int, int]] = {}
        for n, step in enumerate(self.steps):
            spans[step.block] = (spans.get(step.block, (n, n))[0], n + 1)
        set_ = functools.partial(object.__setattr__, self)  # frozen: set the tables once
        set_("sources", sources)
        set_("reads", tuple(reads))
        set_("held", frozenset(last))
        set_("drops", drops)
        set_("block_steps", MappingProxyType(spans))

    @property
    def is_first(self) -> bool:
        return self.first == 1

    @property
    def is_last(self) -> bool:
        return self.last == self.n_layers

    @property
    def block_inputs(self) -> tuple[Source, ...]:
        """Y_{i-1} for i = first..last: the input of each block's first step."""
        return tuple(self.steps[start].input for start, _ in self.block_steps.values())

    def peak_held(self) -> int:
        """The most X_j the interpreter holds at once (the stage's inputs received first)."""
        held = {item.index for item in self.incoming if item.kind == "x"} & self.held
        if self.is_first:
            held = {0} & self.held
        peak = len(held)
        for n, step in enumerate(self.steps):
            held -= set(self.drops[n])
            kind, j = step.output
            if kind == "x" and j in self.held:
                held.add(j)
                peak = max(peak, len(held))
        return peak

    def dwa_reads(self) -> dict[int, tuple[int, ...]]:
        """{c: the X_j this stage folds into the DWA after block c} (the buffered DWA's
        consumers, pretrain/model/dwa_layout.py)."""
        return {src.index: src.terms for src in self.sources
                if src.kind == "dwa" and src.terms}

    def alpha_entries(self) -> set[tuple[int, int]]:
        """The (c, j) whose alpha[c, j] this stage applies."""
        return {(src.index, j) for src in self.sources if src.kind == "dwa"
                for j in src.terms}


def stage_program(pattern: DWAPattern, first: int, last: int, incoming: tuple[Item, ...] = (),
                  outgoing: tuple[Item, ...] = (),
                  between: Mapping[int, Source] | None = None) -> StageProgram:
    """The program of blocks first..last: check that `incoming` suffices to produce
    `outgoing` (and every block input), and say how; raises ValueError otherwise.
    `between[i]`: a connection that forms the input of block i's MLP sub-layer (the block
    then runs as two steps)."""
    inputs, n_layers = pattern.inputs, pattern.n_layers
    between = between or {}
    b_in = first - 1
    received_x = {item.index for item in incoming if item.kind == "x"}
    received_sums = {item.index for item in incoming if item.kind == "sum"}
    if first == 1:
        received_x = {0}  # X_0: the embedding, computed here

    def x_source(j: int) -> Source:
        if j not in received_x and not first <= j <= last:
            raise ValueError(f"stage {first}..{last} needs X_{j}, which does not reach it")
        return Source("x", j)

    def dwa_source(c: int, upto: int) -> Source:
        base = c in received_sums  # then it already holds every j <= b_in
        terms = tuple(j for j in inputs[c] if j <= upto and not (base and j <= b_in))
        for j in terms:
            x_source(j)
        return Source("dwa", c, base, terms)

    def y_source(i: int) -> Source:  # Y_i, the input of block i + 1
        return dwa_source(i, i) if i in inputs else x_source(i)

    steps: list[Step] = []
    for i in range(first, last + 1):
        if i in between:
            for j in between[i].terms:
                if not j < i:
                    raise ValueError(f"the connection inside block {i} reads X_{j}, which "
                                     "is not made yet")
                x_source(j)
            steps += [Step(i, "attention", y_source(i - 1)), Step(i, "mlp", between[i])]
        else:
            steps.append(Step(i, "block", y_source(i - 1)))
    if last == n_layers:
        if outgoing:
            raise ValueError("the last stage sends nothing")
        sources = (y_source(last),)
    else:
        sources = tuple(x_source(item.index) if item.kind == "x" else dwa_source(item.index, last)
                        for item in outgoing)
    return StageProgram(first, last, n_layers, tuple(incoming), tuple(steps), tuple(outgoing),
                        sources)


def model_program(pattern: DWAPattern) -> StageProgram:
    """The program of a whole model: the one stage 1..d."""
    return stage_program(pattern, 1, pattern.n_layers)


class Connections(Protocol):
    """The state of a pass's depth connections (the interpreter's plug-in).

    `hold(j, x)`: X_j was made (or received); returns the tensor the stream continues with
    and the handle that the sources reading X_j get back (the interpreter keeps it while a
    later source reads X_j). `mix(source, handles, live)`: form `source` (a `dwa` source's
    terms, or a connection kind of the state's) from the handles of the X_j in its terms;
    `live` is the stream's latest output when it is X_{source.index} (a `dwa` source's
    diagonal term) or, for a connection between sub-layers, H_i. `write(step, state, out)`
    (only for a state whose program has `Step.write` steps): X_`step.out` from the state
    X_`step.residual` and the branch output `out`."""

    def hold(self, j: int, x: torch.Tensor) -> tuple[torch.Tensor, object]: ...

    def mix(self, source: Source, handles: list, live: torch.Tensor | None
            ) -> torch.Tensor: ...


class ProgramRun:
    """One execution of a program, or of consecutive slices of its steps (a checkpoint
    unit runs its slice in a run of its own). `block(i)` gives block i's module; `kv[i - 1]`
    block i's KV cache in a cached forward; `call(fn, y)` wraps each layer call (None:
    `fn(y)`)."""

    def __init__(self, program: StageProgram, block: Callable, connections: Connections,
                 kv: list | None = None, call: Callable | None = None):
        self.program, self.block, self.connections = program, block, connections
        self.kv, self.call = kv, call
        self.held: dict[int, object] = {}  # j -> the handle of a held X_j
        self.sums: Mapping = {}  # c -> a received partial sum of the DWA after block c
        self.stream = None  # the latest output, named `at`
        self.at: tuple[str, int] | None = None

    def receive(self, x: Mapping[int, torch.Tensor],
                sums: Mapping[int, torch.Tensor] | None = None) -> None:
        """Start from the received X_j (X_0 on the first stage) and partial sums."""
        for j in sorted(x):
            self.keep(("x", j), x[j])
        self.sums = sums or {}

    def keep(self, output: tuple[str, int], value: torch.Tensor) -> None:
        """A layer's output (or a received X_j) becomes the stream; an X_j is also held."""
        if output[0] == "x":
            value, handle = self.connections.hold(output[1], value)
            if output[1] in self.program.held:
                self.held[output[1]] = handle
        self.stream, self.at = value, output

    def form(self, n: int) -> torch.Tensor:
        """The n-th source of the program (`StageProgram.sources`)."""
        src = self.program.sources[n]
        if src.kind in ("x", "h") and self.at == (src.kind, src.index):
            value = self.stream
        elif src.kind == "x":
            value = self.held[src.index]
        elif src.kind == "dwa" and not src.terms:
            value = self.sums[src.index]
        else:
            live = self.stream if self.at == ("x" if src.kind == "dwa" else "h", src.index) \
                else None
            value = self.connections.mix(src, [self.held[j] for j in src.terms], live)
            if src.base:
                value = self.sums[src.index] + value
        for j in self.program.drops[n]:
            self.held.pop(j, None)
        return value

    def run(self, start: int = 0, stop: int | None = None,
            entry: torch.Tensor | None = None) -> torch.Tensor:
        """Steps [start, stop); `entry`: the first one's input when formed already.
        Returns the last output."""
        steps = self.program.steps
        stop = len(steps) if stop is None else stop
        for n in range(start, stop):
            step = steps[n]
            # Read before `form` drops it: the residual is also a term of the step's input.
            skip = None if step.residual is None else self.value(step.residual)
            y = entry if n == start and entry is not None else self.form(n)
            out = self.layer(step, y)
            if step.write:
                out = self.connections.write(step, skip, out)
            elif skip is not None:
                out = skip + out
            self.keep(step.output, out)
        return self.stream

    def value(self, j: int) -> torch.Tensor:
        """X_j: the stream when it is the latest output, else its held handle."""
        return self.stream if self.at == ("x", j) else self.held[j]

    def skip(self, start: int, stop: int, stream: torch.Tensor,
             produced: Mapping[int, object]) -> None:
        """Steps [start, stop) ran elsewhere (a checkpoint unit) and gave `stream` and the
        handles of the `produced` X_j that later sources read: continue after them."""
        for n in range(start, stop):
            for j in self.program.drops[n]:
                self.held.pop(j, None)
        self.held.update(produced)
        self.stream, self.at = stream, self.program.steps[stop - 1].output

    def layer(self, step: Step, y: torch.Tensor) -> torch.Tensor:
        block = self.block(step.block)
        kv = None if self.kv is None else self.kv[step.block - 1]
        if step.layer == "block":
            fn = block if kv is None else functools.partial(block, kv=kv)
        elif step.layer == "attention":
            fn = functools.partial(block.attention_sublayer, kv=kv)
        elif step.layer == "mlp":
            fn = block.mlp_sublayer
        elif step.layer == "attention_branch":
            fn = functools.partial(block.attention_branch, kv=kv)
        else:
            fn = block.mlp_branch
        return fn(y) if self.call is None else self.call(fn, y)

    def outputs(self) -> tuple[torch.Tensor, ...]:
        """The outgoing tensors (Y_d alone on the last stage)."""
        first = len(self.program.steps)
        return tuple(self.form(n) for n in range(first, first + len(self.program.outgoing_sources)))


def run_program(program: StageProgram, block: Callable, connections: Connections,
                x: Mapping[int, torch.Tensor], sums: Mapping[int, torch.Tensor] | None = None,
                kv: list | None = None, call: Callable | None = None):
    """Execute a whole program: the outgoing tensors (a tuple), or Y_d on the last stage."""
    run = ProgramRun(program, block, connections, kv, call)
    run.receive(x, sums)
    run.run()
    outputs = run.outputs()
    return outputs[0] if program.is_last else outputs
