"""distcore.clip_grad_norm_ on one process: torch's result on a plain model (its distributed cases are in
tests/distributed/transformers_worker.py, check_clip_grad_norm_is_the_whole_model_norm), and its errors."""

import math

import pytest
import torch

from tridist import distcore
from tests.hf_models import build


@pytest.mark.parametrize("norm_type, max_norm", [(2.0, 0.5), (1.0, 10.0), (math.inf, 0.1), (2.0, 1e9)])
def test_one_process_clips_as_torch_does(norm_type, max_norm):
    torch.manual_seed(0)
    models = [build("llama"), build("llama")]
    ids = torch.randint(3, 128, (2, 8))
    for model in models:
        model.model.layers[0].requires_grad_(False)  # no gradient: left out, as torch leaves it
        model(ids, labels=ids).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(models[0].parameters(), max_norm, norm_type)
    norm = distcore.clip_grad_norm_(models[1], max_norm, norm_type)
    # The same sums in another order: the norms agree to fp32 rounding of a sum of ~100 terms
    assert norm.item() == pytest.approx(expected.item(), rel=1e-5)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=0)


def test_errors_name_the_fix():
    model = build("llama")
    with pytest.raises(TypeError, match=r"pass the model .*torch.nn.utils.clip_grad_norm_ takes parameters"):
        distcore.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(ValueError, match="norm_type must be positive or inf, got 0.0"):
        distcore.clip_grad_norm_(model, 1.0, 0)
    ids = torch.randint(3, 128, (2, 8))
    model(ids, labels=ids).loss.backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="total norm of order 2.0 of the gradients is nan"):
        distcore.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
