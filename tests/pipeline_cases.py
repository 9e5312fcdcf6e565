"""What the pipeline tests of every connection (DWA, AttnRes, MUDD, HC) share: one step of
the single-process reference model, a plan's stages chained by hand in one process, and
cases run on ranks against the reference.

A reference is (full state, tokens (batch, S + 1), loss, {name: full grad}). Tolerances
(fp32): loss 1e-5 absolute; gradients 1e-5 relative per tensor, unless a case says
otherwise (`grad_tolerance`: TP sums round in another order).
"""

from __future__ import annotations

import torch

from tests.distributed import run_distributed_test


def relative_error(grad: torch.Tensor, ref: torch.Tensor) -> float:
    return ((grad - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def reference_step(model, batch: int, microbatches: int, gen: torch.Generator) -> tuple:
    """The reference of `model` (its weights already drawn): one step on `batch` random
    sequences from `gen`, the loss averaged over `microbatches` as the trainer does."""
    from pretrain.model.state import full_model_state

    cfg = model.config
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    total = 0.0
    for part in tokens.chunk(microbatches):
        loss = model.loss(part[:, :-1], part[:, 1:])
        (loss / microbatches).backward()
        total += loss.item() / microbatches
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return full_model_state(model), tokens, total, grads


def check_stages_chained(cfg, plan, reference: tuple, checkpointing: bool, label) -> tuple:
    """`plan`'s stages of one StageModel (the reference's weights) chained by hand in this
    process on the reference's tokens, one micro-batch. Asserts the loss and every gradient
    equal the reference's (`label` names the case in a failure); returns (the StageModel,
    the tensors that crossed each boundary, in order)."""
    from parallel.strategies.stage_model import StageModel, StageModule
    from pretrain.model.state import load_full_model_state

    state, tokens, ref_loss, ref_grads = reference
    model = StageModel(cfg, plan.programs, seed=1)
    load_full_model_state(model, state)
    stages = [StageModule(model, program, checkpointing) for program in plan.programs]
    crossed = [stages[0](tokens[:, :-1])]
    for stage in stages[1:]:
        crossed.append(stage(*crossed[-1]))
    loss = model.head_loss(*crossed.pop(), tokens[:, 1:])
    loss.backward()
    assert abs(loss.item() - ref_loss) < 1e-5, label
    for name, param in model.named_parameters():
        assert relative_error(param.grad, ref_grads[name]) < 1e-5, (label, name)
    return model, crossed


def step_gradient_errors(runner, tokens, case: dict, dp: int, ref_loss: float,
                         ref_grads: dict) -> dict[str, float]:
    """One train step of a PipelineRunner on this DP rank's share of `tokens` (`case`'s
    micro-batches), its gradients reduced as the trainer reduces them (averaged over DP;
    under sequence parallelism the replicated weights' partial sums added over TP). Asserts
    the loss equals `ref_loss` to 1e-5; returns each parameter's relative gradient error
    against `ref_grads` (gathered over TP)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from parallel.primitives.tensor import allreduce_sequence_parallel_grads
    from pretrain.model.state import _gather_full

    local = tokens.chunk(dp)[ps.get_data_parallel_rank()]
    loss = runner.train_step(local[:, :-1], local[:, 1:]) / case["microbatches"]
    model = runner.model
    if dp > 1:  # as the trainer's average_gradients
        group = ps.get_data_parallel_group()
        for param in model.parameters():
            dist.all_reduce(param.grad, group=group)
            param.grad /= dp
        dist.all_reduce(loss, group=group)
        loss /= dp
    if case.get("sequence_parallel"):
        allreduce_sequence_parallel_grads(model, model.tp_group)
    assert abs(loss.item() - ref_loss) < 1e-5, (case["id"], loss.item(), ref_loss)
    return {name: relative_error(_gather_full(p, p.grad, model.tp_group), ref_grads[name])
            for name, p in model.named_parameters()}


def pipeline_cases(cases: list[dict], dp: int, check=None) -> dict:
    """Run each case on this rank; returns {case id: worst relative gradient error}.

    A case holds `id`, the model's `config`, its `reference`, `microbatches`, `split` and
    `virtual_stages`; optionally `sequence_parallel`, `runner_options` (more PipelineRunner
    arguments), `grad_tolerance` and `eval_loss` (then the forward-only loss and the
    gathered full state are checked too). `check(runner, case, errors)`, a module-level
    function, adds a connection's own assertions after the step."""
    import torch.distributed as dist

    from parallel.strategies.pipeline import PipelineRunner

    worst = {}
    for case in cases:
        state, tokens, ref_loss, ref_grads = case["reference"]
        m = case["microbatches"]
        runner = PipelineRunner(
            case["config"], microbatches=m, micro_batch=tokens.shape[0] // (dp * m),
            virtual_stages=case["virtual_stages"], pp_split=case["split"], seed=3,
            sequence_parallel=case.get("sequence_parallel", False),
            **case.get("runner_options", {}))
        runner.load_model_state(state)
        errors = step_gradient_errors(runner, tokens, case, dp, ref_loss, ref_grads)
        if check is not None:
            check(runner, case, errors)
        name = max(errors, key=errors.get)
        assert errors[name] < case.get("grad_tolerance", 1e-5), (case["id"], name, errors[name])
        worst[case["id"]] = errors[name]
        if case.get("eval_loss") is not None:  # forward only, by send/recv
            runner.eval()
            assert abs(runner.loss(tokens[:, :-1], tokens[:, 1:]).item()
                       - case["eval_loss"]) < 1e-5
            full = runner.full_model_state()
            if dist.get_rank() == 0:
                assert full.keys() == state.keys()
                assert all(torch.equal(full[n], state[n]) for n in state)
    return worst


def with_eval_check(cases: list[dict]) -> list[dict]:
    """Mark the first case to also check forward-only evaluation and the gathered state."""
    from pretrain.model import DenseFormer
    from pretrain.model.state import load_full_model_state

    case = cases[0]
    state, tokens, _, _ = case["reference"]
    model = DenseFormer(case["config"])
    load_full_model_state(model, state)
    with torch.no_grad():
        case["eval_loss"] = model.loss(tokens[:, :-1], tokens[:, 1:]).item()
    return cases


def run_cases_on_ranks(cases: list[dict], *, tp: int, pp: int, dp: int, timeout_s: float,
                       check=None) -> list[dict]:
    """`pipeline_cases` on TP x PP x DP ranks, the first case with the evaluation check;
    asserts every rank ran every case and returns each rank's {case id: worst error}."""
    cases = with_eval_check(cases)
    results = run_distributed_test(pipeline_cases, tp * pp * dp, timeout_s, tp=tp, pp=pp,
                                   cases=cases, dp=dp, check=check)
    assert all(set(r) == {c["id"] for c in cases} for r in results)
    return results
