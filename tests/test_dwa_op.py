"""The DWA custom ops (pretrain/model/dwa_op.py): registered correctly (torch.library's
opcheck: schema, fake and autograd implementations, traced by AOTAutograd) with each
implementation, and a compiled DenseFormer loss that keeps the DWAs (as the op where the
Triton kernels run, traced torch products elsewhere) with no graph break."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from pretrain.model import DenseFormer
from pretrain.model.dwa_op import dwa_sum
from tests.test_model import random_alpha, tiny

IMPLS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.gpu


def op_inputs(m: int, storage: torch.dtype):
    gen = torch.Generator().manual_seed(m)
    xs = [torch.randn(3, 5, 7, generator=gen).to(DEVICE, storage).requires_grad_()
          for _ in range(m)]
    xs[-1] = torch.randn(3, 5, 7, generator=gen).to(DEVICE).requires_grad_()  # live X_i, fp32
    return xs, torch.randn(m, generator=gen).to(DEVICE).requires_grad_()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m,storage", [(1, torch.float32), (5, torch.float32),
                                       (3, torch.bfloat16)])
def test_opcheck(impl, m, storage):
    xs, weights = op_inputs(m, storage)
    torch.library.opcheck(torch.ops.denseformer.dwa_sum.default, (xs, weights, impl))


@pytest.mark.parametrize("impl", IMPLS)
def test_values_and_gradients_equal_the_fp64_sum(impl):
    xs, weights = op_inputs(4, torch.bfloat16)
    y = dwa_sum(xs, weights, impl)
    target = torch.randn_like(y)
    grads = torch.autograd.grad((y * target).sum(), [*xs, weights])
    wide = [x.detach().double() for x in xs]
    want = sum(w * x for w, x in zip(weights.detach().double(), wide, strict=True))
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    for g, x, w in zip(grads, xs, weights.detach(), strict=False):
        assert g.dtype == x.dtype
        torch.testing.assert_close(g, (w * target).to(x.dtype), rtol=2 ** -7, atol=0)
    torch.testing.assert_close(grads[-1].double(), torch.stack(
        [(x * target.double()).sum() for x in wide]), rtol=1e-5, atol=1e-5)


class GraphCounter:
    """A dynamo backend that counts the graphs it is given and runs them as traced."""

    def __init__(self):
        self.graphs, self.ops = 0, []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        self.ops += [node.target for node in gm.graph.nodes if node.op == "call_function"]
        return gm.forward


@pytest.mark.parametrize("dwa_dtype,impl", [("fp32", "torch"), ("bf16", IMPLS[-1])])
def test_the_compiled_model_keeps_the_dwa_ops_with_no_graph_break(dwa_dtype, impl):
    torch._dynamo.reset()
    model = DenseFormer(tiny(6, 2, 1, dwa_dtype=dwa_dtype, dwa_impl=impl), seed=0)
    model.load_dwa_matrix(random_alpha(model, torch.Generator().manual_seed(4)))
    model.to(DEVICE)
    tokens = torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(5))
    tokens = tokens.to(DEVICE)
    # the eager reference runs the same ops (the buffered DWA, which rounds its gradient rows
    # to bf16 too, is compared with them in tests/test_dwa_storage.py)
    logits = model.head(model.run_blocks(model.embed(tokens[:, :-1]), functional=True))
    eager = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    eager.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    counter = GraphCounter()
    compiled = torch.compile(model.loss, backend=counter, fullgraph=True)  # breaks raise
    loss = compiled(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert counter.graphs == 1
    # the op where the kernels run; torch's products traced into the graph elsewhere
    ops = len(model.dwa_pattern.inputs) if impl == "triton" else 0
    assert counter.ops.count(torch.ops.denseformer.dwa_sum.default) == ops
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6, msg=name)
