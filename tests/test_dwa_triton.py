"""The Triton DWA kernels (pretrain/model/dwa_triton.py) against fp64 sums, values and
gradients, for odd sizes, sizes around the kernel's block and group, and both storage
dtypes; without a GPU they run in Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.gpu  # on the GPU machine the kernels compile for the device

from pretrain.model import dwa_triton  # noqa: E402
from pretrain.model.dwa import BufferedDWA  # noqa: E402
from pretrain.model.dwa_impl import TorchOps, dwa_ops, resolve  # noqa: E402
from pretrain.model.dwa_inference import DecodeDWAState  # noqa: E402
from pretrain.model.dwa_pattern import pattern_for_shape  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
STORAGE = (torch.float32, torch.bfloat16)
# (terms, elements): one term; a block exactly; past the group of terms one launch takes
# (two and three launches chained), at sizes that are not a multiple of the block.
SIZES = [(1, 7), (4, dwa_triton.BLOCK), (dwa_triton.GROUP + 1, 1531),
         (2 * dwa_triton.GROUP + 8, 2500)]


def close(got: torch.Tensor, want: torch.Tensor, terms: int) -> None:
    """Within fp32 accumulation's error of the fp64 result (the inputs are exact)."""
    scale = want.abs().max().item() + 1
    torch.testing.assert_close(got.double(), want, rtol=0, atol=4e-7 * (terms + 1) * scale)


def inputs(m: int, n: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    terms = [torch.randn(n, generator=gen).to(DEVICE, dtype) for _ in range(m)]
    weights = torch.randn(m + 1, generator=gen).to(DEVICE)
    vectors = [torch.randn(n, generator=gen).to(DEVICE) for _ in range(3)]
    return terms, weights, vectors


@pytest.mark.parametrize("dtype", STORAGE, ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n", SIZES)
def test_weighted_sum_equals_the_fp64_sum_and_dots(m, n, dtype):
    terms, weights, (live, base, other) = inputs(m, n, dtype, seed=m * 7 + n)
    other = other.to(dtype)
    wide = [t.double() for t in terms]
    w = weights.double()
    out, dots = dwa_triton.weighted_sum(terms, weights[:m])
    close(out, sum(wi * t for wi, t in zip(w, wide, strict=False)), m)
    assert dots is None and out.dtype == torch.float32
    out, dots = dwa_triton.weighted_sum(terms, weights, live=live, base=base, dot_with=other)
    want = base.double() + w[m] * live.double() + sum(
        wi * t for wi, t in zip(w, wide, strict=False))
    close(out, want, m + 2)
    close(dots, torch.stack([t @ other.double() for t in wide]), n)


def test_weighted_sum_of_the_live_term_alone():  # S_c = {c} stored in another dtype
    live, weight = torch.randn(2, 5, 3, device=DEVICE), torch.tensor([0.75], device=DEVICE)
    out, _ = dwa_triton.weighted_sum([], weight, live=live)
    assert torch.equal(out.view(live.shape), live * 0.75)
    with pytest.raises(ValueError, match="2 terms need 2 weights, got 3"):
        dwa_triton.weighted_sum([live, live], torch.ones(3, device=DEVICE))


@pytest.mark.parametrize("dtype", STORAGE, ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n", SIZES[::2] + SIZES[3:])
def test_scaled_copies_are_the_weighted_sums_gradients(m, n, dtype):
    terms, weights, (grad, _, _) = inputs(m, n, dtype, seed=m + n)
    grads, dots = dwa_triton.scaled_copies(terms, weights[:m], grad)
    for g, w, t in zip(grads, weights, terms, strict=False):
        assert g.dtype == dtype and g.shape == t.shape
        # the fp32 product rounded to the storage dtype (within an ulp: the interpreter's
        # bf16 conversion truncates)
        torch.testing.assert_close(g, (w * grad).to(dtype), rtol=torch.finfo(dtype).eps,
                                   atol=0)
    close(dots, torch.stack([t.double() @ grad.double() for t in terms]), n)


def test_dot_products_are_deterministic():
    terms, weights, (grad, _, _) = inputs(5, 3 * dwa_triton.BLOCK + 11, torch.float32, 3)
    first = dwa_triton.scaled_copies(terms, weights[:5], grad)[1]
    assert torch.equal(first, dwa_triton.scaled_copies(terms, weights[:5], grad)[1])


# -- the buffered DWA with model.dwa_impl=triton: a chain of blocks, values and gradients ---

PATTERNS = [  # (d, k, p, window): 1x1, 4x1, 4x5, k > d, a period that skips blocks, Last-K
    (6, 1, 1, None), (12, 4, 1, None), (15, 4, 5, None), (3, 5, 1, None), (7, 3, 2, None),
    (6, 1, 1, 2)]


def run_chain(pattern, alpha, x0, gains, impl: str | None, storage=None):
    """Y_d of blocks X_i = tanh(Y_{i-1}) * gains[i - 1]; the DWAs buffered with `impl`'s
    products or (None) as a naive sum in x0's dtype."""
    dwa = None if impl is None else BufferedDWA(pattern.layout, alpha, x0, storage, impl)
    assert dwa is None or dwa.buffers.ops.name == impl
    xs = {0: dwa.store(0, x0) if dwa else x0}
    y = xs[0]
    for i in range(1, pattern.n_layers + 1):
        x = torch.tanh(y) * gains[i - 1]
        xs[i] = dwa.store(i, x) if dwa else x
        js = pattern.inputs.get(i)
        if js is None:
            y = xs[i]
        elif dwa:
            y = dwa.combine(i, [xs[j] for j in js], live=x)
        else:
            y = sum(alpha[i - 1, j] * xs[j] for j in js)
    return y


def chain_results(pattern, dtype, impl, storage=None, shape=(3, 7, 5)):
    d = pattern.n_layers
    gen = torch.Generator().manual_seed(d * 100 + pattern.dilation * 10 + pattern.period)
    mask = torch.tensor(pattern.mask(), dtype=torch.float64)
    leaves = [torch.randn(d, d + 1, generator=gen, dtype=torch.float64) * mask,
              torch.randn(*shape, generator=gen, dtype=torch.float64),
              1 + 0.1 * torch.randn(d, generator=gen, dtype=torch.float64)]
    alpha, x0, gains = (t.to(DEVICE, dtype).requires_grad_() for t in leaves)
    target = torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    y = run_chain(pattern, alpha, x0, gains, impl, storage)
    return (y, *torch.autograd.grad((y * target).sum(), [alpha, x0, gains]))


@pytest.mark.parametrize("d,k,p,window", PATTERNS)
def test_triton_chain_equals_the_fp64_naive_sum(d, k, p, window):
    pattern = pattern_for_shape(d, k, p, window)
    got = chain_results(pattern, torch.float32, "triton")
    want = chain_results(pattern, torch.float64, None)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("d,k,p,window", PATTERNS[:3])
def test_triton_chain_with_bf16_storage_equals_torch_and_the_naive_sum(d, k, p, window):
    pattern = pattern_for_shape(d, k, p, window)
    got = chain_results(pattern, torch.float32, "triton", torch.bfloat16, (3, 7, 9))
    same_rounding = chain_results(pattern, torch.float32, "torch", torch.bfloat16, (3, 7, 9))
    naive = chain_results(pattern, torch.float64, None, shape=(3, 7, 9))
    for g, t, w in zip(got, same_rounding, naive, strict=True):
        torch.testing.assert_close(g, t, rtol=1e-5, atol=1e-5)  # the same values rounded
        torch.testing.assert_close(g.double(), w, rtol=0.05, atol=0.05)  # bf16's rounding


def test_decoding_with_triton_equals_torch():
    pattern = pattern_for_shape(6, 2, 1)
    like = torch.randn(2, 1, 8, device=DEVICE)
    weights = {i: torch.randn(len(js), device=DEVICE) for i, js in pattern.inputs.items()}
    states = [DecodeDWAState(pattern, weights, like, torch.bfloat16, impl)
              for impl in ("triton", "torch")]
    assert states[0].ops.name == "triton" and isinstance(states[1].ops, TorchOps)
    for j in range(pattern.n_layers + 1):
        x = torch.randn_like(like)
        ys = []
        for state in states:
            state.keep(j, x)
            if pattern.has_dwa(j):
                ys.append(state.combine(j, x))
        if ys:
            torch.testing.assert_close(ys[0], ys[1], rtol=1e-6, atol=1e-6)


def test_the_impl_is_chosen_in_one_place(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve("auto", cpu) == "torch" and isinstance(dwa_ops("auto", cpu), TorchOps)
    assert resolve("torch", torch.device("cuda")) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="model.dwa_impl=triton runs on CUDA devices"):
        resolve("triton", cpu)
    with pytest.raises(ValueError, match="model.dwa_impl must be one of"):
        resolve("cuda", cpu)


# -- model.dwa_impl on the model: every path runs the same products ---------------------------


def model_grads(impl: str, dwa_dtype: str, checkpointing: str, d=6, k=2, p=1):
    from parallel.strategies.checkpointing import apply_activation_checkpointing
    from pretrain.model import DenseFormer
    from tests.test_model import random_alpha, tiny

    model = DenseFormer(tiny(d, k, p, dwa_dtype=dwa_dtype, dwa_impl=impl), seed=0)
    model.load_dwa_matrix(random_alpha(model, torch.Generator().manual_seed(4)))
    model.to(DEVICE)
    apply_activation_checkpointing(model, checkpointing, 2)
    tokens = torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(5))
    tokens = tokens.to(DEVICE)
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("dwa_dtype,checkpointing",
                         [("fp32", "none"), ("bf16", "none"), ("fp32", "dwa_block"),
                          ("bf16", "block")])
def test_the_model_with_triton_equals_torch(dwa_dtype, checkpointing):
    (loss, grads), (want_loss, want) = (model_grads(impl, dwa_dtype, checkpointing)
                                        for impl in ("triton", "torch"))
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_triton_without_triton_names_the_key_and_the_extra(monkeypatch):
    import importlib.util

    from pretrain.model import ModelConfigError
    from tests.test_model import tiny

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else find_spec(name, *a))
    with pytest.raises(ModelConfigError, match=r"model.dwa_impl: triton is not installed: "
                                               r"pip install -e '.\[triton\]'"):
        tiny(4, dwa_impl="triton")
    assert tiny(4, dwa_impl="auto").dwa_impl == "auto"
    with pytest.raises(ModelConfigError, match="model.dwa_impl: must be auto, triton or torch"):
        tiny(4, dwa_impl="cuda")


def test_a_run_may_resume_with_another_dwa_impl():
    import dataclasses

    from pretrain.init_from import model_mismatch
    from pretrain.run_dir import fingerprint, fingerprint_mismatch
    from tests.test_model import tiny

    saved = dataclasses.asdict(tiny(4, dwa_impl="auto"))
    now = dataclasses.asdict(tiny(4, dwa_impl="torch"))
    assert fingerprint_mismatch(fingerprint(saved, "t", 0), fingerprint(now, "t", 0)) == []
    assert model_mismatch(fingerprint(saved, "t", 0)["model"], now) == []
    assert fingerprint_mismatch(fingerprint(saved, "t", 0),
                                fingerprint({**now, "n_layers": 5}, "t", 0)) == [
        "model.n_layers: 4 in the checkpoint, 5 now"]


def test_a_kernel_failing_on_its_first_gpu_run_falls_back_to_torch_once(caplog):
    from pretrain.model.dwa_impl import _FallbackOnce

    class Failing:  # stands in for a kernel that does not compile on the device
        def weighted_list(self, xs, weights):
            raise RuntimeError("ptxas fatal: unsupported\nsecond line")

    xs, weights = [torch.randn(4, 3) for _ in range(3)], torch.randn(3)
    want = TorchOps().weighted_list(xs, weights)
    ops = _FallbackOnce()
    ops.triton = Failing()
    with pytest.raises(RuntimeError, match="ptxas"):  # not on a GPU: raised
        ops._call("weighted_list", torch.device("cpu"), xs, weights)
    with caplog.at_level("WARNING", logger="pretrain.model.dwa_impl"):
        for _ in range(2):
            assert torch.equal(ops._call("weighted_list", torch.device("cuda"), xs, weights),
                               want)
    assert [r.getMessage() for r in caplog.records] == [
        "model.dwa_impl: the Triton DWA kernel weighted_list failed on cuda (RuntimeError: "
        "ptxas fatal: unsupported); using torch"]
    proven = _FallbackOnce()  # a kernel that has run once fails later: raised, no fallback
    proven.proven.add("weighted_list")
    proven.triton = Failing()
    with pytest.raises(RuntimeError, match="ptxas"):
        proven._call("weighted_list", torch.device("cuda"), xs, weights)
