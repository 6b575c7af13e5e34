"""FrozenNorm: probing recovers each norm's bias, centering, gain and eps; frozen(stream) + bias == norm(stream)."""

import bounds
import pytest
import torch
from transformers.models.cohere.modeling_cohere import CohereLayerNorm
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from dla_recipes.math import FrozenNorm, probe_norm

D = 24


def _layernorm():
    norm = torch.nn.LayerNorm(D, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(D))
        norm.bias.copy_(0.3 * torch.randn(D))
    return norm, norm.weight, norm.bias, True


def _layernorm_plain():
    return torch.nn.LayerNorm(D, elementwise_affine=False, eps=1e-5), torch.ones(D), torch.zeros(D), True


def _rmsnorm():
    norm = LlamaRMSNorm(D, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(D))
    return norm, norm.weight, torch.zeros(D), False


def _gemma_rmsnorm():
    norm = GemmaRMSNorm(D, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.5 * torch.randn(D))
    return norm, 1 + norm.weight, torch.zeros(D), False


def _cohere_layernorm():
    norm = CohereLayerNorm(D, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(D))
    return norm, norm.weight, torch.zeros(D), True


NORMS = {
    "layernorm": _layernorm,
    "layernorm-no-affine": _layernorm_plain,
    "rmsnorm": _rmsnorm,
    "gemma-rmsnorm-1+w": _gemma_rmsnorm,
    "cohere-weight-only-layernorm": _cohere_layernorm,
}


@pytest.fixture(params=list(NORMS))
def norm_case(request):
    torch.manual_seed(0)
    return NORMS[request.param]()


def test_probes_recover_bias_centering_and_gain(norm_case):
    norm, gain, bias, centers = norm_case
    probe = probe_norm(norm)
    assert probe.centers is centers
    torch.testing.assert_close(probe.bias, bias.detach().float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(probe.gain, gain.detach().float(), atol=1e-5, rtol=1e-5)
    assert probe.eps == pytest.approx(norm.eps if hasattr(norm, "eps") else norm.variance_epsilon, rel=0.05)


def test_frozen_plus_bias_equals_norm(norm_case):
    norm, *_ = norm_case
    stream = 3 * torch.randn(2, 5, D) + 1.5
    frozen = FrozenNorm(norm, stream)
    with torch.no_grad():
        torch.testing.assert_close(frozen(stream) + frozen.bias, norm(stream), atol=1e-5, rtol=1e-5)
    assert frozen.scale.shape == (2, 5)
    assert frozen.fit_error < 1e-5


def test_frozen_is_linear_and_transpose_is_its_adjoint(norm_case):
    norm, *_ = norm_case
    stream = torch.randn(3, D)
    frozen = FrozenNorm(norm, stream)
    parts = torch.randn(3, 4, D)  # four parts per position
    torch.testing.assert_close(frozen(parts).sum(1), frozen(parts.sum(1)), atol=1e-5, rtol=1e-5)
    v = torch.randn(3, D)
    lhs = (frozen(parts) * v[:, None]).sum(-1)
    rhs = (parts * frozen.transpose(v)[:, None]).sum(-1)
    torch.testing.assert_close(lhs, rhs, atol=1e-5, rtol=1e-5)


def test_decomposed_stream_sums_through_the_frozen_norm(norm_case):
    """The point of freezing: parts of the real stream pass through one by one and sum to the norm's output."""
    norm, *_ = norm_case
    parts = torch.randn(2, 6, D)
    stream = parts.sum(1)
    frozen = FrozenNorm(norm, stream)
    with torch.no_grad():
        torch.testing.assert_close(frozen(parts).sum(1) + frozen.bias, norm(stream), atol=1e-5, rtol=1e-5)
        # the unfrozen norm applied per part does not sum (why the norm must be frozen)
        assert not torch.allclose(norm(parts).sum(1), norm(stream), atol=1e-2)


def test_frozen_scale_uses_the_norms_real_output():
    """Given the norm's real output (as read in a trace), the scale is fitted to it, not recomputed."""
    norm, *_ = _rmsnorm()
    stream = torch.randn(4, D)
    with torch.no_grad():
        output = norm(stream)
    frozen = FrozenNorm(norm, stream, output=output)
    torch.testing.assert_close(frozen(stream) + frozen.bias, output, atol=1e-6, rtol=1e-6)


def test_odd_width_norm():
    norm = torch.nn.LayerNorm(7)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 8.0))
        norm.bias.copy_(torch.linspace(-1, 1, 7))
    probe = probe_norm(norm)
    torch.testing.assert_close(probe.gain, norm.weight.detach(), atol=1e-5, rtol=1e-5)
    stream = torch.randn(3, 7)
    frozen = FrozenNorm(norm, stream, probe=probe)
    with torch.no_grad():
        torch.testing.assert_close(frozen(stream) + frozen.bias, norm(stream), atol=1e-5, rtol=1e-5)


def test_bfloat16_norm_is_frozen_at_its_own_precision():
    torch.manual_seed(0)
    norm, *_ = _layernorm()
    norm = norm.to(torch.bfloat16)
    stream = torch.randn(4, D, dtype=torch.bfloat16)
    frozen = FrozenNorm(norm, stream)
    with torch.no_grad():
        reference = norm(stream).float()
    # the module's bfloat16 LayerNorm: its normalised input, the gain's product and the bias's sum each stored in
    # bfloat16 at most (u of each), its statistics in float32 (gamma_{2D+2} of the centred input's size); the frozen
    # norm's the same, and its gain read off the module's bfloat16 output on a +/-a probe (nn.LayerNorm takes no
    # float32 input beside bfloat16 weights): that output and the bias stored, u (|g| a + 2 |b|) / a of the gain
    # (measured before: 6.0e-3 of the output's largest entry over 200 seeds; seed 155 missed the model without the
    # probe's rounding, a channel of gain -0.01 beside a bias of 0.55)
    x = stream.float()
    sigma = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + norm.eps)
    normed = ((x - x.mean(-1, keepdim=True)) / sigma).abs()
    gain, bias = norm.weight.detach().float().abs(), norm.bias.detach().float().abs()
    u = bounds.unit_roundoff(torch.bfloat16)
    a = (D / (D - 1)) ** 0.5  # the probe's amplitude (frozen_norm._probe)
    statistics = 2 * bounds.gamma(2 * D + 2) * (normed + x.abs().mean(-1, keepdim=True) / sigma) * gain
    probed = u * (gain * a + 2 * bias) / a * normed
    limit = u * (reference.abs() + 2 * normed * gain) + statistics + probed
    assert bool(((frozen(stream) + frozen.bias - reference).abs() <= limit).all())


def test_norm_without_weights_is_probed_at_the_width_of_its_stream():
    """nanochat's RMSNorm has no parameters: its width comes from the stream it reads, and freezing it at that
    stream reproduces the module's own output."""
    from transformers.models.nanochat.modeling_nanochat import NanoChatRMSNorm

    from dla_recipes.math.frozen_norm import FrozenNorm, probe_norm

    norm = NanoChatRMSNorm(eps=1e-6)
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(0)) * 3
    with pytest.raises(ValueError, match="cannot tell the width"):
        probe_norm(norm)
    frozen = FrozenNorm(norm, x)
    assert frozen.gain.shape == (24,) and frozen.fit_error < 1e-6
    assert torch.allclose(frozen(x) + frozen.bias, norm(x), atol=1e-6)
