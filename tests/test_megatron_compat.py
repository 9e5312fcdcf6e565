"""Each megatron-core workaround in parallel/primitives/megatron_compat.py still matches the
library."""

import warnings

import torch

from parallel.primitives import groups


def test_default_tp_group_lookup_still_warns_in_megatron():
    """If megatron stops warning (or stops passing tp_group=None), drop the patch."""
    import inspect

    from megatron.core import utils
    from megatron.core.tensor_parallel import layers

    groups.ensure_initialized()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        utils.get_tensor_model_parallel_group_if_none(None)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    assert "tp_group=None" in inspect.getsource(layers.RowParallelLinear.forward)


def test_patched_row_parallel_linear_is_silent_and_correct():
    from megatron.core.tensor_parallel import RowParallelLinear

    from pretrain.model.denseformer import megatron_config

    groups.ensure_initialized()
    layer = RowParallelLinear(8, 4, config=megatron_config(1), init_method=torch.nn.init.ones_,
                              bias=False, input_is_parallel=True, skip_bias_add=False,
                              tp_group=groups.tp_group())
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = layer(x)
    torch.testing.assert_close(out, x @ layer.weight.T)


def test_sequence_parallel_buffers_still_ask_for_the_cuda_device():
    """The CPU patch exists because these modules allocate on torch.cuda.current_device();
    if they stop doing so (or the CPU torch stops raising), revisit the patch."""
    import importlib
    import inspect

    import pytest

    from parallel.primitives.megatron_compat import CUDA_DEVICE_MODULES, _TorchOnCpu

    if torch.cuda.is_available():
        pytest.skip("the patch applies only without CUDA")
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    for name in CUDA_DEVICE_MODULES:
        module = importlib.import_module(name)
        source = inspect.getsource(module)
        assert "torch.cuda.current_device()" in source, name
        groups.ensure_initialized()
        assert isinstance(module.torch, _TorchOnCpu), name  # and the patch is in place


def test_tp_matmul_autocast_decorators_are_still_cuda_only():
    """If megatron decorates its TP matmul for CPU autocast too, drop our re-decoration."""
    import inspect

    from megatron.core.tensor_parallel import layers

    source = inspect.getsource(layers)
    assert 'partial(torch.amp.custom_fwd, device_type="cuda")' in source
    assert 'partial(torch.amp.custom_bwd, device_type="cuda")' in source
    groups.ensure_initialized()
    if not torch.cuda.is_available():  # patched: the wrapped forward now names the CPU
        forward = layers.LinearWithGradAccumulationAndAsyncCommunication.forward
        cells = [c.cell_contents for c in forward.__closure__ or ()]
        assert "cpu" in cells


def megatron_group_timeouts(timeout_s_of_groups: float) -> dict[str, str]:
    """{megatron-core group: its timeout} after `ensure_initialized` with that timeout."""
    from megatron.core import parallel_state

    from tests.distributed import group_timeout

    groups.ensure_initialized(timeout_s=timeout_s_of_groups)
    return {name: str(group_timeout(getattr(parallel_state, f"get_{name}_group")()))
            for name in ("tensor_model_parallel", "pipeline_model_parallel", "data_parallel",
                         "model_parallel", "embedding", "position_embedding")}


def test_megatron_groups_take_a_timeout_in_fractional_minutes():
    """`timeout_minutes` passes seconds / 60 to megatron-core's whole-minute argument; if
    megatron starts rounding, validating or renaming it, the groups lose the timeout here."""
    import inspect
    from datetime import timedelta

    from megatron.core import parallel_state

    from parallel.primitives.megatron_compat import timeout_minutes
    from tests.distributed import run_distributed_test

    assert "distributed_timeout_minutes" in inspect.signature(
        parallel_state.initialize_model_parallel).parameters
    assert timedelta(minutes=timeout_minutes(7)) == timedelta(seconds=7)
    (found,) = run_distributed_test(megatron_group_timeouts, 1, timeout_s=120,
                                    set_up_groups=False, timeout_s_of_groups=7)
    assert found == dict.fromkeys(found, "0:00:07"), found
