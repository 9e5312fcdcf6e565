"""The block program (pretrain/model/program.py): its entries, the interpreter with every
connection state against a naive fp64 loop, stage slices against the whole program, the
Block's sub-layers, and a connection between sub-layers (a kind that exists only here)."""

import random

import pytest
import torch

from parallel.strategies.stage_state import stage_programs
from pretrain.model.dwa import BufferedDWA, FunctionalDWA
from pretrain.model.dwa_inference import DecodeDWAState, PrefillDWAState
from pretrain.model.dwa_layout import buffer_layout
from pretrain.model.dwa_pattern import pattern_for_shape
from pretrain.model.program import (
    ProgramRun,
    Source,
    Step,
    model_program,
    run_program,
    stage_program,
)

PATTERNS = [  # (d, k, p, window)
    (6, 1, 1, None), (12, 4, 1, None), (15, 4, 5, None), (7, 3, 2, None), (6, 1, 1, 2),
    (5, 1, 5, None), (4, 1, None, None),
]


class ToyBlock(torch.nn.Module):
    """A block with the sub-layer entry points of pretrain/model/layers.py `Block`:
    H = Y + tanh(Y) a, X = H + sin(H) b, elementwise, so a test runs in fp64 in no time."""

    def __init__(self, gen: torch.Generator, width: int):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(width, generator=gen, dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.randn(width, generator=gen, dtype=torch.float64))

    def attention_sublayer(self, y, kv=None):
        return y + torch.tanh(y) * self.a

    def mlp_sublayer(self, h):
        return h + torch.sin(h) * self.b

    def forward(self, y, kv=None):
        return self.mlp_sublayer(self.attention_sublayer(y, kv))


def toy_model(d: int, k: int, p: int | None, window: int | None, seed: int = 0):
    pattern = pattern_for_shape(d, k, p, window)
    gen = torch.Generator().manual_seed(seed)
    blocks = [ToyBlock(gen, 3) for _ in range(d)]
    mask = torch.tensor(pattern.mask(), dtype=torch.float64)
    alpha = (torch.randn(d, d + 1, generator=gen, dtype=torch.float64) * mask).requires_grad_()
    x0 = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    return pattern, blocks, alpha, x0


def naive(pattern, blocks, alpha, x0, inside=None):
    """Y_d by the definition (docs/design.md): X_i = block_i(Y_{i-1}), Y_i the DWA after
    block i or X_i; `inside(i, h, xs)` replaces the MLP sub-layer's input of block i."""
    xs, y = [x0], x0
    for i, block in enumerate(blocks, start=1):
        h = block.attention_sublayer(y)
        xs.append(block.mlp_sublayer(h if inside is None else inside(i, h, xs)))
        js = pattern.inputs.get(i)
        y = xs[i] if js is None else sum(alpha[i - 1, j] * xs[j] for j in js)
    return y


def connections(kind: str, pattern, alpha, like):
    weights = {i: alpha[i - 1, list(js)].detach() for i, js in pattern.inputs.items()}
    if kind == "buffered":
        return BufferedDWA(pattern.layout, alpha, like)
    if kind == "functional":
        return FunctionalDWA(alpha)
    if kind == "prefill":
        return PrefillDWAState(pattern, {i: w.tolist() for i, w in weights.items()})
    return DecodeDWAState(pattern, weights, like, impl="torch")


@pytest.mark.parametrize("d,k,p,window", PATTERNS)
@pytest.mark.parametrize("kind", ["buffered", "functional", "prefill", "decode"])
def test_interpreter_with_each_connection_state_equals_the_naive_loop(d, k, p, window, kind):
    pattern, blocks, alpha, x0 = toy_model(d, k, p, window)
    if kind == "decode":  # one token per sequence, as a decoding step
        x0 = x0[:, -1:].detach().clone().requires_grad_()
    want = naive(pattern, blocks, alpha, x0)
    program = model_program(pattern)
    got = run_program(program, lambda i: blocks[i - 1], connections(kind, pattern, alpha, x0),
                      {0: x0})
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if kind in ("buffered", "functional"):  # training states: the gradients too
        target = torch.randn_like(want)
        params = [alpha, x0, *(q for b in blocks for q in b.parameters())]
        got_grads = torch.autograd.grad((got * target).sum(), params, allow_unused=True)
        want_grads = torch.autograd.grad((want * target).sum(), params, allow_unused=True)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)  # None: no DWA


def test_whole_model_program_runs_every_block_whole_in_order():
    pattern = pattern_for_shape(15, 4, 5)
    program = model_program(pattern)
    assert (program.first, program.last, program.incoming, program.outgoing) == (1, 15, (), ())
    assert [(s.block, s.layer) for s in program.steps] == [(i, "block") for i in range(1, 16)]
    assert program.steps[5].input == Source("dwa", 5, False, (1, 5))  # Y_5, input of block 6
    assert program.steps[1].input == Source("x", 1)  # no DWA after block 1
    assert program.outgoing_sources == (Source("dwa", 15, False, (3, 7, 11, 15)),)
    # X_j is held from its block to its last reader (the DWA after block 15 for X_15).
    assert program.held == frozenset(pattern.stored)
    assert program.drops[5] == (1, 5)  # S_5 is read by the DWA after block 5 alone
    assert program.drops[-1] == (3, 7, 11, 15)


@pytest.mark.parametrize("d,k,p,window", PATTERNS[:-1])
@pytest.mark.parametrize("mode", ["raw", "optimal"])
def test_stage_slices_concatenated_are_the_whole_program(d, k, p, window, mode):
    """The stages of any split run the whole program's blocks in order, apply each alpha
    once between them, and chained by hand give the whole model's Y_d (buffered and
    functional)."""
    pattern, blocks, alpha, x0 = toy_model(d, k, p, window, seed=d)
    whole = model_program(pattern)
    want = run_program(whole, lambda i: blocks[i - 1], FunctionalDWA(alpha), {0: x0})
    rng = random.Random(d * 10 + k)
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, d), 2))
        stages = list(zip([1] + [c + 1 for c in cuts], cuts + [d], strict=True))
        programs = stage_programs(pattern, stages, mode)
        assert [s[:2] for p_ in programs for s in p_.steps] == \
            [s[:2] for s in whole.steps]
        applied = [e for p_ in programs for e in p_.alpha_entries()]
        assert sorted(applied) == sorted(whole.alpha_entries())  # each exactly once
        for buffered in (True, False):
            x, sums = {0: x0}, {}
            for program in programs:
                state = BufferedDWA(buffer_layout(program.dwa_reads(), k), alpha, x0) \
                    if buffered and program.dwa_reads() else FunctionalDWA(alpha)
                out = run_program(program, lambda i: blocks[i - 1], state, x, sums)
                if program.is_last:
                    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
                    break
                x = {it.index: t for it, t in zip(program.outgoing, out, strict=True)
                     if it.kind == "x"}
                sums = {it.index: t for it, t in zip(program.outgoing, out, strict=True)
                        if it.kind == "sum"}


# -- a connection between sub-layers: a kind that exists only in this file -------------------


class InsideMix(FunctionalDWA):
    """The DWAs, plus a connection kind "inside": the MLP sub-layer of block i reads
    H_i + 0.5 X_j for the j in its terms (a stand-in for a future sub-layer connection)."""

    def mix(self, source, handles, live):
        if source.kind != "inside":
            return super().mix(source, handles, live)
        return live + 0.5 * sum(handles)


def inside_program(pattern, reads: dict[int, tuple[int, ...]]):
    between = {i: Source("inside", i, terms=js) for i, js in reads.items()}
    return stage_program(pattern, 1, pattern.n_layers, between=between)


def test_a_connection_between_sub_layers_runs_them_separately():
    pattern, blocks, alpha, x0 = toy_model(7, 3, 2, None)
    reads = {3: (0,), 6: (1, 2)}
    program = inside_program(pattern, reads)
    assert [(s.block, s.layer) for s in program.steps if s.block in (3, 4)] == \
        [(3, "attention"), (3, "mlp"), (4, "block")]
    assert program.steps[3] == Step(3, "mlp", Source("inside", 3, terms=(0,)))
    assert program.block_steps[3] == (2, 4) and program.block_inputs[3].index == 3
    # X_2 is held until the connection in block 6 (its last DWA reader is block 2's).
    assert program.held == frozenset(pattern.stored) and program.drops[7] == (1, 2)
    called = []
    for i, block in enumerate(blocks, start=1):
        block.register_forward_hook(lambda *_, i=i: called.append(i))

    def inside(i, h, xs):
        return h + 0.5 * sum(xs[j] for j in reads[i]) if i in reads else h

    want = naive(pattern, blocks, alpha, x0, inside)
    got = run_program(program, lambda i: blocks[i - 1], InsideMix(alpha), {0: x0})
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert called == [1, 2, 4, 5, 7]  # blocks 3 and 6 ran as two sub-layers, not whole
    # The interpreter holds what the program says, and no more.
    run = ProgramRun(program, lambda i: blocks[i - 1], InsideMix(alpha))
    run.receive({0: x0})
    peak = 0
    for n in range(len(program.steps)):
        run.run(n, n + 1)
        peak = max(peak, len(run.held))
    assert peak == program.peak_held() > model_program(pattern).peak_held()


def test_a_connection_inside_a_block_must_read_earlier_outputs():
    pattern = pattern_for_shape(4, 1, 1)
    with pytest.raises(ValueError, match="X_3"):
        inside_program(pattern, {3: (3,)})


@pytest.mark.parametrize("mode,every", [("block", 1), ("block", 2), ("dwa_block", 2)])
def test_checkpoint_units_are_slices_of_a_sub_layer_program(mode, every):
    """A DenseFormer whose program has a connection inside blocks: checkpointed units run
    those sub-layers too and give the loss and gradients of the plain run."""
    from parallel.strategies.checkpointing import apply_activation_checkpointing
    from pretrain.model import DenseFormer, DenseFormerConfig

    model = DenseFormer(DenseFormerConfig(n_layers=5, d_model=16, n_heads=2, vocab_size=64,
                                          seq_len=8, dwa_dilation=2, dwa_period=2,
                                          dropout=0.1), seed=1)
    model.program = inside_program(model.dwa_pattern, {2: (0,), 5: (1, 3)})
    model.training_connections = lambda like, functional: InsideMix(
        model.dwa_alpha, None, model.config.dwa_impl)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    results = []
    for m in ("none", mode):
        apply_activation_checkpointing(model, m, every)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)  # dropout
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), {n: q.grad.clone() for n, q in model.named_parameters()}))
    (loss_none, grads_none), (loss_ckpt, grads_ckpt) = results
    assert torch.equal(loss_none, loss_ckpt)
    for name, grad in grads_none.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("skip_gains,block", [(False, "gpt"), (True, "llama")])
def test_block_sub_layers_compose_to_the_block_bit_for_bit(skip_gains, block):
    from pretrain.model import DenseFormer, DenseFormerConfig

    model = DenseFormer(DenseFormerConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=64,
                                          seq_len=8, dropout=0.1, skip_gains=skip_gains,
                                          dwa=not skip_gains,
                                          block=block), seed=4)
    layer = model.block(1)
    y = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(5))
    for train in (False, True):
        layer.train(train)
        torch.manual_seed(6)
        whole = layer(y)
        torch.manual_seed(6)
        parts = layer.mlp_sublayer(layer.attention_sublayer(y))
        assert torch.equal(whole, parts)


def test_a_stage_model_of_the_whole_program_is_the_model():
    """StageModel over the one stage 1..d holds DenseFormer's parameters under the same
    names, shares its code (no method borrowed), and gives its loss."""
    from parallel.strategies.stage_model import StageModel, StageModule
    from pretrain.model import DenseFormer, DenseFormerConfig

    cfg = DenseFormerConfig(n_layers=5, d_model=16, n_heads=2, vocab_size=64, seq_len=8,
                            dwa_dilation=2, dwa_period=2, tie_embeddings=False)
    model = DenseFormer(cfg, seed=7)
    stage = StageModel(cfg, [model_program(cfg.dwa_pattern)], seed=7)
    ours, theirs = dict(stage.named_parameters()), dict(model.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    assert stage.num_params() == model.num_params()
    assert stage.num_params(non_embedding=True) == model.num_params(non_embedding=True)
    assert torch.equal(stage.dwa_matrix(), model.dwa_matrix())
    for name in ("embed", "head_loss", "num_params", "dwa_matrix", "load_dwa_matrix"):
        assert vars(StageModel)[name] is not vars(DenseFormer).get(name), name
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(8))
    h, weight = StageModule(stage, stage.programs[0])(tokens[:, :-1])
    torch.testing.assert_close(stage.head_loss(h, weight, tokens[:, 1:]),
                               model.loss(tokens[:, :-1], tokens[:, 1:]), rtol=0, atol=0)
