"""Every family: the parts sum to the model's own logit, at every granularity, on a tiny perturbed model.

One tiny random model per family (``dla_recipes.testing.tiny``), every constant-initialised parameter moved away
from its init, a padded batch of three prompts of different lengths, a contrast token. The reference is the model's
own output: the logit the parts sum to is checked against a plain transformers forward of each prompt alone.
"""

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from conftest import (
    CONTRAST,
    PROMPTS,
    TARGET,
    assert_parts_are_the_models,
    eager_model,
    is_source_refusal,
    plain_logits,
    source_marks,
    tiny_model,
)

import dla_recipes
from dla_recipes.testing import tiny

ROOT = Path(__file__).resolve().parents[1]


def _softcap(z, cap):
    return z if cap is None else cap * torch.tanh(z / cap)


GRANULARITIES = ("block", "head", "neuron", "expert", "source")
# Families with routed-expert modules whose experts the family table does not split (its notes say why): by="expert"
# refuses them. Any other model with an ``*Expert*`` module must split its experts.
EXPERTS_NOT_SPLIT = {
    "inkling": "the MoE blocks' experts (a bmm shared-expert layout) are not split",
    "nemotron_h": "its experts have no gate, a layout the expert split does not read yet",
}


def _cases():
    """``(family, by)`` for every family and granularity; by="source" on a ``SOURCE_WRONG`` family a strict xfail."""
    for family in tiny.FAMILIES:
        for by in GRANULARITIES:
            yield pytest.param(family, by, marks=source_marks(family) if by == "source" else ())


@pytest.mark.parametrize(("family", "by"), list(_cases()))
def test_parts_sum_to_the_models_logit(family, by):
    """The padded batch of three prompts (target minus contrast, last position) at ``by``: each prompt's parts sum to
    a plain transformers forward of that prompt alone (``conftest.plain_differences``: pre-cap, target minus
    contrast), within the float32 promise 1e-4 * max(1, |logit|). Measured over every family and granularity: at
    most 6.8e-7 (relative). A padding-unsafe family is run grouped by length by ``attribute``: the same check.
    ``by="expert"`` on a model without split experts must refuse (InputError); ``by="source"`` (eager attention)
    either refuses clearly (``conftest.is_source_refusal``; which families must split is test_sources.py's) or
    sums exactly."""
    model = eager_model(family) if by == "source" else tiny_model(family)
    if by == "expert":
        try:
            dla_recipes.plan.build_plan(model).require("expert")
        except dla_recipes.InputError:
            experts = sorted({type(m).__name__ for m in model._module.modules() if "Expert" in type(m).__name__})
            assert not experts or family in EXPERTS_NOT_SPLIT, f"{family} has {experts}, but by='expert' refuses"
            with pytest.raises(dla_recipes.InputError, match="by='expert'"):
                dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="expert")
            return
    try:
        attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, position=-1, by=by)
    except dla_recipes.DLAError as error:
        if by == "source" and is_source_refusal(error):
            return
        raise
    assert_parts_are_the_models(model, attr, PROMPTS, f"{family} by={by}")
    if by == "source":
        assert any(".S" in label for label in attr.labels), f"{family}: by='source' split no head"


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_logit_is_the_plain_forward_logit(family):
    """What the parts sum to is the model's own: a plain transformers forward of each prompt (unpadded)."""
    model = tiny_model(family)
    plan = dla_recipes.plan.build_plan(model)
    target = model.tokenizer.convert_tokens_to_ids(TARGET)
    for prompt in PROMPTS:
        attr = dla_recipes.attribute(model, prompt, TARGET, position=-1)
        expected = float(plain_logits(model, prompt)[-1, target])
        assert float(attr.output_logit[0]) == pytest.approx(expected, abs=1e-4 * max(1.0, abs(expected)))
        assert float(_softcap(attr.logit[0], plan.softcap)) == pytest.approx(expected, abs=1e-4 * max(1.0, abs(expected)))


@pytest.mark.parametrize("family", [f for f in tiny.FAMILIES if not dla_recipes.families.family_of(tiny.config(f)).padding_safe])
def test_padding_unsafe_family_gives_each_prompt_its_own_logit(family):
    """Prompts of different lengths are never padded together on these families: each prompt's parts sum to a plain
    forward of that prompt alone, with no warning, in the user's order."""
    import warnings

    model = tiny_model(family)
    plan = dla_recipes.plan.build_plan(model)
    target = model.tokenizer.convert_tokens_to_ids(TARGET)
    prompts = PROMPTS + ["w17 w18"]  # two prompts of one length still share a batch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attr = dla_recipes.attribute(model, prompts, TARGET, by="head", batch_size=2)
    assert attr.prompts == tuple(prompts)
    for i, prompt in enumerate(prompts):
        expected = float(plain_logits(model, prompt)[-1, target])
        total = float(_softcap(attr.values[i].sum() + attr.constant[i], plan.softcap))
        assert total == pytest.approx(expected, abs=1e-4 * max(1.0, abs(expected))), (prompt, total, expected)


def _padded_last_logits(model, prompts) -> torch.Tensor:
    """``[batch, vocab]``: a plain transformers forward of the left-padded batch, fed exactly what an nnsight trace
    feeds the model (its mask-derived ``position_ids`` included), at each prompt's last token."""
    from nnsight.modeling.processing import supply_position_ids

    encoding = dict(model.tokenizer(prompts, return_tensors="pt", padding=True))
    supply_position_ids(model, encoding)
    with torch.no_grad():
        return model._module(**encoding).logits[:, -1].float()


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_padding_safety_is_measured(family):
    """A family declared padding-safe must be: its padded batch's logits are each prompt's own (a plain forward of
    the prompt alone). Declared unsafe is always allowed (attribute then never pads its prompts)."""
    model = tiny_model(family)
    entry = dla_recipes.families.family_of(model)
    padded = _padded_last_logits(model, PROMPTS)
    alone = torch.stack([plain_logits(model, prompt)[-1] for prompt in PROMPTS])
    moved = ((padded - alone).abs() / alone.abs().clamp(min=1.0)).max()
    if entry.padding_safe:
        assert float(moved) <= 1e-4, (
            f"{family}: declared padding_safe, but left padding moves its logits by {float(moved):.3g} (relative); "
            "set padding_safe=False on its entry in dla_recipes/families/"
        )


def test_tiny_configs_do_not_depend_on_what_was_built_before():
    """Each family's tiny config is the same whatever other configs were made first in the process: no config may
    edit its overrides in place (Gemma4UnifiedConfig forced the last entry of a shared ``layer_types`` list to
    ``full_attention``, which moved later ministral / cohere2 / vaultgemma / granite_swa models' logits by up to 0.11:
    tests of them depended on test order). In a fresh interpreter: this one's configs were made at collection."""
    import subprocess
    import sys

    script = (
        "from dla_recipes.testing import tiny\n"
        "first = {f: tiny.config(f).to_json_string() for f in tiny.FAMILIES}\n"
        "moved = [f for f in tiny.FAMILIES if tiny.config(f).to_json_string() != first[f]]\n"
        "print('moved:', moved)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "moved: []", done.stdout[-2000:]


def test_readme_counts_the_model_types():
    """README's "N model types" is the family table's count (the generated families page computes the same)."""
    spec = importlib.util.spec_from_file_location("dla_families_table", ROOT / "notebooks" / "families_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quoted = {int(n) for n in re.findall(r"(\d+) model types in the family table", readme)}
    quoted |= {int(n) for n in re.findall(r"table covers (\d+) model types", readme)}
    assert quoted == {table.count()}, f"README quotes {sorted(quoted)} model types; the table has {table.count()}"
    built = {tiny.config(family).model_type for family in tiny.FAMILIES} & {t for t, _ in table.model_types()}
    quoted_built = {int(n) for n in re.findall(r"(\d+) (?:of them|model types) built as tiny", readme)}
    assert quoted_built == {len(built)}, f"README says {sorted(quoted_built)} built as tiny models; {len(built)} are"
    page = table.render()
    for model_type, reason in dla_recipes.families.REFUSED.items():
        assert f"`{model_type}`" in page and reason in page


def test_refused_model_type_names_its_reason():
    from types import SimpleNamespace

    for model_type, reason in dla_recipes.families.REFUSED.items():
        with pytest.raises(dla_recipes.UnknownFamilyError, match=re.escape(reason[:40])):
            dla_recipes.families.family_of(SimpleNamespace(model_type=model_type))
