"""nnterp load failures become a ``LoadError`` naming the model type, the standardized module nnterp could not find,
and the ``rename_config`` that would load the model (issue 12, item 6).

Tiny random models of types nnterp 1.3.0 cannot load as they are (``notes/nnterp_load_survey.py`` lists them all),
and a Llama whose final norm was moved to a name nnterp does not know.
"""

import pytest
import torch
import transformers
from nnterp.rename_utils import RenameConfig

import dla_recipes
from dla_recipes import LoadError
from dla_recipes.testing import tiny


def _tiny(model_type: str, **over):
    config = transformers.AutoConfig.for_model(model_type, **tiny.llama_like(**over))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def _load(model, **kwargs):
    return dla_recipes.load(model, tokenizer=tiny.tokenizer(), device_map="cpu", **kwargs)


def test_missing_layers_names_the_type_the_module_and_the_rename():
    """HRM's two recurrent stacks: nnterp finds no `layers`; the error names both candidate lists."""
    model = _tiny("hrm_text")
    with pytest.raises(LoadError) as caught:
        _load(model)
    text = str(caught.value)
    assert "'hrm_text'" in text and "no 'layers' module" in text and "RenameConfig(layers_name=" in text
    assert isinstance(caught.value, dla_recipes.DLAError)


def _llama_with_moved_norm():
    """A tiny Llama whose final norm lives under a name nnterp does not know (``model.last_norm``); it still runs."""
    model = tiny.build("llama")
    body = model.model
    body.last_norm = body.norm
    del body.norm
    body.norm = lambda hidden: body.last_norm(hidden)  # a plain attribute: the forward still calls the norm
    return model


def test_missing_final_norm_names_a_rename_that_loads_it():
    model = _llama_with_moved_norm()
    with pytest.raises(LoadError, match=r"'llama' model .*no 'ln_final' module") as caught:
        _load(model)
    text = str(caught.value)
    assert "RenameConfig(ln_final_name='model.last_norm')" in text, text
    loaded = _load(model, rename_config=RenameConfig(ln_final_name="model.last_norm"))  # the suggested fix loads
    assert loaded.ln_final._module is model.model.last_norm


def test_other_nnterp_failures_are_load_errors_too():
    """A failure that is not a missing module still names the model type and nnterp's own words."""
    model = tiny.build("llama")
    with pytest.raises(LoadError, match=r"nnterp could not load this 'llama' model \(LlamaForCausalLM\)"):
        _load(model, rename_config=RenameConfig(attn_name="input_layernorm"))  # would shadow self_attn
